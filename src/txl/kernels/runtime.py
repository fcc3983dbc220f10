"""Process settings that make txl faster on the machine it runs on, each one checked before it is used.
Design notes: docs/internals.md#txlkernelsruntime."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from txl.kernels.timing import paired

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
ROUTE_SHAPES = ((1024, 256, 1024), (1024, 1024, 256), (2048, 256, 768))  # FF up/down, fused K/V: M x K x N
MIN_GAIN = 1.05  # the route must be at least this much faster on the shapes above (the median of paired rounds)
ROUTE_ROUNDS = 8  # paired rounds of the speed check (see _route_speedup)
ALLOCATOR_NOTE = "malloc keeps large freed blocks (no page faults on reused temporaries)"


def configure_allocator() -> bool:
    """Tune glibc's malloc for large, short-lived tensors (Linux only); True if it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def matmul_error(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seed: int = 0) -> float:
    """Largest error of ``matmul`` on random fp32 operands, relative to the largest entry of the float64 product."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 384, generator=g)
    exact = a.double() @ b.double()
    return float((matmul(a, b).double() - exact).abs().max() / exact.abs().max())


FP32_ERROR = 1e-5  # largest relative error of an exact product (bf16 arithmetic errs about 1e-3, fp32 about 1e-7)


def is_fp32_exact(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """True if ``matmul`` keeps fp32 accuracy on one 256 x 512 x 384 product."""
    return matmul_error(matmul) <= FP32_ERROR


@dataclass
class RouteChoice:
    enabled: bool
    speedup: float
    exact: bool
    earlier: bool | None = None
    """The choice given to :func:`choose_fp32_matmul` (a resumed run's), kept rather than measured; None: measured."""

    def describe(self) -> str:
        what = "via oneDNN where exact (each kind of product checked first)" if self.enabled else "via the default path"
        why = "" if self.exact else ", oneDNN's route is not exact here"
        if self.earlier is None:
            return f"fp32 GEMMs {what} (oneDNN {self.speedup:.2f}x the default{why})"
        if self.enabled == self.earlier:
            return f"fp32 GEMMs {what}, as in the run being resumed (not measured again: it computes as before)"
        return (
            f"fp32 GEMMs {what}: the run being resumed used oneDNN's route, which is not exact here, so the "
            "resumed steps round differently from an uninterrupted run"
        )


def _set_route(enabled: bool) -> None:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16" if enabled else "ieee"


@contextlib.contextmanager
def fp32_route(enabled: bool) -> Iterator[None]:
    """fp32 GEMMs through oneDNN (``enabled``) or on torch's default path for the duration; the setting before is
    restored. Generation steps use ``fp32_route(False)``: their one-row products are ~3x slower on the route."""
    setting = torch.backends.mkldnn.matmul
    previous = setting.fp32_precision
    _set_route(enabled)
    try:
        yield
    finally:
        setting.fp32_precision = previous


def _route_speedup() -> float:
    """Time of the default path over the route's on ``ROUTE_SHAPES`` (three products of each): the median of
    ``ROUTE_ROUNDS`` paired rounds of :func:`txl.kernels.timing.paired`, the package's one timer (which goes first
    alternates; a first call of each warms them up). The median of paired rounds resists one-off stalls and slow
    drift of the VM: ten calls in one process on a 2-core EPYC gave 1.18-1.39x (and 1.03-1.20x in a batch minutes
    later, the machine itself having drifted) where the earlier best-of-3-each estimate gave 1.11-1.59x; the
    per-round ratios of one long run were 1.12-1.45 (median 1.30) after a first round of 2.03."""
    operands = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in ROUTE_SHAPES]

    def products(routed: bool) -> Callable[[], None]:
        def run() -> None:
            _set_route(routed)
            for _ in range(3):
                for a, b in operands:
                    a @ b

        return run

    return paired(products(True), products(False), rounds=ROUTE_ROUNDS).median


def choose_fp32_matmul(
    measure: bool = True, routed_matmul: Callable = torch.matmul, earlier: bool | None = None
) -> RouteChoice:
    """Whether fp32 GEMMs may go through oneDNN (under :class:`CheckedRoute`, which checks every kind of product
    before it routes it): if the route is exact on a first product (the self-check runs ``routed_matmul`` with the
    route on) and at least 5% faster here (``MIN_GAIN``). Sets nothing: the setting before the call is kept. (On a
    2-core EPYC the check measured the route at 1.03-1.39x, and the route made the bench-char and bench-word training
    steps 1.089x and 1.058x faster in paired A/B steps: the former bar of 1.15x turned away a route that paid.)

    ``earlier`` is the choice of a run being resumed (or of another process of the run): it is kept, without
    measuring again, wherever the route is exact. The two paths round differently, and the speed check follows
    the machine's drift (see ``_route_speedup``), so a choice made again could differ and the resumed run would
    not compute what the uninterrupted one did."""
    if not torch.backends.mkldnn.is_available():
        return RouteChoice(False, 1.0, False, earlier)
    previous = torch.backends.mkldnn.matmul.fp32_precision
    try:
        _set_route(True)
        exact = is_fp32_exact(routed_matmul)
        speedup = 1.0
        if exact and measure and earlier is None:
            speedup = _route_speedup()
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = previous
    enabled = exact and (speedup >= MIN_GAIN if earlier is None else earlier)
    return RouteChoice(enabled, speedup, exact, earlier)


