"""Transformer-XL (Dai et al., 2019, "Attentive Language Models Beyond a Fixed-Length Context"): the model, as one
import. Read it top to bottom like the paper, one file per concept (each under ~500 lines), as imported below.
Design notes: docs/internals.md#txlmodelmodeling."""

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
