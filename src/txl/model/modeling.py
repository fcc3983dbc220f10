"""Transformer-XL (Dai et al., 2019, "Attentive Language Models Beyond a Fixed-Length Context"): the model, as one
import. Read it top to bottom like the paper, one file per concept (each under ~500 lines):

1. ``config.py``      ``TransformerXLConfig``: every hyper-parameter, validated (names the bad field).
2-4. ``positions.py`` ``sinusoid_embedding`` (the relative position table R, Sec. 3.3), ``rel_shift`` (Appendix B's
                      shift, a zero-copy strided view), ``causal_mask`` (over [memory; segment], with same_length).
5. ``attention.py``   ``RelPartialLearnableMultiHeadAttn``: the relative attention with the four terms (a)-(d).
6, 8. ``transformer.py`` ``PositionwiseFF`` / ``TransformerXLLayer`` (post-LN or pre-LN) and ``TransformerXL``:
                      embedding, layers and the segment-level recurrence (memory).
7. ``adaptive.py``    ``AdaptiveEmbedding`` / ``ProjectedAdaptiveLogSoftmax``: adaptive input and softmax (fp32).
   ``cache.py``       ``KVCache``: the memory as cached keys/values (inference).
9. ``heads.py``       ``TransformerXLLM`` / ``TransformerXLForSequenceClassification``.
10. ``ablation.py``   ``RelLearnableMultiHeadAttn`` / ``MultiHeadAttn``: the ablation's positional schemes
                      (attn_type 1-3: Shaw et al., Vaswani et al., Al-Rfou et al.), behind the same call.

The fast paths are not here: they are backends of named operations in ``txl.kernels`` (dropout, the linear
product, the attention, the NLL, the one-token step), chosen by the policy of ``txl.kernels.backends``; the model
calls the operation, and the reference runs where no backend applies.

Conventions: everything is batch-first. ``input_ids`` is ``[B, T]``; a memory is a list with one tensor per
layer, ``mems[l]`` of shape ``[B, M, d_model]``, holding the (detached) *inputs* of layer ``l`` for the last
``M <= mem_len`` positions. Memories are explicit inputs and outputs: the modules keep no hidden state. Shape
comments use B batch, T query (segment) length, M memory length, K = M + T key length, H heads, Dh head width.
"""

from txl.kernels.dropout import Dropout, dropout_seed
from txl.kernels.linear import SMALL_ROWS, SPLIT, WeightCopies, linear, transposed_weights, weight_copies
from txl.model.ablation import MultiHeadAttn, RelLearnableMultiHeadAttn, attention_class
from txl.model.adaptive import HEAD_ALIGN, AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from txl.model.attention import RelPartialLearnableMultiHeadAttn, RelPositions, at_least_fp32
from txl.model.cache import KVCache, supports_kv_cache
from txl.model.config import HF_CONFIG_NAMES, NonFiniteError, Reading, TransformerXLConfig
from txl.model.heads import (
    SequenceClassifierOutput,
    TransformerXLForSequenceClassification,
    TransformerXLLM,
    TransformerXLLMOutput,
)
from txl.model.positions import (
    SHIFT_ALIGN,
    causal_mask,
    mask_scores,
    mask_scores_,
    rel_shift,
    rel_shift_gather,
    shift_padding,
    sinusoid_embedding,
)
from txl.model.transformer import (
    PositionwiseFF,
    TransformerXL,
    TransformerXLLayer,
    TransformerXLModelOutput,
    TransformerXLPreTrainedModel,
)

__all__ = [
    "AdaptiveEmbedding",
    "Dropout",
    "HEAD_ALIGN",
    "HF_CONFIG_NAMES",
    "KVCache",
    "MultiHeadAttn",
    "NonFiniteError",
    "PositionwiseFF",
    "ProjectedAdaptiveLogSoftmax",
    "RelLearnableMultiHeadAttn",
    "RelPartialLearnableMultiHeadAttn",
    "Reading",
    "RelPositions",
    "SHIFT_ALIGN",
    "SMALL_ROWS",
    "SPLIT",
    "SequenceClassifierOutput",
    "TransformerXL",
    "TransformerXLConfig",
    "TransformerXLForSequenceClassification",
    "TransformerXLLM",
    "TransformerXLLMOutput",
    "TransformerXLLayer",
    "TransformerXLModelOutput",
    "TransformerXLPreTrainedModel",
    "WeightCopies",
    "at_least_fp32",
    "attention_class",
    "causal_mask",
    "dropout_seed",
    "linear",
    "mask_scores",
    "mask_scores_",
    "rel_shift",
    "rel_shift_gather",
    "shift_padding",
    "sinusoid_embedding",
    "supports_kv_cache",
    "transposed_weights",
    "weight_copies",
]
