"""Native kernels, built on first use with the machine's C compiler: the cached one-token decoding step, the
attention (inference, and training's forward and backward), dropout (and relu + dropout) and the softmax's negative
log-likelihood. Design notes: docs/internals.md#txlkernelsnative."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txl.kernels.backends import backends
from txl.kernels.runtime import functorch_wrapped

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.c")))  # built into one library
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
FLAG_SETS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-march=native"), ("-O3",))  # the first that builds
_LOCK = threading.Lock()
_LIB: dict[str, Any] = {}  # "lib": the loaded library or None, "why": why there is none, "path": its file


def _flag_sets() -> tuple[tuple[str, ...], ...]:
    """The compiler flags to try in order: ``$TXL_NATIVE_CFLAGS`` alone where it is set, else :data:`FLAG_SETS`."""
    given = os.environ.get("TXL_NATIVE_CFLAGS", "").strip()
    return (tuple(shlex.split(given)),) if given else FLAG_SETS


class _Gate(ctypes.Structure):
    """``txl_gate`` of decode.c: a GRU gate's weights (all NULL: the residual sum)."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("w", "u", "ug", "bg")]


class _Layer(ctypes.Structure):
    """``txl_layer`` of decode.c: one layer's tensors."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("qkv", "o", "ln1_w", "ln1_b", "w1", "b1", "w2", "b2", "ln2_w", "ln2_b", "u", "v")
    ] + [("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("scale", ctypes.c_float), ("pre_lnorm", ctypes.c_int)]
    _fields_ += [("identity_map", ctypes.c_int)]
    _fields_ += [("gate1", _Gate), ("gate2", _Gate)]


class _DropoutSpec(ctypes.Structure):
    """``dropout_spec`` of blocks.h: the dropout of the attention's probabilities."""

    _fields_ = [("seed", ctypes.c_uint64), ("threshold", ctypes.c_uint32), ("scale", ctypes.c_float)]


