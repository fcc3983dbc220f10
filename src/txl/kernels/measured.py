"""Whether a CPU fast path is faster than the reference on this machine: measured where it is used, kept per machine.
Design notes: docs/internals.md#txlkernelsmeasured."""

from __future__ import annotations

import json
import logging
import platform
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from txl.kernels.backends import backends
from txl.kernels.timing import Paired, margin, paired, spread

log = logging.getLogger("txl")

MAX_SAMPLES = 21  # the samples an unsettled choice pools (the latest)
RETRY_S = 30.0  # an unsettled choice is measured again after this long in a process
MAX_TRIES = 3  # measurements of one kind in one process (then its choice holds until the next process)
LIFETIME_S = 86400.0  # a settled choice of margin m (in units of Z errors) is kept LIFETIME_S * m**2, at most 30 days
MAX_LIFETIME_S = 30 * 86400.0
PATHS = {
    "native_attention": "the attention of attn_type 0 in inference (native kernel vs one SDPA call)",
    "native_attention_train": "the attention of attn_type 0 with gradients (native forward and backward vs PyTorch's)",
    "native_dropout": "dropout (native one-pass kernel vs the Philox mask in PyTorch operations)",
    "dropout_stream": "a new run's dropout masks: Philox's by the native kernel vs torch's own mask",
    "native_relu_dropout": "the feed-forward's relu + dropout as one native pass",
    "native_nll": "the adaptive softmax's NLL by the native kernel (vs log-softmax and gather)",
    "native_decode": "the one-token step of every layer as one native call (vs the Python loop)",
    "fast_decode": "the one-token step as one loop over the layers (vs the layers' forward)",
    "segment_projection": "training's W_q / W_kv products with one backward (vs a product per slice)",
}

_choices: dict[str, dict] = {}  # key -> a choice (see _choice), this process's (and the file's, once read)
_due: dict[str, float] = {}  # key -> when (time.monotonic) this process measures it again (absent: now)
_tries: dict[str, int] = {}  # key -> measurements of it in this process
_loaded = [False]
_lock = threading.RLock()  # (a measurement runs the reference, which may measure another path)
clock: Callable[[], float] = time.time
"""The wall clock of the choices' ages (a test replaces it)."""


def machine_key() -> str:
    """This machine and software, as the choices are kept under: CPU model and SIMD flags, torch, txl, threads."""
    from txl.kernels import native

    simd = ("avx", "fma", "amx", "asimd", "sve")
    flags = " ".join(sorted(f for f in native._cpu_flags().split() if f.startswith(simd)))
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):  # noqa: SIM115
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        txl_version = version("transformer-xl")
    except Exception:  # noqa: BLE001 (not installed: a source tree)
        txl_version = "source"
    lib = native.library_name()
    threads = torch.get_num_threads()
    return f"{model} | {flags} | torch {torch.__version__} | txl {txl_version} | {lib} | threads {threads}"


def _file():  # noqa: ANN202
    from txl.kernels import native

    return native.cache_dir() / "measured.json"


def _load() -> None:
    if _loaded[0]:
        return
    _loaded[0] = True
    try:
        saved = json.loads(_file().read_text()).get(machine_key(), {})
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(saved, dict):
        for k, v in saved.items():
            # (an entry of another schema, an older or newer txl's, is left out: measured again when used)
            if _valid(v):
                _choices.setdefault(k, v)


def _save() -> None:
    from txl.util.fileio import write_bytes

    path = _file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            every = json.loads(path.read_text())
            every = every if isinstance(every, dict) else {}
        except (OSError, ValueError):
            every = {}
        every[machine_key()] = dict(sorted(_choices.items()))
        write_bytes(path, json.dumps(every, indent=1).encode())
    except OSError:  # (a read-only home: the choices hold for this process)
        pass


def _bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


_kinds: dict[tuple, str] = {}  # (path, shapes, dtype, threads) -> its key (made once: a step asks at every call)


