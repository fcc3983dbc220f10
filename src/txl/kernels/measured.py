"""Whether a CPU fast path is faster than the reference on this machine: measured at its first use, kept per machine.

The native kernels were written on AVX-512 machines; on a CPU with AVX2 only, PyTorch's kernels can be faster (the
native attention made a bench-char training step 1.5x slower on a 2-core AVX2 EPYC). So, as the fp32 GEMM route
(``txl.kernels.runtime.CheckedRoute``), each CPU fast path runs only where it was measured faster here:

* the first time a path could run for a kind of operand (its shapes rounded up to powers of two, the dtype, the
  threads), :func:`faster` times it against the reference on those operands: one warm-up call each, then paired
  rounds (which goes first alternates), the median of the ratios; with gradients the backward is timed too
  (``torch.autograd.grad`` with respect to the operands: no parameter's ``.grad`` is touched). Torch's random state
  is forked around it: the run draws the same numbers as without the measurement;
* the choice is kept in memory and in ``measured.json`` beside the native library (``~/.cache/txl/native``), under
  this machine's key (CPU model and flags, torch and txl versions, threads): later processes read it;
* every choice is logged once (the ``txl`` logger: a run's log) and ``txl --version`` lists this machine's.

``Backends.measured`` False (``TXL_MEASURE=0``; the tests) runs every fast path wherever it applies.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from txl.kernels.admission import check_scope
from txl.kernels.backends import backends

log = logging.getLogger("txl")

ROUNDS = 5  # paired rounds after the warm-up (the median of their ratios decides)
PATHS = {
    "native_attention": "the attention of attn_type 0 in inference (native kernel vs one SDPA call)",
    "native_attention_train": "the attention of attn_type 0 with gradients (native forward and backward vs PyTorch's)",
    "native_dropout": "dropout (native one-pass kernel vs the PyTorch mask)",
    "native_relu_dropout": "the feed-forward's relu + dropout as one native pass",
    "native_nll": "the adaptive softmax's NLL by the native kernel (vs log-softmax and gather)",
    "native_decode": "the one-token step of every layer as one native call (vs the Python loop)",
    "segment_projection": "training's W_q / W_kv products with one backward (vs a product per slice)",
}

_choices: dict[str, dict] = {}  # key -> {"use": bool, "ratio": float}, this process's (and the file's, once read)
_loaded = [False]
_lock = threading.RLock()  # (a measurement runs the reference, which may measure another path)
timer: Callable[[], float] = time.perf_counter
"""The clock (a test replaces it to fake a measurement)."""


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
    return f"{model} | {flags} | torch {torch.__version__} | txl {txl_version} | threads {torch.get_num_threads()}"


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
            if isinstance(v, dict) and isinstance(v.get("use"), bool) and type(v.get("ratio")) in (int, float):
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


def _once(fn: Callable[[], Any], grad_of: Sequence[Tensor]) -> float:
    t = timer()
    out = fn()
    if grad_of:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        outs = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
        torch.autograd.grad(outs, list(grad_of), [torch.ones_like(o) for o in outs], allow_unused=True)
    return timer() - t


def ratio(fast: Callable[[], Any], reference: Callable[[], Any], grad_of: Sequence[Tensor] = ()) -> float:
    """The reference's time over the fast path's (above 1: the fast path is faster): the median of ``ROUNDS`` paired
    rounds after one warm-up call of each; with ``grad_of`` (operands that require gradients) their backward too."""
    grad_of = [t for t in grad_of if isinstance(t, Tensor) and t.requires_grad] if torch.is_grad_enabled() else []
    with torch.random.fork_rng(devices=[]), check_scope():
        _once(fast, grad_of), _once(reference, grad_of)
        ratios = []
        for i in range(ROUNDS):
            if i % 2:
                r, f = _once(reference, grad_of), _once(fast, grad_of)
            else:
                f, r = _once(fast, grad_of), _once(reference, grad_of)
            ratios.append(r / max(f, 1e-9))
    return statistics.median(ratios)


def decided(path: str, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> bool | None:
    """Whether the fast path runs for these operands, where that is known without measuring: True where it runs
    unmeasured (``Backends.measured`` off, code being compiled), the choice made here earlier, else None (the caller
    then asks :func:`faster`, which measures)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or not backends().measured:
        return True
    choice = _choices.get(kind_of(path, shapes, dtype))
    if choice is None and not _loaded[0]:
        with _lock:
            _load()
        choice = _choices.get(kind_of(path, shapes, dtype))
    return None if choice is None else choice["use"]


def faster(path: str, shapes: Sequence[Sequence[int]] | str, dtype: torch.dtype | None, fast: Callable[[], Any],
           reference: Callable[[], Any], grad_of: Sequence[Tensor] = ()) -> bool:  # fmt: skip
    """Whether the fast path ``path`` is to run for operands of these ``shapes`` and ``dtype`` (kept under
    :func:`kind_of`; a string: the key itself): True where ``Backends.measured`` is off, and in code being compiled
    or exported (no timing there); else as measured here (at the first call for this kind: :func:`ratio` of ``fast``
    and ``reference``, which compute the same on the caller's operands; the caller then runs the one chosen)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting() or not backends().measured:
        return True
    kind = shapes if isinstance(shapes, str) else kind_of(path, shapes, dtype)
    choice = _choices.get(kind)
    if choice is None:
        with _lock:
            _load()
            choice = _choices.get(kind)
            if choice is None:
                r = ratio(fast, reference, grad_of)
                choice = _choices[kind] = {"use": r >= 1.0, "ratio": round(r, 3)}
                _save()
                verdict = "used" if choice["use"] else "not used: the reference is faster here"
                log.warning("txl: measured %s: %.2fx the reference's speed, %s", kind, r, verdict)
    return choice["use"]


def choices() -> dict[str, dict]:
    """This machine's choices so far (read from the file too), key -> {"use", "ratio"}."""
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
        lines.append(f"  {k}: {v['ratio']:.2f}x -> {'on' if v['use'] else 'off'}")
    return "\n".join(lines)


def forget() -> None:
    """Forget the choices in memory (the file stays): tests."""
    with _lock:
        _choices.clear()
        _loaded[0] = False
