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

from txl.kernels import native, registry
from txl.kernels.registry import Backend, _cpu_switch, dispatch, register

register(
    Backend(
        "fast_decode", "decode_step", "the layers' forward on one position", lambda p, dev: p.fast_decode, deep=True
    )
)
register(
    Backend(
        "native_decode",
        "decode_step",
        "the one-token loop in Python (fast_decode)",
        _cpu_switch("native_decode"),
        lambda h, *_: None if native.usable(h) else "not fp32 on the CPU",
    )
)


def one_token_step(
    layers: nn.Module, kind: tuple, reference: Callable[[], Tensor], loop: Callable[[], Tensor], h: Tensor
) -> Tensor:
    """Every layer for one new position ``h`` [B, 1, d_model]: ``loop()`` (the one-token loop) where the registry
    chooses ``fast_decode`` for the ``layers`` (stock, checked against ``reference()``, the layers' forward, for this
    ``kind`` of model, measured faster on the CPU); else ``reference()``."""
    return dispatch("fast_decode", layers, loop, reference, operands=(h,), kind=kind, where="layers")


def native_loop(
    plan: list, biases: tuple[Tensor, Tensor], h: Tensor, pos: list, mask: Tensor | None, cache: Any, state: dict,
    loop: Callable[[list | None], Tensor], hids: list | None = None,
) -> Tensor:  # fmt: skip
    """The one-token loop: one native call (:func:`txl.kernels.native.decode_step`) where the registry chooses
    ``native_decode`` (checked against ``loop``, the Python loop, for this kind of model in this process and measured
    faster than it here); else ``loop(hids)``. ``hids`` (None: not kept) receives the outputs of every layer but the
    last. (The checks run both on this step: each writes the same keys and values.)"""
    values = native.layer_values(plan)  # (every value the kernel reads from the modules: a new one is checked)
    fast = lambda: native.decode_step(plan, biases, h, pos, mask, cache, state, None, values)  # noqa: E731
    kind = (values, tuple((type(lay.gate1), type(lay.gate2)) for lay in plan))
    window = 1 << cache.length.bit_length()  # (the keys' count rounded up to a power of two, as the kind keeps it)
    shapes = (h.shape, cache.k.shape[:3], (window, h.shape[-1], plan[0].w1.shape[0]))
    if registry.choose("native_decode", None, fast, lambda: loop(None), operands=(h,), kind=kind, shapes=shapes):
        out = native.decode_step(plan, biases, h, pos, mask, cache, state, hids, values)
        if out is not None:
            return out
    return loop(hids)
