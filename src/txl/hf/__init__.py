"""Transformer-XL in Hugging Face transformers 5: Hugging Face's TransfoXL classes (removed from transformers in
version 5) over txl's model, registered with the Auto classes when this package is imported.
Design notes: docs/internals.md#txlhf."""

from __future__ import annotations

try:
    import transformers
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("txl.hf needs transformers 5: pip install 'transformer-xl[hf]'") from e

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(
        f"txl.hf is for transformers 5 (transformers {transformers.__version__} is installed, which has TransfoXL "
        "of its own): pip install 'transformer-xl[hf]'"
    )

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from txl.hf.configuration import TransfoXLConfig, txl_config  # noqa: E402
from txl.hf.modeling import (  # noqa: E402
    TransfoXLForSequenceClassification,
    TransfoXLLMHeadModel,
    TransfoXLLMHeadModelOutput,
    TransfoXLModel,
    TransfoXLModelOutput,
    TransfoXLPreTrainedModel,
    TransfoXLSequenceClassifierOutputWithPast,
)
from txl.hf.pipeline import TransfoXLTextGenerationPipeline, register  # noqa: E402
from txl.hf.tokenization import TransfoXLTokenizer  # noqa: E402

# transformers' own registry (the model type is no longer built in, so nothing is overridden)
AutoConfig.register("transfo-xl", TransfoXLConfig, exist_ok=True)
AutoModel.register(TransfoXLConfig, TransfoXLModel, exist_ok=True)
AutoModelForCausalLM.register(TransfoXLConfig, TransfoXLLMHeadModel, exist_ok=True)
AutoModelForSequenceClassification.register(TransfoXLConfig, TransfoXLForSequenceClassification, exist_ok=True)
AutoTokenizer.register(TransfoXLConfig, tokenizer_class=TransfoXLTokenizer, exist_ok=True)
register()  # pipeline("text-generation"): a word-level continuation keeps its space (txl.hf.pipeline)