_PRODUCTS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
)  # fmt: skip  (what torch.matmul, F.linear and einsum become)


def _random_like(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random values in ``t``'s exact layout (shape, strides, offset: what oneDNN's choice of kernel sees)."""
    if t.numel() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    extent = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return torch.randn(extent, generator=g, dtype=t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def routed_call(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
    """``func`` computed on oneDNN's route (the call :class:`CheckedRoute` checks and then makes)."""
    with fp32_route(True):
        return func(*args, **kwargs)


@dataclass(eq=False)
class CheckedRoute(TorchDispatchMode):
    """fp32 products through oneDNN's route, each kind only once the route computed one exactly.

    A kind is the operation (mm, addmm, bmm, baddbmm) and its operands' shapes and strides. At its first sight the
    route computes it on random operands of that layout, against float64; within ``FP32_ERROR`` it is routed from
    then on, otherwise it runs on torch's default path (as does every product that is not fp32 on the CPU). So the
    route computes nothing that it has not been seen to compute to fp32 accuracy, whatever shapes a run reaches
    (variable segment lengths, a last short batch, evaluation). ``routed`` / ``refused``: the kinds seen so far.
    """

    call: Callable[[Callable, tuple, dict], torch.Tensor] = routed_call
    verdicts: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def routed(self) -> int:
        return sum(self.verdicts.values())

    @property
    def refused(self) -> int:
        return len(self.verdicts) - self.routed

    def describe(self) -> str:
        return f"{self.routed} kinds of fp32 product routed through oneDNN, {self.refused} not exact there"

    def _exact(self, func: Callable, args: tuple, kwargs: dict) -> bool:
        g = torch.Generator().manual_seed(len(self.verdicts))  # (its own generator: the run's stream untouched)
        probe = [_random_like(a, g) if isinstance(a, torch.Tensor) else a for a in args]
        routed = self.call(func, tuple(probe), kwargs).double()
        exact = func(*[a.double() if isinstance(a, torch.Tensor) else a for a in probe], **kwargs)
        scale = float(exact.abs().max()) if exact.numel() else 0.0
        return scale == 0.0 or float((routed - exact).abs().max()) <= FP32_ERROR * scale

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
                kind = (func, *((tuple(t.shape), t.stride()) for t in tensors))
                verdict = self.verdicts.get(kind)
                if verdict is None:
                    verdict = self.verdicts[kind] = self._exact(func, args, kwargs)
                if verdict:
                    return self.call(func, args, kwargs)
        return func(*args, **kwargs)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 in hardware (CUDA with bf16 support; a CPU with avx512_bf16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def effective_precision(device: torch.device, precision: str) -> tuple[str, str | None]:
    """The precision to run: bf16 on a CPU without native bf16 is emulated (20x slower than fp32 measured on a
    Zen 3 EPYC), so fp32 runs instead, with a note saying so. ``auto`` (the paper's recipes): bf16 where ``device``
    computes it natively (a CUDA GPU with bf16; a CPU with avx512_bf16 or AMX), else fp32; the note says which."""
    if precision == "auto":
        if native_bf16(device):
            return "bf16", f"bf16 ({device.type} computes bf16 natively)"
        return "fp32", f"fp32 ({device.type} has no native bf16)"
    if precision == "bf16" and device.type == "cpu" and not native_bf16(device):
        return "fp32", "this CPU has no native bf16 (avx512_bf16 or AMX): emulated bf16 is far slower, so fp32 runs"
    return precision, None


def available_memory() -> int | None:
    """Bytes of memory this machine has free for a new allocation (MemAvailable, within a cgroup's limit if one is
    set); None where it cannot be read."""
    free = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        info = open("/proc/meminfo").read()
        free = int(next(line.split()[1] for line in info.splitlines() if line.startswith("MemAvailable:"))) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
        if limit != "max":
            free = min(free if free is not None else 1 << 62, int(limit) - used)
    return free


def check_fits(needed: int, what: str, advice: str) -> None:
    """Refuse (a ValueError, one line) work whose memory estimate ``needed`` is more than this machine has free,
    before anything is allocated: an allocation of that size would fail deep inside, or swap the machine to a
    halt."""
    free = available_memory()
    if free is not None and needed > free:
        raise ValueError(
            f"{what} needs about {_size(needed)} of memory, more than the {_size(free)} free here: {advice}"
        )


def _size(n: int) -> str:
    """Bytes as people read them: GiB with one decimal from 1 GiB on, else MiB (or KiB): never "0.0 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{max(n, 0) / 2**10:,.1f} KiB"


def functorch_wrapped(x: torch.Tensor) -> bool:
    """Whether ``x`` is a functorch wrapper (under vmap or grad, as TorchRL's losses call modules): it has no storage
    for a kernel to read, and no data-dependent branch may look at it. False in a graph being compiled (dynamo cannot
    trace this builtin, and compiled code is not vmapped here)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(x)
