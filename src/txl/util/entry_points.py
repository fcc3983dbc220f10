"""Methods of a lower layer's classes that a higher layer carries out, named here and imported when first called.

``TransformerXLLM.generate`` (Hugging Face's ``model.generate``) is the one: generation is built on the model
(``txl.infer.generation``: the K/V cache, the sampling loop), so the model layer cannot import it, yet users call it on
the model. The model's method asks :func:`implementation` for the function; nothing patches the class from outside,
and ``import txl`` imports nothing it does not use. tests/test_architecture.py checks that every name resolves.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

IMPLEMENTATIONS = {
    "TransformerXLLM.generate": "txl.infer.generation:generate_like_hf",
}
"""method -> "module:function" of the layer that carries it out."""


def implementation(name: str) -> Callable[..., Any]:
    """The function that carries out the method ``name`` (a key of :data:`IMPLEMENTATIONS`), its module imported on
    first use."""
    module, function = IMPLEMENTATIONS[name].split(":")
    return getattr(importlib.import_module(module), function)