class _QueryBias(ctypes.Structure):
    """attention.c's query_bias: the queries' u and v rows and scale."""

    _fields_ = [
        ("u", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("us", ctypes.c_long),
        ("vs", ctypes.c_long),
        ("scale", ctypes.c_float),
    ]


QueryBias = tuple[Tensor, Tensor, float]
"""(u, v, scale): the attention kernels take the raw queries and compute (q + u) * scale and (qv + v) * scale
themselves, as the PyTorch path rounds them; u and v [H, Dh]."""


def _query_bias(query_bias: QueryBias | None) -> _QueryBias | None:
    if query_bias is None:
        return None
    u, v, scale = query_bias
    return _QueryBias(u.data_ptr(), v.data_ptr(), u.stride(0), v.stride(0), scale)


def _address(struct: ctypes.Structure | None) -> int | None:
    """A kernel's pointer argument to ``struct`` (None: NULL)."""
    return None if struct is None else ctypes.addressof(struct)


def _dropout_spec(p: float, seed: int) -> _DropoutSpec:
    """What :func:`dropout` gives its kernel for ``p`` and ``seed``."""
    return _DropoutSpec(seed & (2**64 - 1), min(round(p * 2.0**32), 2**32 - 1), 1.0 / (1.0 - p))


def cache_dir() -> Path:
    """Where built libraries are kept: ``$TXL_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/txl/native`` (default
    ``~/.cache/txl/native``)."""
    if os.environ.get("TXL_NATIVE_CACHE"):
        return Path(os.environ["TXL_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "txl" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _declare(lib: ctypes.CDLL) -> None:
    """The kernels' argument and result types (AttributeError: the library lacks one)."""
    lib.txl_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    lib.txl_exp.restype = None
    fn = lib.txl_decode_step
    fn.restype = ctypes.c_int
    P, L, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int  # noqa: N806
    fn.argtypes = [P, I, P, L, L, P, P, L, L, L, P, L, I, I, I, I, I, P, P, I]
    lib.txl_attention.argtypes = [P, L, L, L, P, L, L, L, P, L, L, L, P, L, L, L, P, L, L, P, L, L, L, P, L, L]
    lib.txl_attention.argtypes += [P, P, P, P, I, I, I, I, I, I]
    lib.txl_attention.restype = ctypes.c_int
    fn = lib.txl_attention_backward
    fn.argtypes = [P, L, L, L, P, L, L, L, P, L, L, L, P, L, L, L, P, L, L, P, P, L, L, L, P, P]
    fn.argtypes += [P, L, L, L, P, L, L, L, P, L, L, P, P, I, I, I, I, I, I]
    fn.restype = ctypes.c_int
    lib.txl_dropout.argtypes = [P, P, L, I, I, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float, I]
    lib.txl_dropout.restype = None
    lib.txl_relu_dropout_backward.argtypes = [P, P, P, L, I, ctypes.c_float, I]
    lib.txl_relu_dropout_backward.restype = None
    lib.txl_dropout_words.argtypes = [ctypes.c_uint64, P, L]
    lib.txl_dropout_words.restype = None
    lib.txl_nll_forward.argtypes = [P, L, L, L, P, P, P, I]
    lib.txl_nll_forward.restype = None
    lib.txl_nll_backward.argtypes = [P, L, L, L, P, P, P, P, L, I]
    lib.txl_nll_backward.restype = None
    lib.txl_nll_linear.argtypes = [P, L, I, L, P, L, P, P, P, I]
    lib.txl_nll_linear.restype = None


def _verified(path: Path) -> bool:
    """Whether the cached library ``path`` is there whole: its sha256 is the one recorded beside it at its build (a
    truncated file would kill the process with SIGBUS when loaded)."""
    try:
        recorded = Path(f"{path}.sha256").read_text().strip()
        return hashlib.sha256(path.read_bytes()).hexdigest() == recorded
    except OSError:
        return False


def _build() -> tuple[ctypes.CDLL | None, str, Path | None]:
    """Compile (or find) and load the library: (library, "" or why there is none, its path)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler found (install gcc, or set CC)", None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {cc!r} does not run: {e}", None
    sources = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    errors = []
    for flags in _flag_sets():
        key = hashlib.sha256(b"\0".join([*sources, version.encode(), _cpu_flags().encode(), " ".join(flags).encode()]))
        name = f"txl-{platform.machine()}-{key.hexdigest()[:16]}.so"
        for cached in (cache_dir(), None):  # (a temporary folder where the cache cannot be written)
            temporary = None
            try:
                if cached is None:
                    temporary = Path(tempfile.mkdtemp(prefix="txl-native-"))
                folder = cached or temporary
                path = folder / name
                if not _verified(path):  # (a missing, truncated or altered file is built again, not loaded)
                    folder.mkdir(parents=True, exist_ok=True)
                    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
                    os.close(fd)
                    cmd = [cc, *flags, "-std=gnu11", "-shared", "-fPIC", "-o", tmp, *map(str, SOURCES), "-lm"]
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    if done.returncode != 0:
                        os.unlink(tmp)
                        errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
                        break  # (the next flags)
                    digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
                    Path(f"{path}.sha256").write_text(digest + "\n")  # (the same for a concurrent build)
                    os.replace(tmp, path)  # (atomic: a concurrent build of the same file gives the same bytes)
                lib = ctypes.CDLL(str(path))
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(f"{path}: {e}")
                continue
            finally:  # (a temporary folder goes whatever happened: a loaded library outlives its file)
                if temporary is not None:
                    shutil.rmtree(temporary, ignore_errors=True)
            try:
                _declare(lib)
            except AttributeError as e:  # (an inconsistent source tree: building again gives the same library)
                return None, f"{path} lacks a kernel ({e}); reinstall txl, its native sources are inconsistent", None
            return lib, "", path
    return None, "the build failed: " + " | ".join(errors), None


def library() -> ctypes.CDLL | None:
    """The loaded library (built on the first call), or None if there is none or the policy turns the kernels off
    (see :func:`status`)."""
    if not backends().native_kernels:
        return None
    if "lib" not in _LIB:
        with _LOCK:
            if "lib" not in _LIB:
                lib, why, path = _build()
                _LIB.update(lib=lib, why=why, path=path)
    return _LIB["lib"]


def library_name() -> str:
    """The library's file name (its source's hash: an edit of the C code is a new library), or why there is none."""
    if library() is None:
        return "no native library"
    return Path(_LIB["path"]).name if _LIB.get("path") else "native library"


def missing() -> bool:
    """Whether the kernels are turned on but could not be built here (no C compiler): worth a note."""
    return backends().native_kernels and library() is None


def status() -> str:
    """One line: whether the native kernels (decoding step, attention, dropout, softmax NLL) are used, and where they
    were built or why they are not."""
    what = "native kernels (decoding step, attention, dropout, softmax NLL)"
    if not backends().native_kernels:
        return f"{what}: off (TXL_NATIVE=0, or txl.set_backends(native_kernels=False))"
    if library() is None:
        return f"{what}: not available, PyTorch path used ({_LIB['why']})"
    return f"{what}: on ({_LIB['path']})"


def _ready() -> ctypes.CDLL | None:
    """The library, where the kernels may run now: turned on, built, no graph being traced, compiled or exported."""
    if (
        not backends().native_kernels
        or torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.jit.is_tracing()
    ):
        return None
    return _LIB["lib"] if "lib" in _LIB else library()


_DATA_PTR = Tensor.data_ptr


def _usable(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def layer_values(plan: list) -> tuple:
    """Every value the kernel reads from the layers' modules rather than from a tensor, per layer and read now: the
    attention's scale, pre_lnorm (the attention's and the feed-forward's), identity_map (both), the two norms' eps,
    n_head and d_head. A plan's structs are remade when any of them changes, and the native step is checked against
    the Python loop again for each new combination (it is part of the kind). Read at every step (a few
    microseconds: the submodules from the modules' own dicts); the weights' shapes are checked where the plan is
    made (a storage that changes shape is a new address)."""
    out = []
    for lay in plan:
        attn, ff = lay.attn, lay.layer._modules["ff"]
        out.append((
            attn.scale, attn.pre_lnorm, ff.pre_lnorm, attn.identity_map, ff.identity_map,
            attn._modules["layer_norm"].eps, ff._modules["layer_norm"].eps, attn.n_head, attn.d_head,
        ))  # fmt: skip
    return tuple(out)


class _Plan:
    """The ctypes view of a model's decoding plan (``txl.model.cache.DecodeLayer`` per layer, and u, v): the layer
    structs, and the addresses and values they were made from. Each step compares the tensors' addresses and the
    layers' values (:func:`layer_values`) with these (a few microseconds) and remakes the structs when a storage moved
    (``.to()``, ``.data =``) or a value changed (a layer's ``attn.scale``), so the kernel never reads freed memory or
    a stale value; changes in place are read as they are."""

    def __init__(self, plan: list, biases: tuple[Tensor, Tensor], values: tuple) -> None:
        per_layer = [_tensors(lay) for lay in plan]
        gates = [tuple(g or () for g in lay.gru) for lay in plan]  # (GRU gates' weights; a None: another kind)
        self.tensors = [t for ts in per_layer for t in ts if t is not None] + list(biases)
        self.tensors += [t for gs in gates for g in gs for t in g]
        self.ptrs = list(map(_DATA_PTR, self.tensors))
        self.values = values
        # one shape for every layer (the kernel takes n_head, d_head, d_inner once), one pre_lnorm per layer
        shapes = {
            (*v[7:], *(tuple(t.shape) for t in (lay.qkv, lay.o, lay.w1, lay.w2)))
            for lay, v in zip(plan, values, strict=True)
        }
        self.usable = all(map(_usable, self.tensors)) and all(g is not None for lay in plan for g in lay.gru)
        self.usable &= all(v[1] == v[2] and v[3] == v[4] for v in values) and len(shapes) == 1
        u, v = biases
        step = u[0].numel() * u.element_size() if u.dim() == 3 else 0  # (untie_r: one [H, Dh] per layer)
        self.layers = (_Layer * len(plan))()
        for i, (ts, gs, vals) in enumerate(zip(per_layer, gates, values, strict=True)):
            ptrs = [None if t is None else t.data_ptr() for t in ts]
            joins = [_Gate(*(t.data_ptr() for t in g)) if g else _Gate() for g in gs]
            scale, pre_lnorm, _, identity_map, _, eps1, eps2 = vals[:7]
            self.layers[i] = _Layer(
                *ptrs, u.data_ptr() + i * step, v.data_ptr() + i * step, eps1, eps2, scale, int(pre_lnorm),
                int(identity_map), *joins,
            )  # fmt: skip
        self.r = (ctypes.c_void_p * len(plan))()


def _tensors(lay: Any) -> tuple:
    """The weights of one layer that the kernel reads, in ``_Layer``'s order (before u, v)."""
    n1, n2 = lay.norm1, lay.norm2
    return lay.qkv, lay.o, n1[1], n1[2], lay.w1, lay.b1, lay.w2, lay.b2, n2[1], n2[2]


def decode_step(
    plan: list, biases: tuple[Tensor, Tensor], h: Tensor, pos: list, mask: Tensor | None, cache: Any, state: dict,
    hids: list | None = None, values: tuple | None = None,
) -> Tensor | None:  # fmt: skip
    """``TransformerXL._decode`` as one native call: every layer for one new position per row ``h`` [B, 1, D],
    with the cache ``cache`` (the new keys/values are written to it). ``plan``: the layers' ``DecodeLayer``;
    ``biases``: u and v (``r_w_bias``, ``r_r_bias``); ``pos``: the layers' ``RelPositions`` (their ``r_k``);
    ``mask``: [1, K] or [B, 1, 1, K] (True = masked) or None; ``state``: a dict kept with the plan; ``hids`` (None:
    not kept) receives the outputs of every layer but the last, [B, 1, D] each. Returns None (nothing done) where the
    kernel does not apply: no library, not fp32 on the CPU, autocast, a graph being traced, a gate other than GRU."""
    lib = None if torch.is_autocast_enabled("cpu") else _ready()
    k, v, r0 = cache.k, cache.v, pos[0].r_k
    if lib is None or r0 is None or not (_usable(h) and _usable(k) and _usable(v)) or functorch_wrapped(h):
        return None  # (a functorch wrapper, under vmap or grad, has no storage for the kernel to read)
    native, values = state.get("native"), layer_values(plan) if values is None else values
    if native is None or native.ptrs != list(map(_DATA_PTR, native.tensors)) or native.values != values:
        native = state["native"] = _Plan(plan, biases, values)
    if not native.usable or r0.dtype != torch.float32 or r0.stride(-1) != 1:
        return None
    native.r[:] = [p.r_k.data_ptr() for p in pos]  # (every layer's table has r0's layout: one cache made them)
    B, _, D = h.shape
    first = plan[0]
    attn = first.attn
    mask_ptr, mask_sb = None, 0
    if mask is not None:
        mask = mask.reshape(-1, mask.shape[-1]).to(torch.uint8).contiguous()  # [1 or B, K]
        mask_ptr, mask_sb = mask.data_ptr(), (mask.shape[-1] if mask.shape[0] > 1 else 0)
    out = h.reshape(B, D).clone()
    inputs = None if hids is None else torch.empty(len(plan), B, 1, D)  # (each layer's input)
    failed = lib.txl_decode_step(
        native.layers, len(plan), native.r, r0.stride(0), r0.stride(1), k.data_ptr(), v.data_ptr(), k.shape[3],
        cache.start, cache.end, mask_ptr, mask_sb, B, D, attn.n_head, attn.d_head, first.w1.shape[0],
        out.data_ptr(), None if inputs is None else inputs.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native decoding step could not allocate its scratch memory")
    if hids is not None:
        hids.extend(inputs[1:].unbind(0))
    return out.view(B, 1, D)


_DROPOUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def dropout_ready() -> bool:
    """Whether the native dropout can run in this process (turned on, the library built)."""
    return backends().native_kernels and library() is not None


def dropout_applies(x: Tensor) -> bool:
    """Whether :func:`dropout` runs for ``x``: fp32 or bf16 on the CPU, the library built, no graph being traced or
    compiled."""
    return x.dtype in _DROPOUT_DTYPES and x.device.type == "cpu" and _ready() is not None and not functorch_wrapped(x)


def dropout(x: Tensor, p: float, seed: int, relu: bool = False) -> Tensor | None:
    """``x`` with each element dropped with probability ``p`` (0 <= p < 1) and the others scaled by 1/(1-p), the
    decisions made by Philox4x32-10 keyed by ``seed`` (a 64-bit integer): the same ``x``, ``p`` and ``seed`` give the
    same result at any thread count, and the call on a gradient with the same seed is the backward. With ``relu``,
    ``relu(x)`` dropped out in the same pass (backward: :func:`relu_dropout_backward`). fp32 or bf16 on the CPU; None
    (nothing done) elsewhere, with no library, or in a graph being traced or compiled."""
    if not dropout_applies(x):
        return None
    lib, kind = _LIB["lib"], _DROPOUT_DTYPES[x.dtype]
    x = x.contiguous()
    y = torch.empty_like(x)
    spec = _dropout_spec(p, seed)
    lib.txl_dropout(
        x.data_ptr(), y.data_ptr(), x.numel(), kind, int(relu), spec.seed, spec.threshold, spec.scale,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def relu_dropout_backward(grad: Tensor, y: Tensor, p: float) -> Tensor:
    """The gradient of ``dropout(x, p, seed, relu=True)`` from its output ``y``: ``grad / (1 - p)`` where ``y > 0``
    (positive and kept), 0 elsewhere. Only where that :func:`dropout` ran."""
    grad = grad.to(y.dtype).contiguous()
    dx = torch.empty_like(y)
    _LIB["lib"].txl_relu_dropout_backward(
        grad.data_ptr(), y.data_ptr(), dx.data_ptr(), y.numel(), _DROPOUT_DTYPES[y.dtype], 1.0 / (1.0 - p),
        torch.get_num_threads(),
    )  # fmt: skip
    return dx


def dropout_words(seed: int, n: int) -> Tensor:
    """The first ``n`` 32-bit words of :func:`dropout`'s stream for ``seed`` (element i is kept iff its word >=
    round(p * 2^32)), as int64 [n] (for tests)."""
    lib = library()
    if lib is None:
        raise RuntimeError(status())
    out = torch.empty(n, dtype=torch.int32)
    lib.txl_dropout_words(seed & (2**64 - 1), out.data_ptr(), n)
    return out.to(torch.int64) & 0xFFFFFFFF


def usable(x: Tensor) -> bool:
    """Whether the kernels may run for ``x`` now: fp32 on the CPU, with storage (not a functorch wrapper: vmap, grad,
    as TorchRL's losses call modules), the library built, no autocast, no graph being traced or compiled."""
    fp32_cpu = x.dtype == torch.float32 and x.device.type == "cpu"
    return fp32_cpu and not torch.is_autocast_enabled("cpu") and _ready() is not None and not functorch_wrapped(x)


def _operand(t: Tensor) -> bool:
    """:func:`usable`'s checks of one tensor (fp32, on the CPU, with storage), and its last dimension contiguous."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 and not functorch_wrapped(t)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor | None = None,
    r: Tensor | None = None,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    query_bias: QueryBias | None = None,
) -> Tensor | None:
    """Inference attention as one native call per head (attention.c), as [B, T, H * Dh] (the output projection's
    layout): ``softmax(s) v`` with ``s[i, j] = q_i . k_j`` plus, with ``r``, the relative term ``qv_i . r[:, c]`` at
    the raw column ``c = j + T-1-i`` (Appendix B's shift; ``r`` [H, Dh, >= K] is W_kR R for the distances K-1 .. 0,
    ``qv`` the queries with v added, and keys j > M+i are masked), or else ``bias`` [B, H, T, K] (broadcast
    dimensions allowed); -inf where ``mask`` ([T, K] or [B, 1, T, K], True = masked) is set. q, qv [B, H, T, Dh] come
    scaled, or raw with ``query_bias`` (u, v, scale): then the kernel uses (q + u) * scale and (qv + v) * scale; k, v
    [B, H, K, Dh]. fp32 on the CPU with the last dimension of each contiguous; None (nothing done) elsewhere, with no
    library, with autocast or in a graph being traced or compiled."""
    if not attention_applies(q, k, v, qv, r, bias, query_bias):
        return None
    return _attention(q, k, v, qv, r, bias, mask, None, None, query_bias)


def attention_applies(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor | None = None,
    r: Tensor | None = None,
    bias: Tensor | None = None,
    query_bias: QueryBias | None = None,
) -> bool:
    """Whether :func:`attention` (and :func:`attention_train`) run for these operands (None: absent): each fp32 on the
    CPU with its last dimension contiguous, the library built, no autocast, no graph being traced or compiled; W_kR R
    ``r`` at least as wide as the keys, with ``qv``; ``query_bias``'s u and v [H, Dh]."""
    extra = () if query_bias is None else query_bias[:2]
    if not usable(q):  # (then the rest per operand: the policy, the library and autocast checked once per call)
        return False
    operands = (k, v, qv, r, bias, *extra)
    if not all(_operand(t) for t in operands if t is not None) or q.stride(-1) != 1:
        return False
    if extra and not all(t.shape == (q.shape[1], q.shape[3]) for t in extra):
        return False
    return r is None or (qv is not None and r.shape[-1] >= k.shape[2])


def _attention(
    q, k, v, qv, r, bias, mask, p: Tensor | None, drop: tuple[float, int] | None, query_bias: QueryBias | None
) -> Tensor:
    lib = _LIB["lib"]
    B, H, T, Dh = q.shape
    K = k.shape[2]
    null3 = (None, 0, 0, 0)
    qv_args = null3 if qv is None else (qv.data_ptr(), *qv.stride()[:3])
    r_args = (None, 0, 0) if r is None else (r.data_ptr(), *r.stride()[:2])
    if bias is None or r is not None:
        bias_args = null3
    else:
        bias = bias.expand(B, H, T, K)
        bias_args = (bias.data_ptr(), *bias.stride()[:3])
    mask_args: tuple = (None, 0, 0)
    if mask is not None:
        mask = mask.reshape(-1, T, K).to(torch.bool).contiguous().view(torch.uint8)  # [1 or B, T, K], a byte each
        mask_args = (mask.data_ptr(), T * K if mask.shape[0] > 1 else 0, K)
    out = torch.empty(B, T, H * Dh)
    spec = None if drop is None else _dropout_spec(*drop)
    qbias = _query_bias(query_bias)
    failed = lib.txl_attention(
        q.data_ptr(), *q.stride()[:3], *qv_args, k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3],
        *r_args, *bias_args, *mask_args, out.data_ptr(), None if p is None else p.data_ptr(),
        _address(spec), _address(qbias), B, H, T, K, Dh, torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native attention could not allocate its scratch memory")
    return out


def attention_train(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor,
    r: Tensor,
    mask: Tensor | None = None,
    dropout: tuple[float, int] | None = None,
    query_bias: QueryBias | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`attention` with the relative term, keeping what :func:`attention_backward` needs: (the output
    [B, T, H * Dh], the probabilities [B, H, T, K] before dropout). ``dropout`` (p, seed): the probabilities are
    dropped out as :func:`dropout` (p, seed) drops out a [B, H, T, K] tensor. Only where :func:`attention_applies`."""
    B, H, T, _ = q.shape
    p = torch.empty(B, H, T, k.shape[2])
    return _attention(q, k, v, qv, r, None, mask, p, dropout, query_bias), p


def attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qv: Tensor,
    r: Tensor,
    p: Tensor,
    grad: Tensor,
    dropout: tuple[float, int] | None = None,
    query_bias: QueryBias | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`attention_train`'s output (attention_grad.c) for its gradient ``grad`` [B, T, H * Dh],
    with respect to q, qv ([B, T, H, Dh] each), k and v together ([2, B, H, K, Dh], a view of a contiguous
    [B, K, 2, H, Dh] tensor: the layout of the K/V projection's output) and r (its shape; 0 past the first K
    columns). ``p``: the probabilities it returned; ``dropout``: its dropout. With ``query_bias`` (u, v, scale), as
    the forward took it: q and qv are the raw queries, and the first two gradients are those of q + u and qv + v
    (the scale applied), whose sums over batch and time are u's and v's."""
    B, H, T, Dh = q.shape
    K = k.shape[2]
    grad = grad.contiguous().view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
    p = p.contiguous()
    dq, dqv = torch.empty(B, T, H, Dh), torch.empty(B, T, H, Dh)
    dkv = torch.empty(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, K, Dh]
    dr = torch.zeros(r.shape) if r.shape[-1] > K else torch.empty(r.shape)
    spec = None if dropout is None else _dropout_spec(*dropout)
    qbias = _query_bias(query_bias)
    failed = _LIB["lib"].txl_attention_backward(
        q.data_ptr(), *q.stride()[:3], qv.data_ptr(), *qv.stride()[:3], k.data_ptr(), *k.stride()[:3], v.data_ptr(),
        *v.stride()[:3], r.data_ptr(), *r.stride()[:2], p.data_ptr(), grad.data_ptr(), *grad.stride()[:3],
        dq.data_ptr(), dqv.data_ptr(), dkv[0].data_ptr(), *dkv[0].stride()[:3], dkv[1].data_ptr(),
        *dkv[1].stride()[:3], dr.data_ptr(), *dr.stride()[:2], _address(spec), _address(qbias), B, H, T, K, Dh,
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native attention's backward could not allocate its scratch memory")
    return dq, dqv, dkv, dr


def nll_applies(x: Tensor) -> bool:
    """Whether :func:`nll` runs for the logits ``x``: fp32 on the CPU, the library built, no graph being traced or
    compiled."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and _ready() is not None and not functorch_wrapped(x)


def _rows(x: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` [N, V] with contiguous rows and ``target`` [N] as the kernels read them (int64)."""
    if x.dim() != 2 or target.shape != x.shape[:1]:
        raise ValueError(f"nll: [N, V] rows and targets [N] expected, got {tuple(x.shape)} and {tuple(target.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x, target.to(torch.int64).contiguous()


def nll(x: Tensor, target: Tensor) -> tuple[Tensor, Tensor] | None:
    """``-log_softmax(x)[i, target[i]]`` for each row of the logits ``x`` [N, V] (0 where ``target[i] < 0``:
    ignored), and each row's log-sum-exp (for :func:`nll_backward`), without the [N, V] log-probabilities (nll.c).
    Targets must be < V. fp32 on the CPU; None (nothing done) elsewhere, with no library, or in a graph being traced
    or compiled."""
    if not nll_applies(x):
        return None
    x, target = _rows(x, target)
    N, V = x.shape
    out, lse = torch.empty(N), torch.empty(N)
    _LIB["lib"].txl_nll_forward(
        x.data_ptr(), N, V, x.stride(0), target.data_ptr(), out.data_ptr(), lse.data_ptr(), torch.get_num_threads()
    )
    return out, lse


def nll_backward(x: Tensor, target: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    """The gradient of ``sum(grad * nll(x, target))`` with respect to ``x``: ``grad[i] * (softmax(x_i) -
    onehot(target[i]))``, zero rows where ``target[i] < 0``; ``lse`` from :func:`nll`. Only where :func:`nll` ran."""
    x, target = _rows(x, target)
    N, V = x.shape
    lse, grad = lse.float().contiguous(), grad.float().contiguous()
    dx = torch.empty(N, V)
    _LIB["lib"].txl_nll_backward(
        x.data_ptr(), N, V, x.stride(0), target.data_ptr(), lse.data_ptr(), grad.data_ptr(), dx.data_ptr(), V,
        torch.get_num_threads(),
    )  # fmt: skip
    return dx


LINEAR_MAX_DIM = 256
"""The most inputs per row :func:`nll_linear` takes."""


def pack_linear(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """A linear layer's weight [V, d] and bias [V] (or None) as :func:`nll_linear` reads them: W^T [d, Vp] and a bias
    [Vp], Vp the next multiple of 32, the extra columns zero weights and a -inf bias (no probability)."""
    V, d = weight.shape
    vp = -(-V // 32) * 32
    wt = weight.new_zeros(d, vp, dtype=torch.float32)
    wt[:, :V] = weight.detach().t()
    b = torch.full((vp,), float("-inf"))
    b[:V] = 0.0 if bias is None else bias.detach()
    return wt, b


def nll_linear(h: Tensor, packed: tuple[Tensor, Tensor], target: Tensor) -> Tensor | None:
    """:func:`nll` of the logits ``h @ W^T + b`` without storing them (nll.c: 8 rows x 512 columns at a time, a
    running maximum and sum per row); ``packed`` is :func:`pack_linear`'s (W, b). ``h`` [N, d] with d <=
    ``LINEAR_MAX_DIM``, ``target`` [N] (< V; < 0: ignored, 0). No gradient. fp32 on the CPU; None (nothing done)
    elsewhere, with no library, or in a graph being traced or compiled."""
    wt, b = packed
    if not (nll_applies(h) and h.dim() == 2 and h.shape[1] == wt.shape[0] <= LINEAR_MAX_DIM):
        return None
    h, target = _rows(h, target)
    out = torch.empty(h.shape[0])
    _LIB["lib"].txl_nll_linear(
        h.data_ptr(), h.shape[0], h.shape[1], h.stride(0), wt.data_ptr(), wt.shape[1], b.data_ptr(),
        target.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
