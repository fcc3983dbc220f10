"""Whether a fast path may stand in for the user's modules: the one rule, in one place.
Design notes: docs/internals.md#txlkernelsadmission."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from itertools import chain
from operator import itemgetter
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

log = logging.getLogger("txl")

C = TypeVar("C", bound=type)

_STOCK: dict[type, tuple[tuple[type, Callable, tuple, tuple[str, ...], int], ...]] = {}
"""Each stock class -> (for itself and each stock class it inherits from: the class, a getter of its callables, their
values and names when registered, its dict's size then)."""
_METHODS: dict[type, frozenset[str]] = {}
"""Each stock class -> the names of every method it has (nn.Module's included): an instance attribute with one of
these names shadows a method."""


def _own_callables(cls: type) -> dict[str, Any]:
    return {k: v for k, v in vars(cls).items() if callable(v) or isinstance(v, (staticmethod, classmethod, property))}


def stock(cls: C) -> C:
    """Register ``cls`` as a stock class (a decorator): the fast paths know what its methods compute, as they are
    now. Its stock bases are checked with it; a non-stock base other than ``nn.Module`` is not allowed."""
    chain_ = []
    for base in cls.__mro__:
        if base in (nn.Module, object):
            break
        if base is not cls and base not in _STOCK:
            raise TypeError(f"{cls.__name__}: its base {base.__name__} is not a stock class")
        methods = _own_callables(base)
        names = tuple(methods)
        chain_.append((base, itemgetter(*names) if names else (lambda _: ()), tuple(methods.values()), names,
                       len(vars(base))))  # fmt: skip
    _STOCK[cls] = tuple(chain_)
    _METHODS[cls] = frozenset(n for c in cls.__mro__ for n, v in vars(c).items() if callable(v) and n != "__init__")
    return cls


for _torch_class in (nn.Linear, nn.LayerNorm, nn.ModuleList, nn.ParameterList, nn.Identity):
    stock(_torch_class)


def _class_unchanged(cls: type) -> bool:
    """Whether no method of ``cls`` or its stock bases was replaced, added or removed since registration."""
    compiling = torch.compiler.is_compiling()  # (dynamo traces no itemgetter: the plain loop there)
    for base, get, values, names, size in _STOCK[cls]:
        own = vars(base)
        if compiling:
            if any(own.get(k) is not v for k, v in zip(names, values, strict=True)):
                return False
            continue
        try:
            now = get(own)
        except KeyError:  # (a method deleted)
            return False
        if (now if len(names) > 1 else (now,) if names else ()) != values:  # (identity first: C-level)
            return False
        if len(own) != size and tuple(_own_callables(base)) != names:  # (a method added; a cache that Python
            return False  # adds to a class, e.g. copy's __slotnames__, is not one)
    return True


def global_hooks() -> bool:
    """Whether a global module hook is registered (``torch.nn.modules.module.register_module_forward_hook`` and its
    kin): it would run at every module call, which a fast path does not make."""
    g = torch.nn.modules.module
    return bool(
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )


def own_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a hook of its own (forward, forward-pre, backward): with :func:`global_hooks`, the one
    hook check of the package."""
    d = module.__dict__
    return bool(d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"])


def _changed(module: nn.Module) -> str | None:
    """Why ``module`` itself (not its children) is not stock, or None."""
    cls = type(module)
    if cls not in _STOCK:
        stock_bases = [b.__name__ for b in cls.__mro__[1:] if b in _STOCK]
        of = f" (a subclass of {stock_bases[0]})" if stock_bases else ""
        return f"is a {cls.__module__}.{cls.__qualname__}{of}, not a class the fast path knows"
    if not _class_unchanged(cls):
        return f"is a {cls.__name__} whose class has methods replaced or added since txl defined it"
    shadowed = _METHODS[cls].intersection(module.__dict__)
    if shadowed:
        return f"has its own {sorted(shadowed)[0]} (an instance attribute over the class's method)"
    if own_hooks(module):
        return "has a hook"
    return None


def is_stock(module: nn.Module) -> bool:
    """Whether ``module`` itself is stock (its class, the class's methods, no method shadowed, no hook of its own);
    its children are not looked at. Global hooks are :func:`global_hooks`'s."""
    cls = type(module)
    return (
        cls in _STOCK and _class_unchanged(cls) and _METHODS[cls].isdisjoint(module.__dict__) and not own_hooks(module)
    )


def _walk(module: nn.Module) -> list[nn.Module] | None:
    """Every module of the tree under ``module`` (itself first), or None where one is not stock."""
    todo, out = [module], []
    while todo:
        m = todo.pop()
        if m is None:
            continue
        if not is_stock(m):
            return None
        out.append(m)
        todo.extend(m._modules.values())
    return out


_trees: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A tree found stock -> what was seen then (its modules, their classes, dict sizes and children, the hook counter)."""


def tree_is_stock(module: nn.Module) -> bool:
    """Whether ``module`` and every module under it are stock, and no global hook is registered. Run at every
    one-token step, so a tree found stock is remembered with what was seen (every module, its class, the size of its
    own dict, its children, and torch's count of hooks ever registered) and only that is compared at the next call
    (~15 us for a 6-layer model, against ~100 us for the walk): a hook registered anywhere, a module swapped in, an
    attribute set on a module, a class changed or patched make it walk again."""
    if global_hooks():
        return False
    hooks = RemovableHandle.next_id
    seen = _trees.get(module)
    if seen is not None:
        mods, kinds, dicts, sizes, kids, children, classes, counted = seen
        if (
            counted == hooks
            and list(map(type, mods)) == kinds
            and list(map(len, dicts)) == sizes
            and list(chain.from_iterable(map(dict.values, kids))) == children
            and all(map(_class_unchanged, classes))
        ):
            return True
    mods = _walk(module)
    if mods is None:
        _trees.pop(module, None)
        return False
    dicts = [m.__dict__ for m in mods]  # (a module's own dict and its children's dict stay the same objects)
    kids = [d["_modules"] for d in dicts]
    children = list(chain.from_iterable(map(dict.values, kids)))
    kinds = list(map(type, mods))
    _trees[module] = (mods, kinds, dicts, list(map(len, dicts)), kids, children, set(kinds), hooks)
    return True


def why_not_stock(module: nn.Module, name: str = "model", deep: bool = True) -> str:
    """What makes ``module`` (or, ``deep``, a module under it) not stock, in words naming it."""
    if global_hooks():
        return "a global module hook is registered"
    todo = [(name, module)]
    while todo:
        where, m = todo.pop(0)
        reason = _changed(m)
        if reason:
            return f"{where} {reason}"
        if deep:
            todo.extend((f"{where}.{k}", v) for k, v in m._modules.items() if v is not None)
    return "it is stock"


_said: set[tuple[str, str]] = set()
_lock = threading.Lock()


def decline(path: str, reason: str) -> None:
    """Say once per process and (path, reason) that a fast path is declined and why (the ``txl`` logger)."""
    key = (path, reason)
    if key in _said:
        return
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.warning("txl: fast path %s declined: %s; the model's own code runs instead", path, reason)


def admits(path: str, module: nn.Module, deep: bool = False, name: str = "model") -> bool:
    """Whether the fast path ``path`` may stand in for ``module`` (``deep``: and every module under it): True where
    it is stock (see the module docstring); else False, said once (:func:`decline`)."""
    ok = tree_is_stock(module) if deep else (is_stock(module) and not global_hooks())
    if not ok:
        decline(path, why_not_stock(module, name, deep))
    return ok


# ---------------------------------------------------------------------------------------------------------
# The second half: a fast path checked against the reference once per process and kind of model.
# ---------------------------------------------------------------------------------------------------------

_checking = threading.local()  # (depth: a check's calls are running in this thread)

_verified: dict[tuple, bool] = {}
"""(path, kind) -> whether the fast path computed what the reference did, the first time it ran here."""


def _close(fast: Any, ref: Any) -> bool:
    if isinstance(ref, (tuple, list)):
        return isinstance(fast, (tuple, list)) and len(fast) == len(ref) and all(map(_close, fast, ref))
    if fast.shape != ref.shape or fast.dtype != ref.dtype:
        return False
    a, b = fast.detach().double(), ref.detach().double()
    tol = 1e-4 if ref.dtype in (torch.float32, torch.float64) else 3e-2  # (fp32 kernels agree to ~1e-6)
    scale = float(b.abs().max()) if b.numel() else 0.0
    ok = torch.isfinite(a) == torch.isfinite(b)
    return bool(ok.all()) and float((a - b).nan_to_num(0).abs().max() if a.numel() else 0.0) <= tol * max(scale, 1.0)


def verified(path: str, kind: tuple, fast: Callable[[], Any], reference: Callable[[], Any],
             pick: Callable[[Any], Tensor] = lambda out: out) -> bool:  # fmt: skip
    """Whether the fast path ``path`` computes what the reference does for this ``kind`` of model (its classes,
    flags, dtype, device): checked the first time in the process, by running both on the caller's input (``fast()``
    then ``reference()``: whatever they write, a cache's keys and values, is written again by the call the caller
    then makes) and comparing (``pick`` takes the tensor compared from a result). ``fast()`` returning None (it does
    not apply here) teaches nothing: False, and the next call checks again. A mismatch declines the path for that
    kind (said once)."""
    key = (path, kind)
    ok = _verified.get(key)
    if ok is not None:
        return ok
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # (no comparison in a graph: it traces the
        return True  # fast path as chosen; the eager calls check it)
    with check_scope():
        with torch.random.fork_rng(devices=[]):  # (each from the same random state: the same dropout masks)
            out = fast()
        if out is None:
            return False
        with torch.random.fork_rng(devices=[]):
            ref = reference()
        ok = _verified[key] = _close(pick(out), pick(ref))
    if not ok:
        decline(path, "it computes something else than the model's own code here (a changed source?)")
    return ok


@contextlib.contextmanager
def check_scope() -> Iterator[None]:
    """Mark the calls of this block as a check's or a measurement's (:func:`checking`), not the caller's own."""
    _checking.depth = getattr(_checking, "depth", 0) + 1
    try:
        yield
    finally:
        _checking.depth -= 1


def checking() -> bool:
    """Whether the calls running now in this thread are a check's (:func:`verified`), not the caller's own."""
    return getattr(_checking, "depth", 0) > 0


def forget_verified() -> None:
    """Forget every check made (tests; a module reloaded)."""
    _verified.clear()
    _said.clear()
