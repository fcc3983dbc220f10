"""txl: Transformer-XL for PyTorch (Dai et al., 2019)."""

from txl.backends import Backends, set_backends, use_backends
from txl.data import Tokenizer
from txl.modeling import (
    TransformerXL,
    TransformerXLConfig,
    TransformerXLForSequenceClassification,
    TransformerXLLM,
    TransformerXLLMOutput,
    TransformerXLModelOutput,
)
from txl.pretrained import CheckpointError

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
]
__version__ = "0.1.0"
