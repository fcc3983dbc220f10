"""txl.keras: Transformer-XL in Keras 3 (TensorFlow, JAX or PyTorch as the backend), under Hugging Face's TensorFlow
class names, exact to txl and to Hugging Face 4.46.3's TransfoXL.

    import os; os.environ["KERAS_BACKEND"] = "jax"          # or "tensorflow", before keras is imported
    from txl.keras import TFTransfoXLLMHeadModel
    lm = TFTransfoXLLMHeadModel.from_pretrained("runs/shakespeare")   # a txl folder, or a Hugging Face 4.x one
    out = lm(input_ids, mems=None)                          # prediction_scores [B, T, V], mems n_layer x [M, B, D]
    lm.generate(input_ids, 50, temperature=0)               # txl's tokens
    lm.save("lm.keras"); lm.save_pretrained("back")         # Keras's format; a txl folder

The extra ``transformer-xl[keras]`` installs Keras, TensorFlow (CPU) and JAX. docs/keras.md has the rest: training
with ``fit`` (the memory carried across batches), several devices (``keras.distribution``), TPUs.
"""

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

__all__ = [
    "AdaptiveEmbedding",
    "AdaptiveSoftmax",
    "PositionwiseFF",
    "RelPartialLearnableMultiHeadAttn",
    "ResetMemory",
    "TFAdaptiveEmbedding",
    "TFAdaptiveSoftmaxMask",
    "TFTransfoXLForSequenceClassification",
    "TFTransfoXLLMHeadModel",
    "TFTransfoXLLMHeadModelOutput",
    "TFTransfoXLMainLayer",
    "TFTransfoXLModel",
    "TFTransfoXLModelOutput",
    "TFTransfoXLSequenceClassifierOutputWithPast",
    "TokenStream",
    "TransfoXLBackbone",
    "TxlAdam",
    "TxlSchedule",
    "layout_map",
    "txl_adam",
]
