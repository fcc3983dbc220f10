"""The fast paths: every backend of txl's named operations, in one registry, chosen by one dispatch.
Design notes: docs/internals.md#txlkernelsregistry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from txl.kernels import measured
from txl.kernels.admission import admits, global_hooks, is_stock, tree_is_stock, verified, why_not_stock
from txl.kernels.backends import Backends, backends


def _cpu_switch(field: str) -> Callable[[Backends, str], bool]:
    """A CPU backend's switch: ``Backends.native_kernels`` and its own field, on the CPU."""
    return lambda p, dev: dev == "cpu" and p.native_kernels and getattr(p, field)


@dataclass(frozen=True)
class Backend:
    """One fast path of a named operation."""

    name: str
    """Its name: in logs, ``measured.json``, ``txl --version`` (and the :class:`Backends` field that turns it off)."""
    op: str
    """The named operation it computes (the function of kernels/ that dispatches it)."""
    reference: str
    """What it stands in for: the model's own code."""
    switch: Callable[[Backends, str], bool]
    """Whether the policy lets it run on a device type."""
    applies: Callable[..., str | None] = lambda *operands: None
    """Why it cannot run for these operands (dtype, device, no library), or None."""
    deep: bool = False
    """Admission looks at every module under the one given (the backend reads all their weights)."""
    measured: bool = True
    """Timed against the reference on the CPU (a device's backends: measured in docs/benchmarks.md)."""


REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry (a name once)."""
    if backend.name in REGISTRY and REGISTRY[backend.name] != backend:
        raise ValueError(f"a fast path named {backend.name!r} is already registered")
    REGISTRY[backend.name] = backend
    return backend


def _first_tensor(operands: Sequence[Any]) -> Tensor | None:
    for t in operands:
        if isinstance(t, Tensor):
            return t
    return None


def _admitted(b: Backend, modules: nn.Module | Sequence[nn.Module] | None, where: str) -> bool:
    if modules is None:
        return not global_hooks()
    if isinstance(modules, nn.Module):
        return admits(b.name, modules, deep=b.deep, name=where)
    return all(admits(b.name, m, deep=b.deep, name=where) for m in modules)


def choose(
    name: str,
    module: nn.Module | Sequence[nn.Module] | None,
    fast: Callable[[], Any],
    reference: Callable[[], Any],
    *,
    operands: Sequence[Any] = (),
    kind: tuple = (),
    shapes: Sequence[Sequence[int]] | None = None,
    where: str = "model",
    verify: bool = True,
) -> bool:
    """Whether backend ``name`` is to stand in for ``reference()`` here (the module docstring's five rules).
    ``operands``: the operation's tensors (the first gives the device, dtype and shapes; those that require
    gradients are differentiated when measured); ``kind``: what else tells kinds of model apart for the check;
    ``shapes``: the measured kind's shapes (default: the operands'); ``verify`` False: a stochastic backend whose
    stream is not the reference's (a device's fused kernel), held to the reference's distribution by the tests."""
    b = REGISTRY[name]
    x = _first_tensor(operands)
    dev = x.device.type if x is not None else "cpu"
    if not b.switch(backends(), dev) or b.applies(*operands) is not None or not _admitted(b, module, where):
        return False
    grad = torch.is_grad_enabled()
    if verify:
        classes = tuple(map(type, module)) if isinstance(module, (list, tuple)) else type(module)
        full = (classes, x.dtype if x is not None else None, dev, grad, *kind)
        if not verified(name, full, fast, reference):
            return False
    if not b.measured or dev != "cpu" or x is None:
        return True
    shapes = shapes if shapes is not None else [t.shape for t in operands if isinstance(t, Tensor)]
    grad_of = [t for t in operands if isinstance(t, Tensor) and t.requires_grad] if grad else []
    return measured.faster(name, shapes, x.dtype, fast, reference, grad_of)


def dispatch(name: str, module: nn.Module | Sequence[nn.Module] | None, fast: Callable[[], Any],
             reference: Callable[[], Any], **how: Any) -> Any:  # fmt: skip
    """``fast()`` where :func:`choose` says so (``fast()`` returning None: it did not apply after all), else
    ``reference()``: the one way an operation runs a fast path."""
    if choose(name, module, fast, reference, **how):
        out = fast()
        if out is not None:
            return out
    return reference()


def admitted(name: str, module: nn.Module, where: str = "model", device: str | None = None) -> bool:
    """Rules 1 and 3 alone, for a backend whose operands are prepared over many calls (a ring of fixed shape): its
    switch on ``device`` (None: not looked at), and the module stock (else declined, said once)."""
    b = REGISTRY[name]
    return (device is None or b.switch(backends(), device)) and _admitted(b, module, where)


def may_run(name: str, device: str = "cpu") -> bool:
    """Whether backend ``name`` can run on ``device`` at all here (its switch on; a native one: the library built):
    what an estimate of memory or time asks, before any operand exists."""
    b = REGISTRY[name]
    if not b.switch(backends(), device):
        return False
    if name.startswith("native"):
        from txl.kernels import native

        return native.library() is not None
    return True


def describe() -> str:
    """The registry and this machine's measured choices, for ``txl --version``."""
    ops: dict[str, list[str]] = {}
    for b in REGISTRY.values():
        ops.setdefault(b.op, []).append(b.name)
    listed = "; ".join(f"{op}: {', '.join(names)}" for op, names in sorted(ops.items()))
    return f"fast paths ({len(REGISTRY)} backends of {len(ops)} operations): {listed}\n{measured.describe()}"


def settled_off(name: str, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> bool:
    """Whether backend ``name`` is known not to run for these operands (measured slower here, settled), so that a
    caller can skip preparing its operands."""
    return measured.decided(name, shapes, dtype) is False


def not_supported_reasons(name: str, module: nn.Module | None, *operands: Any, where: str = "model") -> list[str]:
    """Why backend ``name`` cannot stand in for ``module`` on ``operands`` now, in words (empty: it can, subject to
    its check against the reference and its measurement)."""
    b = REGISTRY[name]
    x = _first_tensor(operands)
    dev = x.device.type if x is not None else "cpu"
    out = [] if b.switch(backends(), dev) else [f"the policy turns it off on {dev} (txl.Backends)"]
    why = b.applies(*operands)
    out += [why] if why else []
    if global_hooks():
        out.append("a global module hook is registered")
    elif module is not None and not (tree_is_stock(module) if b.deep else is_stock(module)):
        out.append(why_not_stock(module, where, b.deep))
    return out
