"""``txl serve``."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from txl.cli.common import DEFAULT_GENERATE_THREADS, _set_threads
from txl.config import Quantization, ServeLimits


@dataclass
class ServeArgs(ServeLimits):
    """The arguments of ``txl serve`` (each an option; these docstrings are its ``--help``): the limits of one
    request's work (:class:`txl.config.ServeLimits`), then the server's own."""

    model: Path | None = None
    """A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder."""
    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only)."""
    port: int = 8000
    """Port to listen on (0 to 65535)."""
    allow_remote: bool = False
    """Needed to bind any address other than the loopback (the API has no rate limits by client)."""
    api_key: str | None = None
    """Require this key (header Authorization: Bearer KEY) on every endpoint but /health, / and /docs (default: the
    TXL_API_KEY environment variable, if set)."""
    drain_timeout: float = 30.0
    """Seconds that SIGTERM (or Ctrl-C) lets the requests in flight run before ending them with finish_reason
    shutdown; the exit code is 0 when everything ended cleanly."""
    header_timeout: float = 10.0
    """Seconds a client has to send a request's headers (from the connection's start, or the first byte of the
    request): then 408 and the connection is closed."""
    body_timeout: float = 30.0
    """Seconds a client has to send a request's body, from the end of its headers."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle connection stays open between two requests."""
    unknown: Literal["error", "replace"] = "error"
    """Characters outside the model's vocabulary in a prompt or scored text: error (a 400 naming the first) or
    replace (the tokenizer's replacement symbol); a request's own "unknown" field overrides it."""
    served_model_name: list[str] | None = None
    """The names OpenAI's "model" field may give (default: the folder's name and txl)."""
    threads: int | None = None
    """torch CPU threads (default: 1, the fastest for token-by-token decoding on a shared machine)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (the GPU if there is one): where the model runs."""
    quantize: Quantization = "none"
    """Serve the model with its Linear layers in int8 (CPU): int8 (PyTorch's dynamic quantization) or
    int8-weight-only (torchao's, needs the extra 'quant'); none: as saved."""

    LOWEST = dict(max_batch=1, max_queue=0, max_prompt_tokens=1, max_new_tokens=1, max_score_tokens=2, max_mem_len=1,
                  max_tgt_len=1, max_stops=0, max_stop_chars=1, max_body_bytes=1024, drain_timeout=0,
                  stream_buffer_tokens=1, stream_timeout=0.1, header_timeout=0.1, body_timeout=0.1,
                  keep_alive_timeout=0.1)  # fmt: skip

    def validate(self) -> None:
        """One line naming the first option out of its range."""
        if self.model is None:
            raise ValueError("txl serve needs --model RUN_OR_DIR")
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.allow_remote:
            raise ValueError(
                f"--host {self.host}: binding beyond this machine needs --allow_remote true (and an --api_key)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port = {self.port}: must be in [0, 65535]")
        for name, low in self.LOWEST.items():
            if not getattr(self, name) >= low:
                raise ValueError(f"--{name} = {getattr(self, name)}: must be >= {low}")
        if self.served_model_name is not None and (not self.served_model_name or "" in self.served_model_name):
            raise ValueError("--served_model_name: give one or more non-empty names")

    def limits(self) -> ServeLimits:
        return ServeLimits(**{f.name: getattr(self, f.name) for f in fields(ServeLimits)})


