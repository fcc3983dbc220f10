"""``txl serve``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

from txl.cli.common import DEFAULT_GENERATE_THREADS, _set_threads
from txl.config import Quantization


def serve(
    model: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    allow_remote: bool = False,
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    max_prompt_tokens: int = 4096,
    max_new_tokens: int = 1024,
    max_score_tokens: int = 200_000,
    max_mem_len: int = 8192,
    max_tgt_len: int = 2048,
    max_stops: int = 16,
    max_stop_chars: int = 256,
    max_body_bytes: int = 8 << 20,
    drain_timeout: float = 30.0,
    stream_buffer_tokens: int = 256,
    stream_timeout: float = 30.0,
    header_timeout: float = 10.0,
    body_timeout: float = 30.0,
    keep_alive_timeout: float = 5.0,
    unknown: Literal["error", "replace"] = "error",
    served_model_name: list[str] | None = None,
    threads: int | None = None,
    device: str = "auto",
    quantize: Quantization = "none",
) -> None:
    """Serve a model over HTTP: a web page at /, POST /v1/generate (JSON or a server-sent event stream), POST
    /v1/score, GET /v1/model, GET /health; the API's page at /docs. Concurrent generations are batched step by step.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder.
        host: Address to bind (127.0.0.1: this machine only).
        port: Port to listen on (0 to 65535).
        allow_remote: Needed to bind any address other than the loopback (the API has no rate limits by client).
        api_key: Require this key (header Authorization: Bearer KEY) on every endpoint but /health, / and /docs
            (default: the TXL_API_KEY environment variable, if set).
        max_batch: Rows in flight at most, whatever their memory lengths (a generation is one, a beam search one per
            beam, a scored text one; 1: one at a time).
        max_queue: Requests that may wait for a row; more get 429.
        max_prompt_tokens: Longest prompt, in tokens.
        max_new_tokens: Most tokens one request may ask for.
        max_score_tokens: Longest text /v1/score takes, in tokens.
        max_mem_len: Longest memory a request may ask for (its keys and values are kept per request).
        max_tgt_len: Longest segment /v1/score may ask for.
        max_stops: Most stop strings per request.
        max_stop_chars: Longest stop string, in characters.
        max_body_bytes: Largest request body, in bytes (413 beyond).
        drain_timeout: Seconds that SIGTERM (or Ctrl-C) lets the requests in flight run before ending them with
            finish_reason shutdown; the exit code is 0 when everything ended cleanly.
        stream_buffer_tokens: Tokens of one generation made ahead of what its client has read, at most (a client that
            reads slowly slows its own generation, whose row waits for it meanwhile).
        stream_timeout: Seconds a response may wait for its client to read before the connection is closed and the
            request cancelled.
        header_timeout: Seconds a client has to send a request's headers (from the connection's start, or the
            first byte of the request): then 408 and the connection is closed.
        body_timeout: Seconds a client has to send a request's body, from the end of its headers.
        keep_alive_timeout: Seconds an idle connection stays open between two requests.
        unknown: Characters outside the model's vocabulary in a prompt or scored text: error (a 400 naming the
            first) or replace (the tokenizer's replacement symbol); a request's own "unknown" field overrides it.
        served_model_name: The names OpenAI's "model" field may give (default: the folder's name and txl).
        threads: torch CPU threads (default: 1, the fastest for token-by-token decoding on a shared machine).
        device: cpu, cuda, cuda:N or auto (the GPU if there is one): where the model runs.
        quantize: Serve the model with its Linear layers in int8 (CPU): int8 (PyTorch's dynamic quantization) or
            int8-weight-only (torchao's, needs the extra 'quant'); none: as saved.
    """
    try:
        import uvicorn

        from txl.serve.app import DrainingServer, ServeLimits, create_app
        from txl.serve.http import ConnectionLimits, timed_protocol
    except ImportError as e:
        raise ValueError(
            f"txl serve needs the serve extra ({e.name} is missing): pip install 'transformer-xl[serve]'"
        ) from None
    if model is None:
        raise ValueError("txl serve needs --model RUN_OR_DIR")
    if host not in ("127.0.0.1", "localhost", "::1") and not allow_remote:
        raise ValueError(f"--host {host}: binding beyond this machine needs --allow_remote true (and an --api_key)")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port = {port}: must be in [0, 65535]")
    for name, value, low in [("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                             ("max_prompt_tokens", max_prompt_tokens, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("max_score_tokens", max_score_tokens, 2), ("max_mem_len", max_mem_len, 1),
                             ("max_tgt_len", max_tgt_len, 1), ("max_stops", max_stops, 0),
                             ("max_stop_chars", max_stop_chars, 1), ("max_body_bytes", max_body_bytes, 1024),
                             ("drain_timeout", drain_timeout, 0), ("stream_buffer_tokens", stream_buffer_tokens, 1),
                             ("stream_timeout", stream_timeout, 0.1), ("header_timeout", header_timeout, 0.1),
                             ("body_timeout", body_timeout, 0.1),
                             ("keep_alive_timeout", keep_alive_timeout, 0.1)]:  # fmt: skip
        if not value >= low:
            raise ValueError(f"--{name} = {value}: must be >= {low}")
    if served_model_name is not None and (not served_model_name or "" in served_model_name):
        raise ValueError("--served_model_name: give one or more non-empty names")
    sock = _listen(host, port)  # (before the model loads: a busy port fails at once, before any URL is printed)
    _set_threads(DEFAULT_GENERATE_THREADS if threads is None else threads)
    key = api_key or os.environ.get("TXL_API_KEY") or None
    limits = ServeLimits(
        max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, max_batch=max_batch, max_queue=max_queue,
        max_score_tokens=max_score_tokens, max_mem_len=max_mem_len, max_tgt_len=max_tgt_len, max_stops=max_stops,
        max_stop_chars=max_stop_chars, max_body_bytes=max_body_bytes, stream_buffer_tokens=stream_buffer_tokens,
        stream_timeout=stream_timeout,
    )  # fmt: skip
    connections = ConnectionLimits(header_timeout, body_timeout, keep_alive_timeout)
    app = create_app(model, limits, key, device, unknown=unknown, served_names=served_model_name, quantization=quantize)
    state = app.state.server
    free = None  # (the host's memory, or the GPU's)
    if state.device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info(state.device)[0]
    itemsize = next(state.model.parameters()).element_size()
    note = limits_memory_note(state.model.config, limits, itemsize, free, state.device)
    if note:
        print(f"txl serve: note: {note}", file=sys.stderr)
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
    server = DrainingServer(config, state, drain_timeout)
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
