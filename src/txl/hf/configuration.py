"""``TransfoXLConfig``: Hugging Face's TransfoXL configuration (its field names and defaults, the WikiText-103
model's), as a transformers-5 ``PreTrainedConfig``; :func:`txl_config` turns it into txl's own."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from txl.interop.convert import SAME_NAMES, hf_config_to_txl
from txl.model.modeling import HF_CONFIG_NAMES, TransformerXLConfig


@strict
class TransfoXLConfig(PreTrainedConfig):
    r"""Hugging Face's ``TransfoXLConfig`` (transformers 4.x; removed in 5), field for field, defaults included.
    Two fields are txl's:

    mem_init (`str`, defaults to `"zeros"`):
        The memory a first segment (``mems=None``) attends to. ``"zeros"``: ``mem_len`` zero vectors per layer, as
        Hugging Face's TransfoXL (and the original TensorFlow code) started; ``"empty"``: no memory, as the original
        PyTorch code started. The two give different outputs for the first ``mem_len`` tokens.
    keep_order (`bool`, defaults to `False`):
        ``losses`` in the order of the positions. By default they are in Hugging Face 4.x's order: its adaptive
        softmax (``keep_order=False``) returned them grouped by cluster (the head's positions, then each tail
        cluster's) whenever ``cutoffs`` is not empty: the same values, reordered.
    trainer_compatible (`bool`, defaults to `False`):
        Hugging Face 4.x's flag: with ``return_dict=False`` and labels, the tuple starts with the loss, ``(loss, (),
        losses, mems, ...)``, instead of 4.x's default ``(losses, (), mems, ..., loss)``.
    """

    model_type = "transfo-xl"
    keys_to_ignore_at_inference = ["mems"]
    attribute_map = {
        "n_token": "vocab_size",
        "hidden_size": "d_model",
        "num_attention_heads": "n_head",
        "num_hidden_layers": "n_layer",
    }

    vocab_size: int = 267735
    cutoffs: list[int] = field(default_factory=lambda: [20000, 40000, 200000])
    d_model: int = 1024
    d_embed: int = 1024
    n_head: int = 16
    d_head: int = 64
    d_inner: int = 4096
    div_val: int = 4
    pre_lnorm: bool = False
    n_layer: int = 18
    mem_len: int = 1600
    clamp_len: int = 1000
    same_length: bool = True
    proj_share_all_but_first: bool = True
    tie_projs: list[bool] | None = None
    attn_type: int = 0
    sample_softmax: int = -1
    adaptive: bool = True
    dropout: float = 0.1
    dropatt: float = 0.0
    untie_r: bool = True
    init: str = "normal"
    init_range: float = 0.01
    proj_init_std: float = 0.01
    init_std: float = 0.02
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    tie_word_embeddings: bool = True
    mem_init: Literal["zeros", "empty"] = "zeros"
    keep_order: bool = False
    trainer_compatible: bool = False

    def __post_init__(self, **kwargs):
        if self.tie_projs is None:  # Hugging Face derived it from proj_share_all_but_first
            self.tie_projs = [False] + [bool(self.proj_share_all_but_first)] * len(self.cutoffs)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Part of ``@strict``'s validation: what txl's model accepts (one clear error at construction)."""
        if self.mem_init not in ("zeros", "empty"):
            raise ValueError(f"mem_init = {self.mem_init!r}: 'zeros' (Hugging Face's) or 'empty' (the original's)")
        self.to_txl()

    @property
    def max_position_embeddings(self) -> None:
        """None: relative positions put no limit on the sequence length (transformers then sets no maximum; -1 made
        every ``generate`` warn that it exceeded a maximum length of -1)."""
        return None

    def to_txl(self) -> TransformerXLConfig:
        """txl's configuration of the same model."""
        return txl_config(self)

    @classmethod
    def from_txl(cls, config: TransformerXLConfig, **kwargs: Any) -> TransfoXLConfig:
        """The configuration of a model trained with txl (``txl train``): the same fields under Hugging Face's names,
        the memory starting empty as txl's does (``mem_init="empty"``); ``kwargs`` set other fields. A model
        Hugging Face's TransfoXL cannot describe (txl's own variants: attn_type 1-3, GTrXL gates, identity_map,
        tf_same_length) is one error naming what differs."""
        d = config.to_dict()
        fields = {k: d[k] for k in (*SAME_NAMES, "attn_type", "num_labels")}
        fields |= {hf: d[ours] for hf, ours in HF_CONFIG_NAMES.items()}  # (vocab_size, tie_word_embeddings)
        out = cls(mem_init="empty", **fields | kwargs)
        back = out.to_txl().to_dict()
        differ = sorted(k for k in d if k not in kwargs and back.get(k) != d[k])
        if differ:
            raise ValueError(
                f"this txl model has settings Hugging Face's TransfoXL cannot describe ({', '.join(differ)}: "
                f"{', '.join(f'{k}={d[k]!r}' for k in differ)}); use it with txl itself"
            )
        return out


def txl_config(config: TransfoXLConfig) -> TransformerXLConfig:
    """txl's :class:`~txl.model.modeling.TransformerXLConfig` of a Hugging Face TransfoXL configuration."""
    names = (*SAME_NAMES, *HF_CONFIG_NAMES, "attn_type", "num_labels")
    fields = {k: getattr(config, k) for k in names}
    fields["model_type"] = "transfo-xl"
    return hf_config_to_txl(fields, "TransfoXLConfig")
