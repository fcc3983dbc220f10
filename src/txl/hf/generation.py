"""Generation for txl.hf's language model: transformers' ``GenerationMixin`` with txl's memory as the cache, as
transformers 4.x's TransfoXL did it. Design notes: docs/internals.md#txlhfgeneration."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import GenerationMixin
from transformers import __version__ as transformers_version
from transformers.generation import utils as generation_utils
from transformers.utils import ModelOutput

_STEPPING = "txl_stepping"
"""The key txl's ``_update_model_kwargs_for_generation`` adds to generate's model kwargs: the steps after the first."""
_SUPPORTED = ">=5.23,<6 (pyproject.toml's range; CI tests the lock file's version and the newest)"


def check_generation_contract() -> None:
    """What txl.hf's generation relies on in transformers' GenerationMixin, checked before the first step: it calls
    ``_update_model_kwargs_for_generation`` after each forward, and beam search reorders a cache kept under "mems"
    with the model's ``_reorder_cache``. A release that changes either is refused in one line, never silently run."""
    names = getattr(generation_utils, "ALL_CACHE_NAMES", ())
    hook = getattr(GenerationMixin, "_update_model_kwargs_for_generation", None)
    if "mems" not in names or hook is None:
        raise RuntimeError(
            f"txl.hf's generation does not support transformers {transformers_version}: its GenerationMixin no longer "
            f"keeps a cache named mems (supported: {_SUPPORTED})"
        )


class MemoryGenerationMixin(GenerationMixin):
    """``GenerationMixin`` for a model whose forward takes and returns ``mems`` (n_layer tensors [mem_len, batch,
    d_model]). (Its name ends in "GenerationMixin": transformers' ``can_generate`` looks for that in the bases.)"""

    def _update_model_kwargs_for_generation(
        self, outputs: ModelOutput, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        for name in ("past_key_values", "cache"):  # (where a transformers release put the memory under its own name)
            model_kwargs.pop(name, None)
        model_kwargs["mems"] = outputs.mems
        model_kwargs[_STEPPING] = True
        return model_kwargs

    def prepare_inputs_for_generation(self, input_ids: Tensor, mems: list[Tensor] | None = None, **kwargs: Any):
        """The first step reads the whole prompt; every later step the newest token on top of the memory.

        ``attention_mask`` (0 = padding, as a tokenizer pads a batch on the left) is honoured: the prompt's pads are
        never attended, nor later as part of the memory (the memory's positions the mask does not cover, the zero
        memory of ``mem_init="zeros"``, count as tokens). ``output_attentions`` / ``output_hidden_states`` are
        passed on, so ``return_dict_in_generate=True`` returns them per step."""
        check_generation_contract()
        inputs: dict[str, Any] = {k: kwargs[k] for k in ("output_attentions", "output_hidden_states") if k in kwargs}
        mask = kwargs.get("attention_mask")
        padded = mask is not None and not bool(mask.all())
        if not kwargs.get(_STEPPING):
            if mems is not None:
                raise ValueError(
                    "generate: pass no mems: generation reads the prompt first and keeps the memory itself (to "
                    "continue a text, put it in the prompt)"
                )
            return {**inputs, "input_ids": input_ids, **({"attention_mask": mask} if padded else {})}
        if not mems:
            raise RuntimeError(
                "generate: this transformers release did not hand back the memory kept after the last step; txl.hf "
                f"supports transformers {_SUPPORTED} (report the version you have: {transformers_version})"
            )
        inputs.update(input_ids=input_ids[:, -1:], mems=mems)
        if padded:  # [batch, M + 1]: the memory (the last M positions before this one) and the new token
            M = mems[0].shape[0]
            before = torch.cat([mask.new_ones(mask.shape[0], M), mask[:, :-1]], 1)[:, -M:] if M else mask[:, :0]
            inputs["attention_mask"] = torch.cat([before, mask[:, -1:]], 1)
        return inputs

    @staticmethod
    def _reorder_cache(mems: list[Tensor], beam_idx: Tensor) -> list[Tensor]:
        """Beam search: each beam's memory follows the beam it continues (memories are [mem_len, batch, d_model])."""
        return [m.index_select(1, beam_idx.to(m.device)) for m in mems]
