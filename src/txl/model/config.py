"""1. The model's configuration (every hyper-parameter, validated; Hugging Face's names accepted)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from txl.model.pretrained import model_folder, read_config, write_config

# ---------------------------------------------------------------------------------------------------------
# 1. Configuration
# ---------------------------------------------------------------------------------------------------------


class NonFiniteError(RuntimeError):
    """A model produced NaN or inf where a probability was expected; the message says where."""


HF_CONFIG_NAMES = {"vocab_size": "n_token", "tie_word_embeddings": "tie_weight"}
"""Hugging Face's TransfoXLConfig names of fields that txl calls by the paper's names."""


@dataclass
class TransformerXLConfig:
    """Hyper-parameters of a Transformer-XL model (names as in the paper's code)."""

    n_token: int = 256
    """Vocabulary size."""
    n_layer: int = 2
    """Number of Transformer-XL layers."""
    d_model: int = 64
    """Width of the hidden states (and of the memory)."""
    n_head: int = 2
    """Number of attention heads."""
    d_head: int = 32
    """Width of one attention head (n_head * d_head need not equal d_model)."""
    d_inner: int = 256
    """Inner width of the position-wise feed-forward network."""
    d_embed: int | None = None
    """Width of the (first cluster of the) adaptive embedding; None means d_model."""
    div_val: int = 1
    """Adaptive input/softmax divisor: cluster i has width d_embed // div_val**i (1 = one table)."""
    cutoffs: list[int] = field(default_factory=list)
    """Adaptive softmax cluster boundaries, increasing, each < n_token ([] = plain softmax; txl train drops those at
    or past the vocabulary's size)."""
    tie_weight: bool = True
    """Tie the softmax output weights to the input embedding tables."""
    tie_projs: list[bool] | None = None
    """Per cluster: tie the softmax projection to the embedding projection. None = [False] + [True] * len(cutoffs)
    (the WikiText-103 recipe: head projection untied, tail projections tied)."""
    dropout: float = 0.1
    """Dropout on embeddings, positional embeddings, attention output, feed-forward and the final hidden state."""
    dropatt: float = 0.0
    """Dropout on the attention probabilities."""
    pre_lnorm: bool = False
    """Pre-LayerNorm layers (x + f(LN(x))) instead of the paper's post-LayerNorm (LN(x + f(x)))."""
    identity_map: bool = False
    """GTrXL's identity-map reordering (TrXL-I, Parisotto et al. 2020): a ReLU on each sub-module's output before it
    joins the residual stream, which no LayerNorm touches (needs pre_lnorm, the LayerNorm at the sub-module's input)."""
    gate: Literal["residual", "gru", "input", "output", "highway", "sigmoid_tanh"] = "residual"
    """How a sub-module's output y joins the residual stream x: "residual" x + y; GTrXL's gating layers (its Table 2,
    with identity_map): "gru" (GTrXL), "input", "output", "highway", "sigmoid_tanh" (txl.model.gating)."""
    gate_bias: float = 2.0
    """b_g, the initial bias of the gates that have one: the larger, the closer each block starts to the identity."""
    untie_r: bool = False
    """One pair of position biases u (r_w_bias), v (r_r_bias) per layer instead of one shared by all layers."""
    same_length: bool = False
    """Every query attends to the same number (mem_len) of keys, itself included."""
    tf_same_length: bool = False
    """same_length as the TF code reads: a window of mem_len + 1 keys (the TF code's mask shows each query its
    memory of mem_len zero-started positions and itself; the PyTorch code's, mem_len keys in all). The paper's
    published models were evaluated by the TF code: `txl convert tf` sets it."""
    clamp_len: int = -1
    """Relative distances above clamp_len share one positional embedding (<= 0: no clamping)."""
    mem_len: int = 0
    """Default number of past hidden states kept as memory per layer (0 = no recurrence)."""
    cmem_len: int = 0
    """The Compressive Transformer's n_cm (Rae et al. 2020): compressed memory slots per layer, each made by
    ``compression`` from cmem_ratio memories that fall out of the memory (0 = Transformer-XL, exactly)."""
    cmem_ratio: int = 4
    """The compression rate c: memories per compressed slot."""
    compression: Literal["max", "mean", "conv", "dilated_conv", "most_used"] = "conv"
    """The compression function f_c (the paper's Sec. 3.1): max or mean pooling (kernel = stride = c), a 1D
    convolution (kernel = stride = c), dilated convolutions, or most-used (keep the memory that received the most
    attention of each c)."""
    attn_type: Literal[0, 1, 2, 3] = 0
    """Positional scheme (the original code's numbering; 1-3 are the paper's ablations, Table 6): 0 Transformer-XL's
    relative encoding (R, W_kR, u, v); 1 Shaw et al. (2018): learned relative embeddings per layer and distance,
    with the original code's learned biases; 2 Vaswani et al. (2017): sinusoid absolute positions added to the
    input; 3 Al-Rfou et al. (2018): learned absolute positions added to every layer's input. An absolute position
    is the index in the attended window [memory; segment] (see section 10)."""
    max_klen: int = 0
    """attn_type 1 and 3: number of learned distances (1) or positions (3); farther ones share the last embedding.
    0 for attn_type 0 and 2; a training run sets tgt_len + ext_len + mem_len, the longest span of training."""
    layer_norm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    init: Literal["normal", "uniform"] = "normal"
    """Weight initialisation: N(0, init_std) or U(-init_range, init_range)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation (LayerNorm weights ~ N(1, init_std))."""
    init_range: float = 0.1
    """Range of the uniform initialisation."""
    proj_init_std: float = 0.01
    """Standard deviation of the adaptive embedding/softmax projections."""
    num_labels: int = 2
    """Number of labels of the sequence-classification head (1 = regression)."""
    pad_token_id: int | None = None
    """Padding token (sequence classification pools the last token that is not padding)."""

    def __post_init__(self) -> None:
        self.cutoffs = list(self.cutoffs)
        if self.d_embed is None:
            self.d_embed = self.d_model
        if self.tie_projs is None:
            self.tie_projs = [False] + [True] * len(self.cutoffs)
        self.tie_projs = [bool(t) for t in self.tie_projs]
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"TransformerXLConfig.{name} = {getattr(self, name)!r}: {why}")

        for name in ("n_token", "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed", "div_val"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                bad(name, "must be a positive integer")
        for name in ("mem_len", "clamp_len"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                bad(name, "must be an integer")
        if self.mem_len < 0:
            bad("mem_len", "must be >= 0")
        c = self.cutoffs
        if any(isinstance(x, bool) or not isinstance(x, int) for x in c):
            bad("cutoffs", "must be a list of integers")
        if any(b <= a for a, b in zip([0, *c], [*c, self.n_token], strict=True)):
            bad("cutoffs", f"must be strictly increasing, > 0 and < n_token ({self.n_token})")
        if len(self.tie_projs) != len(c) + 1:
            default = [False] + [True] * len(c)
            why = f"needs one entry per cluster (len(cutoffs) + 1 = {len(c) + 1}), e.g. the default {default}"
            bad("tie_projs", why)
        if self.div_val > 1 and self.d_embed // self.div_val ** len(c) < 1:
            bad("div_val", f"gives a zero-width embedding for the last cluster (d_embed={self.d_embed})")
        for name in ("dropout", "dropatt", "init_std", "init_range", "proj_init_std", "layer_norm_epsilon"):
            value = getattr(self, name)  # (probes hf28: a string was "'<=' not supported between str and int")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                bad(name, "must be a finite number")
        for name in ("dropout", "dropatt"):
            if not 0.0 <= getattr(self, name) < 1.0:
                bad(name, "must be in [0, 1)")
        if self.init not in ("normal", "uniform"):
            bad("init", "must be 'normal' or 'uniform'")
        for name in ("init_std", "init_range", "proj_init_std", "layer_norm_epsilon"):
            if getattr(self, name) <= 0:
                bad(name, "must be > 0")
        if self.same_length and self.mem_len == 0:
            bad("same_length", "needs mem_len > 0 (the window of mem_len keys would be empty)")
        if self.attn_type not in (0, 1, 2, 3) or isinstance(self.attn_type, bool):
            bad("attn_type", "must be 0 (Transformer-XL), 1 (Shaw et al.), 2 (Vaswani et al.) or 3 (Al-Rfou et al.)")
        if isinstance(self.max_klen, bool) or not isinstance(self.max_klen, int) or self.max_klen < 0:
            bad("max_klen", "must be an integer >= 0")
        if self.attn_type in (0, 2) and self.max_klen:
            bad("max_klen", f"attn_type {self.attn_type} learns no position table (only 1 and 3 do): leave it 0")
        if self.d_model % 2 and self.attn_type in (0, 2):  # (the reference fails on it deep inside the forward)
            bad("d_model", f"must be even for attn_type {self.attn_type}: the sinusoid R has a sin and a cos half")
        if self.clamp_len > 0 and self.attn_type in (2, 3):
            bad("clamp_len", f"clamps relative distances; attn_type {self.attn_type} has absolute positions: use -1")
        if self.untie_r and self.attn_type != 0:
            bad(
                "untie_r",
                "unties Transformer-XL's biases u, v (attn_type 0); attn_type 1 always has one pair per "
                "layer and 2, 3 have none",
            )
        if self.identity_map and not self.pre_lnorm:
            bad("identity_map", "reorders the pre-LN layer (LayerNorm at each sub-module's input): set pre_lnorm: true")
        gates = ("residual", "gru", "input", "output", "highway", "sigmoid_tanh")
        if self.gate not in gates:
            bad("gate", f"must be one of {', '.join(gates)}")
        if self.gate != "residual" and not self.identity_map:
            bad("gate", "gates the identity-map reordered layer (GTrXL): set identity_map: true (and pre_lnorm: true)")
        if (
            isinstance(self.gate_bias, bool)
            or not isinstance(self.gate_bias, (int, float))
            or self.gate_bias != self.gate_bias
        ):
            bad("gate_bias", "must be a number")
        if self.num_labels < 1:
            bad("num_labels", "must be >= 1")
        self._validate_compression(bad)

    def _validate_compression(self, bad: Any) -> None:
        for name in ("cmem_len", "cmem_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "cmem_len" else 1):
                bad(name, "must be an integer >= " + ("0" if name == "cmem_len" else "1"))
        kinds = ("max", "mean", "conv", "dilated_conv", "most_used")
        if self.compression not in kinds:
            bad("compression", f"must be one of {', '.join(kinds)}")
        if self.cmem_len and not self.mem_len:
            bad("cmem_len", "compresses the memories that fall out of the memory: set mem_len > 0")
        if self.cmem_len and self.attn_type != 0:
            bad(
                "cmem_len",
                f"reads the compressed memory by relative positions (attn_type 0), not attn_type {self.attn_type}",
            )

    @property
    def n_clusters(self) -> int:
        """Number of tail clusters of the adaptive softmax."""
        return len(self.cutoffs)

    @property
    def vocab_size(self) -> int:
        """Hugging Face's name of ``n_token`` (it can be set, as there)."""
        return self.n_token

    @vocab_size.setter
    def vocab_size(self, value: int) -> None:
        self.n_token = value

    @property
    def tie_word_embeddings(self) -> bool:
        """Hugging Face's name of ``tie_weight``."""
        return self.tie_weight

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, value: bool) -> None:
        self.tie_weight = value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``directory/config.json`` (as a model's ``save_pretrained`` does, without the weights)."""
        return write_config(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> TransformerXLConfig:
        """The config of a saved model: a model folder, a checkpoint ``step-N`` folder or a run folder."""
        return read_config(cls, model_folder(directory))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerXLConfig:
        """Build from a dict; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            hints = [f"{k} is {HF_CONFIG_NAMES[k]} here" for k in unknown if k in HF_CONFIG_NAMES]
            hint = f" (Hugging Face's {', '.join(hints)}; txl convert hf reads a whole HF config)" if hints else ""
            raise ValueError(f"unknown TransformerXLConfig field(s): {', '.join(unknown)}{hint}")
        return cls(**data)


def check_time_major_mems(mems: Any, batch: int | None, cfg: TransformerXLConfig) -> None:
    """Hugging Face's memories (PyTorch's or Keras'): a list of n_layer tensors [M, batch, d_model] (time-major), every
    layer's of one length; one error naming what differs."""
    if not isinstance(mems, list | tuple) or len(mems) != cfg.n_layer:
        n = len(mems) if isinstance(mems, list | tuple) else type(mems).__name__
        raise ValueError(f"mems must be a list of n_layer = {cfg.n_layer} tensors [mem_len, batch, d_model], got {n}")
    shapes = [tuple(getattr(m, "shape", ())) for m in mems]
    for i, shape in enumerate(shapes):
        if len(shape) != 3 or shape[1] not in (batch, None) or shape[2] != cfg.d_model or shape[0] != shapes[0][0]:
            raise ValueError(
                f"mems[{i}] must be [mem_len, batch={batch}, d_model={cfg.d_model}] (time-major, as the model returns "
                f"them; every layer's of one length), got {list(shape)}"
            )


def _with_hf_names(init: Callable[..., None]) -> Callable[..., None]:
    """The config's constructor, also taking Hugging Face's names of its fields (``vocab_size=``)."""

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        for hf, ours in HF_CONFIG_NAMES.items():
            if hf in kwargs:
                if ours in kwargs:
                    raise TypeError(f"TransformerXLConfig: give {ours} or Hugging Face's name {hf}, not both")
                kwargs[ours] = kwargs.pop(hf)
        init(self, *args, **kwargs)

    return __init__


TransformerXLConfig.__init__ = _with_hf_names(TransformerXLConfig.__init__)  # type: ignore[method-assign]


@dataclass(frozen=True)
class Reading:
    """How a model reads a text (the paper evaluates with a longer memory than it trained with): each setting None
    is the model config's. Passed to the model's calls (``model(ids, reading=...)``, generation, scoring); the config
    is never changed by it."""

    mem_len: int | None = None
    """Positions of memory kept per layer."""
    same_length: bool | None = None
    """Every query sees the same number of keys (mem_len)."""
    clamp_len: int | None = None
    """Relative distances beyond this use the same encoding (-1: none)."""
    cmem_len: int | None = None
    """Compressed memory slots kept per layer (a Compressive Transformer's; 0: none)."""

    def over(
        self, mem_len: int | None = None, same_length: bool | None = None, clamp_len: int | None = None,
        cmem_len: int | None = None,
    ) -> Reading:  # fmt: skip
        """These settings with the given ones that are not None in their place."""
        if mem_len is None and same_length is None and clamp_len is None and cmem_len is None:
            return self
        return Reading(
            mem_len=self.mem_len if mem_len is None else mem_len,
            same_length=self.same_length if same_length is None else same_length,
            clamp_len=self.clamp_len if clamp_len is None else clamp_len,
            cmem_len=self.cmem_len if cmem_len is None else cmem_len,
        )

    @staticmethod
    def of(reading: Reading | None, config: TransformerXLConfig, **overrides: int | bool | None) -> Reading:
        """How a call reads: ``reading`` (None: as the config says) with the ``overrides`` that are not None
        (``mem_len``, ``same_length``, ``clamp_len``), every setting then set (the config's where none is given)."""
        return (reading or Reading()).over(**overrides).resolved(config)

    def resolved(self, config: TransformerXLConfig) -> Reading:
        """Every setting set: the config's where this one has None."""
        if None not in (self.mem_len, self.same_length, self.clamp_len, self.cmem_len):  # (every call's case: fast)
            return self
        unset = {f.name: getattr(config, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is None}
        return dataclasses.replace(self, **unset) if unset else self
