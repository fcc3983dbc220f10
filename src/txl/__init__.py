"""txl: Transformer-XL for PyTorch (Dai et al., 2019)."""

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
    "CheckpointError",
    "Tokenizer",
    "TransformerXL",
    "TransformerXLConfig",
    "TransformerXLForSequenceClassification",
    "TransformerXLLM",
    "TransformerXLLMOutput",
    "TransformerXLModelOutput",
]
__version__ = "0.1.0"