def serve(args: ServeArgs) -> None:
    """Serve a model over HTTP: a web page at /, POST /v1/generate (JSON or a server-sent event stream), POST
    /v1/score, GET /v1/model, GET /health; the API's page at /docs. Concurrent generations are batched step by step.
    """
    try:
        import uvicorn

        from txl.serve.app import DrainingServer, create_app
        from txl.serve.http import ConnectionLimits, timed_protocol
    except ImportError as e:
        raise ValueError(
            f"txl serve needs the serve extra ({e.name} is missing): pip install 'transformer-xl[serve]'"
        ) from None
    args.validate()
    sock = _listen(
        args.host, args.port
    )  # (before the model loads: a busy port fails at once, before any URL is printed)
    _set_threads(DEFAULT_GENERATE_THREADS if args.threads is None else args.threads)
    key = args.api_key or os.environ.get("TXL_API_KEY") or None
    limits = args.limits()
    connections = ConnectionLimits(args.header_timeout, args.body_timeout, args.keep_alive_timeout)
    app = create_app(args.model, limits, key, args.device, unknown=args.unknown, served_names=args.served_model_name,
                     quantization=args.quantize)  # fmt: skip
    state = app.state.server
    free = None  # (the host's memory, or the GPU's)
    if state.device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info(state.device)[0]
    itemsize = next(state.model.parameters()).element_size()
    note = limits_memory_note(state.model.config, limits, itemsize, free, state.device)
    if note:
        print(f"txl serve: note: {note}", file=sys.stderr)
    host = args.host
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"txl serve: warning: listening on {host}, reachable from other machines"
              + ("" if key else " without an API key"), file=sys.stderr)  # fmt: skip
    where = "" if state.device.type == "cpu" else f", on {state.device}"
    shown = f"[{host}]" if ":" in host else host
    from txl.infer.evaluate import describe_reading

    reading = describe_reading(state.reading)
    print(f"txl serve: http://{shown}:{sock.getsockname()[1]}/ ({state.folder}{where}; reading with {reading})",
          file=sys.stderr, flush=True)  # fmt: skip
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=5, http=timed_protocol(connections),
        timeout_keep_alive=connections.keep_alive_timeout,
    )  # fmt: skip
    import signal

    # uvicorn raises a caught SIGTERM / SIGINT again for the handler it found once it has stopped: a no-op one makes
    # that a plain return, and the exit code is ours.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    import logging

    # asyncio warns "socket.send() raised exception." for every few writes to a connection its client has closed,
    # before the server learns that it is gone (a streaming client that leaves): routine here, not a fault.
    logging.getLogger("asyncio").addFilter(lambda r: r.getMessage() != "socket.send() raised exception.")
    server = DrainingServer(config, state, args.drain_timeout)
    state.on_fatal.append(lambda _failure: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
    if state.failure is not None:
        print(f"txl serve: stopped: the engine failed ({state.failure})", file=sys.stderr)
        raise SystemExit(1)
    if server.clean is False:
        print("txl serve: stopped: some requests did not end cleanly within --drain_timeout", file=sys.stderr)
        raise SystemExit(1)
    print("txl serve: stopped", file=sys.stderr)


def limits_memory(config, limits, itemsize: int = 4, device=None) -> int:  # noqa: ANN001
    """Bytes the server may hold at its limits: ``max_batch`` rows and as many parked generations (waiting for their
    slow clients, their rows given to others), each a generation's keys and values (its memory
    holds at most the longest prompt and answer, or max_mem_len; the cache keeps a prompt more, twice over) or a
    scored text's (its keys and values over max_mem_len + max_tgt_len positions, and one segment's attention
    probabilities), and the larger of one prompt's pass (prompts are read one at a time, a long one in pieces:
    :func:`~txl.cli.common.attention_pass_bytes` of its last piece over the whole prompt) and a step's [rows,
    vocabulary] log-probabilities."""
    from txl.cli.common import attention_pass_bytes
    from txl.infer.prompt import last_piece
    from txl.model.cache import KVCache

    per_position = 2 * config.n_layer * config.n_head * config.d_head * itemsize
    prompt = limits.max_prompt_tokens
    generation = KVCache.capacity_for(limits.max_mem_len, prompt, prompt + limits.max_new_tokens) * per_position
    seg = min(limits.max_tgt_len, limits.max_score_tokens)
    keys = limits.max_mem_len + seg
    score = 2 * keys * per_position + config.n_head * seg * keys * 4
    # (counted without same_length's window: the whole prompt before the last piece, whatever a request reads with)
    prompt_pass = attention_pass_bytes(config, 1, *last_piece(prompt, 0, limits.max_mem_len, False), device)
    transient = max(prompt_pass, 4 * limits.max_batch * config.n_token * 4)
    return limits.max_batch * (max(generation, score) + generation) + transient


def limits_memory_note(config, limits, itemsize: int = 4, free: int | None = None, device=None) -> str | None:  # noqa: ANN001
    """A note when the server's limits may hold more memory than this machine has free (``free``; default: what it
    has now): a busy server would then be stopped by the system, not by a request's error. None when they fit."""
    from txl.kernels.runtime import available_memory

    free = available_memory() if free is None else free
    needed = limits_memory(config, limits, itemsize, device)
    if free is None or needed <= free:
        return None
    return (
        f"at its limits ({limits.max_batch} rows of --max_mem_len {limits.max_mem_len:,}, --max_tgt_len "
        f"{limits.max_tgt_len:,}, --max_prompt_tokens {limits.max_prompt_tokens:,}) this server may hold about "
        f"{needed / 2**30:,.1f} GiB for this model, more than the {free / 2**30:,.1f} GiB free here: lower "
        "--max_batch, --max_mem_len or --max_tgt_len, so that a busy server is not stopped by the system"
    )


def _listen(host: str, port: int):
    """A socket bound to (host, port), or a one-line error if the address is taken or cannot be bound."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        why = "it is in use (another server?): pick another --port" if e.errno == 98 else e.strerror or str(e)
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {why}") from None
