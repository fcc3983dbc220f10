"""txl: Transformer-XL for PyTorch (Dai et al., 2019). Design notes: docs/internals.md#txl."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

# The package's face: each name imported from its module when first asked for (``import txl`` imports neither torch
# nor a txl layer; ``txl.TransformerXLLM`` imports the model). No class is changed from here: the model's generate()
# names its implementation itself (txl.util.entry_points).
EXPORTS = {
    "Backends": "txl.kernels.backends",
    "set_backends": "txl.kernels.backends",
    "use_backends": "txl.kernels.backends",
    "CheckpointError": "txl.util.folders",
    "Tokenizer": "txl.data",
    "TransformerXL": "txl.model.modeling",
    "TransformerXLConfig": "txl.model.modeling",
    "TransformerXLForSequenceClassification": "txl.model.modeling",
    "TransformerXLLM": "txl.model.modeling",
    "TransformerXLLMOutput": "txl.model.modeling",
    "TransformerXLModelOutput": "txl.model.modeling",
}
__all__ = [
    "Backends",
    "CheckpointError",
    "Tokenizer",
    "TransformerXL",
    "TransformerXLConfig",
    "TransformerXLForSequenceClassification",
    "TransformerXLLM",
    "TransformerXLLMOutput",
    "TransformerXLModelOutput",
    "set_backends",
    "use_backends",
]  # (EXPORTS' names: tests/test_architecture.py)
__version__ = "0.1.0"

if TYPE_CHECKING:  # (what the names are, for type checkers and editors)
    from txl.data import Tokenizer
    from txl.kernels.backends import Backends, set_backends, use_backends
    from txl.model.modeling import (
        TransformerXL,
        TransformerXLConfig,
        TransformerXLForSequenceClassification,
        TransformerXLLM,
        TransformerXLLMOutput,
        TransformerXLModelOutput,
    )
    from txl.util.folders import CheckpointError


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'txl' has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name]), name)
    globals()[name] = value  # (asked once)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))


# Where each module of the flat layout lives now (old name -> new module).
MOVED_MODULES = {
    "txl.attention_maps": "txl.infer.attention_maps",
    "txl.backends": "txl.kernels.backends",
    "txl.checkpoint": "txl.train.checkpoint",
    "txl.convert": "txl.interop.convert",
    "txl.convert_original": "txl.interop.convert_original",
    "txl.convert_tf": "txl.interop.convert_tf",
    "txl.distributed": "txl.util.distributed",
    "txl.engine": "txl.serve.engine",
    "txl.evaluate": "txl.infer.evaluate",
    "txl.export": "txl.interop.export",
    "txl.fileio": "txl.util.fileio",
    "txl.finetune": "txl.train.finetune",
    "txl.generation": "txl.infer.generation",
    "txl.hf_vocab": "txl.interop.hf_vocab",
    "txl.lm_harness": "txl.interop.lm_harness",
    "txl.metrics": "txl.util.metrics",
    "txl.modeling": "txl.model.modeling",
    "txl.native": "txl.kernels.native",
    "txl.optim": "txl.train.optim",
    "txl.plot": "txl.util.plot",
    "txl.pretrained": "txl.model.pretrained",
    "txl.recl": "txl.infer.recl",
    "txl.runtime": "txl.kernels.runtime",
    "txl.serve_http": "txl.serve.http",
    "txl.static_decode": "txl.infer.static_decode",
    "txl.tf_checkpoint": "txl.interop.tf_checkpoint",
    "txl.trainer": "txl.train.trainer",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module that lives at its new path (one object under both names, so
    ``from txl.modeling import X`` and patching ``txl.trainer.X`` keep working)."""

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201 (importlib's protocol)
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec):  # noqa: ANN001, ANN201
        module = importlib.import_module(MOVED_MODULES[spec.name])
        spec.loader_state = module.__spec__  # (importlib writes the alias's spec onto the module next)
        return module

    def exec_module(self, module) -> None:  # noqa: ANN001
        module.__spec__ = module.__spec__.loader_state  # the module's own spec back


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