def kind_of(path: str, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> str:
    """The key a choice is kept under: the path, the operands' shapes rounded up to powers of two, dtype, threads."""
    threads = torch.get_num_threads()
    memo = (path, tuple(map(tuple, shapes)), dtype, threads)
    kind = _kinds.get(memo)
    if kind is None:
        dims = ";".join("x".join(str(_bucket(d)) for d in s) for s in shapes)
        kind = _kinds[memo] = f"{path} [{dims}] {str(dtype).replace('torch.', '')} threads {threads}"
        if len(_kinds) > 4096:  # (bounded: shapes that vary without end)
            _kinds.clear()
    return kind


def _valid(v: object) -> bool:
    """Whether a stored choice has this schema (another's is left out: measured again when used)."""
    return (
        isinstance(v, dict)
        and isinstance(v.get("use"), bool)
        and isinstance(v.get("settled"), bool)
        and all(type(v.get(k)) in (int, float) for k in ("ratio", "error", "at"))
        and isinstance(v.get("samples"), list)
        and all(type(r) in (int, float) and r > 0 for r in v["samples"])
    )


def ratio(fast: Callable[[], Any], reference: Callable[[], Any], grad_of: Sequence[Tensor] = ()) -> float:
    """The reference's time over the fast path's (above 1: the fast path is faster): :func:`paired`'s median."""
    return paired(fast, reference, grad_of).median


def _lifetime(choice: dict) -> float:
    return min(LIFETIME_S * margin(choice["ratio"], choice["error"]) ** 2, MAX_LIFETIME_S)


def _current(kind: str) -> dict | None:
    """The choice for ``kind`` if it holds now, else None (never measured, or due to be measured again)."""
    choice = _choices.get(kind)
    if choice is None:
        return None
    due = _due.get(kind)
    if due is not None and (time.monotonic() < due or _tries.get(kind, 0) >= MAX_TRIES):
        return choice
    if choice["settled"] and clock() - choice["at"] < _lifetime(choice):
        _due[kind] = time.monotonic() + RETRY_S  # (its age looked at again after that)
        return choice
    return None


def decided(path: str, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> bool | None:
    """Whether the fast path runs for these operands, where that is known without measuring: True where it runs
    unmeasured (``Backends.measured`` off, code being compiled), the choice in force here, else None (the caller
    then asks :func:`faster`, which measures)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or not backends().measured:
        return True
    kind = kind_of(path, shapes, dtype)
    if not _loaded[0]:
        with _lock:
            _load()
    choice = _current(kind)
    return None if choice is None else choice["use"]


def faster(path: str, shapes: Sequence[Sequence[int]] | str, dtype: torch.dtype | None, fast: Callable[[], Any],
           reference: Callable[[], Any], grad_of: Sequence[Tensor] = ()) -> bool:  # fmt: skip
    """Whether the fast path ``path`` is to run for operands of these ``shapes`` and ``dtype`` (kept under
    :func:`kind_of`; a string: the key itself): True where ``Backends.measured`` is off, and in code being compiled
    or exported (no timing there); else the choice in force, measured where there is none (the module docstring's
    rule: ``fast`` and ``reference`` compute the same on the caller's operands; the caller then runs the one
    chosen)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or not backends().measured:
        return True
    kind = shapes if isinstance(shapes, str) else kind_of(path, shapes, dtype)
    choice = _current(kind)
    if choice is None:
        with _lock:
            _load()
            choice = _current(kind)
            if choice is None:
                choice = _measure(kind, fast, reference, grad_of)
    return choice["use"]


def _measure(kind: str, fast: Callable[[], Any], reference: Callable[[], Any], grad_of: Sequence[Tensor]) -> dict:
    """Measure ``kind`` now (pooled with an unsettled choice's samples), keep and log the choice."""
    earlier = _choices.get(kind)
    pooled = list(earlier["samples"]) if earlier and not earlier["settled"] else []
    samples = (pooled + list(paired(fast, reference, grad_of).ratios))[-MAX_SAMPLES:]
    m = Paired(tuple(samples))
    choice = _choices[kind] = {
        "use": m.median >= 1.0, "ratio": round(m.median, 4), "error": round(m.error, 4), "settled": m.settled,
        "samples": [round(r, 4) for r in samples], "at": round(clock()),
    }  # fmt: skip
    _due[kind] = time.monotonic() + RETRY_S
    _tries[kind] = _tries.get(kind, 0) + 1
    _save()
    verdict = "used" if choice["use"] else "not used: the reference is faster here"
    state = "settled" if m.settled else "within the noise: measured again later"
    log.warning(
        "txl: measured %s: %.2fx the reference's speed (+-%.0f%%, %d rounds; %s), %s",
        kind, m.median, spread(m.error), len(samples), state, verdict,
    )  # fmt: skip
    return choice


def choices() -> dict[str, dict]:
    """This machine's choices so far (read from the file too), key -> {"use", "ratio", "error", "settled",
    "samples", "at"}."""
    with _lock:
        _load()
        return dict(_choices)


def describe() -> str:
    """The choices, a line each, for ``txl --version``."""
    made = choices()
    if not made:
        return "CPU fast paths: none measured on this machine yet (each is timed against PyTorch's at its first use)"
    lines = [f"CPU fast paths measured on this machine ({machine_key()}):"]
    for k, v in sorted(made.items()):
        state = "settled" if v["settled"] else f"within the noise, {len(v['samples'])} samples: measured again"
        lines.append(f"  {k}: {v['ratio']:.2f}x +-{spread(v['error']):.0f}% ({state}) -> {'on' if v['use'] else 'off'}")
    return "\n".join(lines)


def forget() -> None:
    """Forget the choices in memory (the file stays): tests."""
    with _lock:
        _choices.clear()
        _due.clear()
        _tries.clear()
        _loaded[0] = False
