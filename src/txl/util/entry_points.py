"""Methods of a lower layer's classes that a higher layer carries out, named here and imported when first called.
Design notes: docs/internals.md#txlutilentry_points."""

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
