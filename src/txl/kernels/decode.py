"""A cached step of one token through every layer (generation, serving), a named operation with three backends: the
layers' own forward (the reference), one loop over the layers' weights in Python (``Backends.fast_decode``:
``TransformerXL._decode``, the same arithmetic with the checks of each module call made once), and the same loop as
one native call (``Backends.native_decode``: fp32 on the CPU, a C compiler). On CUDA, ``txl.infer.static_decode``
replays the step as a graph for generations (``Backends.graph_decode``). tests/test_backends_exact.py holds every
one to the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from txl.kernels import native
from txl.kernels.backends import backends


def one_token_step(applies: bool, layers: Callable[[], Tensor], loop: Callable[[], Tensor]) -> Tensor:
    """Every layer for one new position: ``loop()`` where the one-token loop ``applies`` (a cached step of one token
    of attn_type 0, no per-layer outputs asked for) and ``Backends.fast_decode`` is on, else ``layers()`` (the
    layers' forward)."""
    return loop() if applies and backends().fast_decode else layers()


def native_loop(
    plan: list, biases: tuple[Tensor, Tensor], h: Tensor, pos: list, mask: Tensor | None, cache: Any, state: dict,
    loop: Callable[[], Tensor],
) -> Tensor:  # fmt: skip
    """The one-token loop: one native call (:func:`txl.kernels.native.decode_step`) where ``Backends.native_decode``
    is on and the kernel applies, else ``loop()`` (the Python loop)."""
    if backends().native_decode:
        out = native.decode_step(plan, biases, h, pos, mask, cache, state)
        if out is not None:
            return out
    return loop()
