"""txl.keras: Transformer-XL in Keras 3 (TensorFlow, JAX or PyTorch as the backend), under Hugging Face's TensorFlow
class names, exact to txl and to Hugging Face 4.46.3's TransfoXL. Design notes: docs/internals.md#txlkeras."""

from __future__ import annotations

from txl.keras.data import TokenStream
from txl.keras.distribution import layout_map
from txl.keras.layers import AdaptiveEmbedding, AdaptiveSoftmax, PositionwiseFF, RelPartialLearnableMultiHeadAttn
from txl.keras.models import (
    ResetMemory,
    TFAdaptiveEmbedding,
    TFAdaptiveSoftmaxMask,
    TFTransfoXLForSequenceClassification,
    TFTransfoXLLMHeadModel,
    TFTransfoXLLMHeadModelOutput,
    TFTransfoXLMainLayer,
    TFTransfoXLModel,
    TFTransfoXLModelOutput,
    TFTransfoXLSequenceClassifierOutputWithPast,
    TransfoXLBackbone,
)
from txl.keras.training import TxlAdam, TxlSchedule, txl_adam
