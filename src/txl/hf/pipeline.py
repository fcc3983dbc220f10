"""``pipeline("text-generation")`` text for TransfoXL's word-level vocabularies.
Design notes: docs/internals.md#txlhfpipeline."""

from __future__ import annotations

from typing import Any

from transformers import TextGenerationPipeline
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.text_generation import ReturnType

from txl.hf.tokenization import TransfoXLTokenizer


class TransfoXLTextGenerationPipeline(TextGenerationPipeline):
    """transformers' ``TextGenerationPipeline``; with a word-level TransfoXL tokenizer, the full text is the prompt
    followed by the continuation as the whole sequence decodes it (4.x's rule)."""

    def postprocess(self, model_outputs: dict, return_type: Any = ReturnType.FULL_TEXT, *args: Any, **kwargs: Any):
        records = super().postprocess(model_outputs, return_type, *args, **kwargs)
        tok, prompt_text = self.tokenizer, model_outputs.get("prompt_text")
        word = isinstance(tok, TransfoXLTokenizer) and tok.txl.kind == "word"
        if not word or return_type != ReturnType.FULL_TEXT or not isinstance(prompt_text, str):
            return records
        input_ids = model_outputs["input_ids"]
        n = 0 if input_ids is None else input_ids.shape[-1]
        skip = kwargs.get("skip_special_tokens")
        skip = True if skip is None else skip
        for record, sequence in zip(records, model_outputs["generated_sequence"][0].tolist(), strict=True):
            prompt, whole = (
                tok.decode(sequence[:n], skip_special_tokens=skip),
                tok.decode(sequence, skip_special_tokens=skip),
            )
            new = (
                whole[len(prompt) :]
                if whole.startswith(prompt)
                else " " + tok.decode(sequence[n:], skip_special_tokens=skip)
            )
            record["generated_text"] = prompt_text + new
        return records


def register() -> None:
    """Make :class:`TransfoXLTextGenerationPipeline` the class of the ``"text-generation"`` task (quietly: the task's
    own entry, its model classes and default kept)."""
    task = PIPELINE_REGISTRY.supported_tasks.get("text-generation")
    impl = None if task is None else task["impl"]  # (a class, or its dotted path, resolved when a pipeline is made)
    if isinstance(impl, str) and impl.rsplit(".", 1)[-1] == "TextGenerationPipeline":
        impl = TextGenerationPipeline
    if isinstance(impl, type) and issubclass(TransfoXLTextGenerationPipeline, impl):
        task["impl"] = TransfoXLTextGenerationPipeline
