"""A cached step of one token through every layer (generation, serving), a named operation: the layers' own forward
is the reference; the one-token step of a layer, ``DecodeLayer.step`` (txl.model.cache: the attention's products and
scores from its weights, then the layer's own output and feed-forward modules), looped over the layers, is its fast
form, with the memory's layout passed in: over a KVCache's window in ``TransformerXL._decode``
(``Backends.fast_decode``), and over a ring of fixed shape in ``txl.infer.static_decode``, which CUDA replays as one
graph (``Backends.graph_decode``); ``Backends.native_decode`` runs the same loop as one native call (decode.c: fp32 on
the CPU, a C compiler). Each is admitted only for stock layers (``txl.kernels.admission``), checked against its
reference once per process and kind of model, and the native call runs only where it was measured faster than the
Python loop here (``txl.kernels.measured``). tests/test_backends_exact.py holds every one to the reference,
tests/test_changed_models.py the admission, tests/test_static_decode.py the ring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from txl.kernels import measured, native
from txl.kernels.admission import admits, verified
from txl.kernels.backends import backends


def one_token_step(
    layers: nn.Module, kind: tuple, reference: Callable[[], Tensor], loop: Callable[[], Tensor]
) -> Tensor:
    """Every layer for one new position: ``loop()`` (the one-token loop) where ``Backends.fast_decode`` is on, the
    ``layers`` are stock and the loop was checked against ``reference()`` (the layers' forward) for this ``kind`` of
    model in this process; else ``reference()``."""
    if backends().fast_decode and admits("fast_decode", layers, deep=True, name="layers"):
        if verified("fast_decode", kind, loop, reference):
            return loop()
    return reference()


def native_loop(
    plan: list, biases: tuple[Tensor, Tensor], h: Tensor, pos: list, mask: Tensor | None, cache: Any, state: dict,
    loop: Callable[[list | None], Tensor], hids: list | None = None,
) -> Tensor:  # fmt: skip
    """The one-token loop: one native call (:func:`txl.kernels.native.decode_step`) where ``Backends.native_decode``
    is on, the kernel applies, it was checked against ``loop`` (the Python loop) for this kind of model in this
    process and measured faster than it here; else ``loop(hids)``. ``hids`` (None: not kept) receives the outputs of
    every layer but the last. (The checks run both on this step: each writes the same keys and values.)"""
    if backends().native_decode:
        values = native.layer_values(plan)  # (every value the kernel reads from the modules: a new one is checked)
        fast = lambda: native.decode_step(plan, biases, h, pos, mask, cache, state, None, values)  # noqa: E731
        first = plan[0]
        kind = (values, tuple((type(lay.gate1), type(lay.gate2)) for lay in plan), h.dtype)
        if verified("native_decode", kind, fast, lambda: loop(None)):
            shapes = (h.shape, cache.k.shape[:3], (cache.length + 1, h.shape[-1], first.w1.shape[0]))
            if measured.faster("native_decode", shapes, h.dtype, fast, lambda: loop(None)):
                out = native.decode_step(plan, biases, h, pos, mask, cache, state, hids, values)
                if out is not None:
                    return out
    return loop(hids)
