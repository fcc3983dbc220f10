"""A cached step of one token through every layer (generation, serving), a named operation: the layers' own forward
is the reference; the one-token step of a layer, ``DecodeLayer.step`` (txl.model.cache), looped over the layers'
weights, is its fast form, with the memory's layout passed in: over a KVCache's window in ``TransformerXL._decode``
(``Backends.fast_decode``; the checks of each module call made once), and over a ring of fixed shape in
``txl.infer.static_decode``, which CUDA replays as one graph (``Backends.graph_decode``); ``Backends.native_decode``
runs the same loop as one native call (decode.c: fp32 on the CPU, a C compiler). tests/test_backends_exact.py holds
every one to the reference, tests/test_static_decode.py the ring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from txl.kernels import native
from txl.kernels.backends import backends


def one_token_step(applies: bool, layers: Callable[[], Tensor], loop: Callable[[], Tensor]) -> Tensor:
    """Every layer for one new position: ``loop()`` where the one-token loop ``applies`` (a cached step of one token
    of attn_type 0, no attention weights asked for) and ``Backends.fast_decode`` is on, else ``layers()`` (the
    layers' forward)."""
    return loop() if applies and backends().fast_decode else layers()


def native_loop(
    plan: list, biases: tuple[Tensor, Tensor], h: Tensor, pos: list, mask: Tensor | None, cache: Any, state: dict,
    loop: Callable[[], Tensor], hids: list | None = None,
) -> Tensor:  # fmt: skip
    """The one-token loop: one native call (:func:`txl.kernels.native.decode_step`) where ``Backends.native_decode``
    is on and the kernel applies, else ``loop()`` (the Python loop); ``hids`` (None: not kept) receives the outputs
    of every layer but the last."""
    if backends().native_decode:
        out = native.decode_step(plan, biases, h, pos, mask, cache, state, hids)
        if out is not None:
            return out
    return loop()
