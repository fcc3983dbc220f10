"""Transformer-XL (Dai et al., 2019, "Attentive Language Models Beyond a Fixed-Length Context"), one file.

Reads top to bottom like the paper:

1. ``TransformerXLConfig``            - every hyper-parameter, validated (names the bad field).
2. ``sinusoid_embedding``             - the relative position table R (Sec. 3.3).
3. ``rel_shift``                      - Appendix B's shift, as a zero-copy strided view.
4. ``causal_mask``                    - causal mask over [memory; segment], with ``same_length``.
5. ``RelPartialLearnableMultiHeadAttn`` - the relative attention with the four terms (a)-(d) (attn_type 0).
6. ``PositionwiseFF`` / ``TransformerXLLayer`` - post-LN (default) or pre-LN layers.
7. ``AdaptiveEmbedding`` / ``ProjectedAdaptiveLogSoftmax`` - adaptive input and softmax (fp32).
8. ``KVCache``, ``TransformerXL``       - the memory as cached keys/values (inference); embedding, layers and the
                                        segment-level recurrence (memory).
9. ``TransformerXLLM`` / ``TransformerXLForSequenceClassification`` - the heads.
10. ``RelLearnableMultiHeadAttn`` / ``MultiHeadAttn`` - the ablation's positional schemes (``attn_type`` 1-3:
    Shaw et al., Vaswani et al., Al-Rfou et al.), behind the same call as the main attention.

Conventions: everything is batch-first. ``input_ids`` is ``[B, T]``; a memory is a list with one tensor per
layer, ``mems[l]`` of shape ``[B, M, d_model]``, holding the (detached) *inputs* of layer ``l`` for the last
``M <= mem_len`` positions. Memories are explicit inputs and outputs: the modules keep no hidden state. Shape
comments use B batch, T query (segment) length, M memory length, K = M + T key length, H heads, Dh head width.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl import native
from txl.backends import backends
from txl.pretrained import PretrainedMixin, model_folder, read_config, write_config

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
        if self.num_labels < 1:
            bad("num_labels", "must be >= 1")

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


# ---------------------------------------------------------------------------------------------------------
# 2. Relative positional encoding R (Sec. 3.3): sinusoids of the distance i - j, sin half then cos half.
# ---------------------------------------------------------------------------------------------------------


def sinusoid_embedding(
    klen: int, d_model: int, clamp_len: int = -1, device=None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """R for the distances ``klen-1, ..., 1, 0`` (column j of a score row holds distance klen-1-j)."""
    pos_seq = torch.arange(klen - 1, -1, -1.0, device=device, dtype=dtype)  # [K], descending distances
    if clamp_len > 0:
        pos_seq = pos_seq.clamp(max=clamp_len)
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, device=device, dtype=dtype) / d_model))  # [D/2]
    sinusoid = torch.outer(pos_seq, inv_freq)  # [K, D/2]
    return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)  # [K, D]


# ---------------------------------------------------------------------------------------------------------
# 3. Appendix B: the shift. The raw term B+D is computed for all K distances with one matmul,
#    bd_raw[.., i, k] = (q_i + v) . W_kR R_{K-1-k}. Query i (absolute index M+i) needs distance M+i-j at key j,
#    i.e. bd[.., i, j] = bd_raw[.., i, j + T-1-i]. Row-major that is element (T-1) + i*(K-1) + j of each
#    [T, K] block: a strided view with row stride K-1 and offset T-1, no copy and no padding. Entries with
#    j > M+i read the next row; they are exactly the causally masked ones. The gradient flows back the same way:
#    grad_raw[.., i, c] = grad[.., i, c + i - (T-1)], again one strided view, of the gradient padded with T-1 zero
#    columns in front (the masked entries carry no gradient, so nothing is lost). The generic backward of a strided
#    view (a scatter through index tensors) costs 2.5x more.
#    In inference the raw rows get P >= 1 zero columns more (W = K + P, a multiple of 8): the view's row stride
#    becomes W-1 and the masked entries land on the padding and on columns of the next row that no unmasked entry
#    reads, so the view has no overlap and the mask is added in place instead of into a copy of the scores.
# ---------------------------------------------------------------------------------------------------------

SHIFT_ALIGN = 8
"""The padded raw rows of inference are a multiple of this many columns (a 769-column GEMM costs 1.7x a 768-column
one on a Zen 4 EPYC; 776 costs the same as 768)."""


def shift_padding(klen: int) -> int:
    """The zero columns (1 to ``SHIFT_ALIGN``) that inference appends to the raw rows of ``klen`` keys."""
    return SHIFT_ALIGN - klen % SHIFT_ALIGN


class _RelShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bd_raw: Tensor) -> Tensor:
        *lead, qlen, klen = bd_raw.shape
        ctx.order = sorted(range(len(lead)), key=lambda d: -bd_raw.stride(d))  # the raw term's layout (bmm's)
        stride = (*bd_raw.stride()[:-2], klen - 1, 1)
        return bd_raw.as_strided((*lead, qlen, klen), stride, bd_raw.storage_offset() + qlen - 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        # Rows of K+T: grad_raw[i, c] (c < K) is buf[i, c]; grad[i, j] goes to buf[i, j + T-1-i], i.e. a view of buf
        # with row stride K+T-1 and offset T-1. Only the first T-1 columns of each row (the zeros of grad_raw, and
        # columns the copy overwrites) are zeroed first, and buf's leading dimensions take the raw term's layout,
        # so that the products' backward reads grad_raw without a copy.
        *lead, qlen, klen = grad.shape
        order = ctx.order
        buf = grad.new_empty(*(lead[d] for d in order), qlen, klen + qlen)  # [..., T, K+T] in the raw layout
        buf[..., : qlen - 1].zero_()
        buf = buf.permute(*(order.index(d) for d in range(len(lead))), len(lead), len(lead) + 1)  # grad's order
        stride = (*buf.stride()[:-2], klen + qlen - 1, 1)
        buf.as_strided(grad.shape, stride, buf.storage_offset() + qlen - 1).copy_(grad)
        return buf[..., :klen]


def rel_shift(bd_raw: Tensor, klen: int | None = None) -> Tensor:
    """Shift ``[..., T, K]`` scores from distance order to key order (Appendix B), as a view.

    Only each ``[T, K]`` block must be contiguous; the leading dimensions may have any strides. The gradient of
    the entries that read the next row (the causally masked ones) must be zero, as it is for masked scores (their
    probability is exactly 0). With ``klen`` < the rows' width (``[..., T, klen + P]``, P zero columns, see
    ``shift_padding``; inference only) the result ``[..., T, klen]`` is a view without overlap, writable in place.
    """
    *lead, qlen, width = bd_raw.shape
    klen = width if klen is None else klen
    if torch.compiler.is_exporting():  # (ONNX export: strided views do not export; the same values by index)
        return rel_shift_gather(bd_raw[..., :klen])
    if bd_raw.stride(-1) != 1 or bd_raw.stride(-2) != width:
        bd_raw = bd_raw.contiguous()
    if width == klen:
        return _RelShift.apply(bd_raw)
    stride = (*bd_raw.stride()[:-2], width - 1, 1)
    return bd_raw.as_strided((*lead, qlen, klen), stride, bd_raw.storage_offset() + qlen - 1)


def rel_shift_gather(bd_raw: Tensor) -> Tensor:
    """:func:`rel_shift` as a gather (``bd[.., i, j] = bd_raw[.., i, j + T-1-i]``, what graph exporters can express).
    The entries with ``j > M+i``, masked by causality, read column K-1 instead of the next row."""
    qlen, klen = bd_raw.shape[-2], bd_raw.shape[-1]
    i = torch.arange(qlen, device=bd_raw.device)[:, None]
    j = torch.arange(klen, device=bd_raw.device)[None, :]
    index = (j + (qlen - 1) - i).clamp(max=klen - 1)  # [T, K]
    return bd_raw.gather(-1, index.expand(bd_raw.shape))


# ---------------------------------------------------------------------------------------------------------
# 4. The mask over [memory; segment]: query i (absolute position M+i) sees key j iff j <= M+i (causal), and with
#    same_length also j > M+i-mem_len, i.e. a window of exactly mem_len keys including itself once that many
#    exist (identical to the reference PyTorch code's triu/tril construction, including K = mem_len + T). The TF
#    code's _create_mask shows query i the keys j >= i of [memory; segment]: with its memory of M = mem_len zero-
#    started positions, a window of mem_len + 1 keys (tf_same_length: the window argument is then mem_len + 1).
# ---------------------------------------------------------------------------------------------------------


def _masks_any(qlen: int, mlen: int, same_length: bool, window: int) -> bool:
    """Whether ``causal_mask`` masks anything: causality does for T > 1, the same_length window once the span
    exceeds it. (A single newest query with an unwindowed memory sees every key.)"""
    return qlen > 1 or (same_length and mlen + qlen > window)


def causal_mask(qlen: int, mlen: int, same_length: bool, window: int, device=None) -> Tensor:
    """Boolean ``[T, K]`` mask, True = masked; with ``same_length`` each query sees the last ``window`` keys up to
    itself (mem_len; mem_len + 1 with tf_same_length)."""
    i = torch.arange(qlen, device=device)[:, None] + mlen  # absolute query positions
    j = torch.arange(mlen + qlen, device=device)[None, :]
    mask = j > i
    if same_length:
        mask |= j <= i - window
    return mask  # [T, K]


def _padding_mask(mask: Tensor | None, padded: Tensor, T: int, mlen: int) -> Tensor:
    """The causal ``mask`` ([T, K] or None) with padding keys (``padded`` [B, K]) masked too: [B, 1, T, K]. A padding
    query still sees the keys before it, so that no softmax row is empty (its output is never used)."""
    causal = mask if mask is not None else causal_mask(T, mlen, False, 0, device=padded.device)
    return (causal | (padded[:, None, :] & ~padded[:, -T:, None]))[:, None]  # [B, 1, T, K]


def mask_scores(score: Tensor, mask: Tensor, inplace: bool = False) -> Tensor:
    """-inf where ``mask`` is True, added as a bias: a vectorized broadcast add (masked_fill with a broadcast mask
    is ~5x slower on the CPU) whose backward is the identity. The scores are the same, and so is the gradient: a
    masked entry's probability is exactly 0, so the softmax gives it exactly 0 gradient."""
    bias = torch.zeros(mask.shape, dtype=score.dtype, device=score.device).masked_fill_(mask, float("-inf"))
    return score.add_(bias) if inplace else score + bias


def mask_scores_(score: Tensor, mask: Tensor) -> Tensor:
    """:func:`mask_scores` in place, for inference: on the CPU only the columns from the first masked one on are
    touched (with the causal mask, the last T-1 columns)."""
    lo = 0
    # (elsewhere finding the column would wait for the device, or be a data-dependent shape in a graph)
    if mask.device.type == "cpu" and not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
        masked = mask.reshape(-1, mask.shape[-1]).any(0)  # [K]
        lo = int(masked.to(torch.uint8).argmax()) if bool(masked.any()) else mask.shape[-1]
    if lo < mask.shape[-1]:
        mask_scores(score[..., lo:], mask[..., lo:], inplace=True)
    return score


class _NativeDropout(torch.autograd.Function):
    """Dropout by :func:`txl.native.dropout`: the mask is regenerated from its seed in the backward, not stored."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: int) -> Tensor:
        ctx.p, ctx.seed = p, seed
        return native.dropout(x, p, seed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return native.dropout(grad, ctx.p, ctx.seed), None, None


def _relu_dropout_fused() -> bool:
    policy = backends()
    return policy.native_relu_dropout and policy.native_dropout


def dropout_seed() -> int:
    """The key of one native dropout mask: 63 random bits of torch's generator."""
    return int(torch.empty((), dtype=torch.int64).random_())


class _NativeReluDropout(torch.autograd.Function):
    """dropout(relu(x)) by one :func:`txl.native.dropout` pass (relu=True), and one backward pass from its output
    (which the next layer keeps anyway): the same values and gradient as relu then :class:`Dropout`, one pass less
    each way and one [.., d_inner] tensor less kept for the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: int) -> Tensor:
        y = native.dropout(x, p, seed, relu=True)
        ctx.save_for_backward(y)
        ctx.p = p
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return native.relu_dropout_backward(grad, ctx.saved_tensors[0], ctx.p), None, None


class Dropout(nn.Module):
    """``nn.Dropout`` with a cheaper mask on the CPU. Each call draws one 64-bit seed from torch's generator (so
    ``torch.manual_seed`` and a saved RNG state fix the masks) for :mod:`txl.native`'s one-pass kernel; without it,
    the mask takes two 24-bit uniforms (the resolution of ``torch.rand``) from every 64-bit random word of torch's
    generator, half the cost of ``nn.Dropout``'s one draw per element, for the same distribution. Elsewhere (other
    devices, other dtypes) it is ``F.dropout``. Kept elements are ``x * (1 / (1 - p))``, as in ``nn.Dropout``."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        if backends().native_dropout and native.dropout_applies(x):
            return _NativeDropout.apply(x, self.p, dropout_seed())
        n = x.numel()
        words = torch.empty((n + 1) // 2, dtype=torch.int64).random_()  # 63 random bits each
        uniform24 = words.view(torch.int32)[:n].bitwise_and(0xFFFFFF)  # two per word: bits 0-23 and 32-55
        keep = uniform24.ge(round(self.p * (1 << 24))).view(x.shape)
        return x.mul(keep).mul_(1.0 / (1.0 - self.p))

    def relu(self, x: Tensor) -> Tensor:
        """``self(F.relu(x))``: in one native pass where the native dropout runs (the same mask)."""
        if self.training and self.p > 0 and _relu_dropout_fused() and native.dropout_applies(x):
            return _NativeReluDropout.apply(x, self.p, dropout_seed())
        return self(F.relu(x))

    def extra_repr(self) -> str:
        return f"p={self.p}"


# ---------------------------------------------------------------------------------------------------------
# 4b. The linear layers' product, with a form for the few rows of generation (one token per step).
# ---------------------------------------------------------------------------------------------------------

SMALL_ROWS = 16
"""Products with at most this many rows take :func:`linear`'s transposed-weight form in CPU inference."""
SPLIT = 4
"""The input blocks of a product with one or two rows (bmm batch entries that the cores share)."""
_TRANSPOSED: dict[tuple, tuple[weakref.ref, tuple, Any]] = {}  # (id(weight), what) -> (the weight, its stamp, copy)
_SCOPES = [0]  # open transposed_weights() scopes
_SCOPE_LOCK = threading.Lock()


@contextlib.contextmanager
def transposed_weights() -> Iterator[None]:
    """Let :func:`linear` keep transposed copies of the weights, and the adaptive softmax packed copies of its output
    layers, while this is open (generation, serving and ``txl.evaluate`` open it: their weights do not change). The
    copies are dropped when the last scope closes, so training, whose weights change every step (also through
    ``.data``, which no version counter sees), never reads a stale one."""
    with _SCOPE_LOCK:
        _SCOPES[0] += 1
    try:
        yield
    finally:
        with _SCOPE_LOCK:
            _SCOPES[0] -= 1
            if _SCOPES[0] == 0:
                _TRANSPOSED.clear()


def _stamp(*tensors: Tensor) -> tuple:
    return tuple((t._version, t.data_ptr(), t.dtype) for t in tensors)


def _kept(weight: Tensor, what: Any, stamp: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, made once per :func:`transposed_weights` scope for (``weight``, ``what``) and remade when
    ``stamp`` (the versions and addresses of what it is made from) changes."""
    entry = _TRANSPOSED.get((id(weight), what))
    if entry is None or entry[0]() is not weight or entry[1] != stamp:
        entry = _TRANSPOSED[(id(weight), what)] = (weakref.ref(weight), stamp, make())
    return entry[2]


def _transposed(weight: Tensor) -> Tensor:
    """A contiguous [in, out] copy of ``weight``, made once per scope and remade when the weight changes in place or
    moves."""
    return _kept(weight, "t", _stamp(weight), lambda: weight.detach().t().contiguous())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: slice | None = None) -> Tensor:
    """``F.linear(x, weight[out], bias[out])``, with a faster product for the few rows of CPU inference (generation
    projects one token per step), inside :func:`transposed_weights`.

    With a handful of rows the product is a matrix-vector product, bound by reading the weight. The [out, in]
    layout makes it a dot product per output over a row of ``in`` values, which BLAS runs on one core and, for
    short rows, at a fraction of the memory bandwidth; from a transposed copy ([in, out], made once and kept
    until the weight changes) the same product is a sum of scaled rows of ``out`` values, and one row is split
    over the input dimension into ``SPLIT`` blocks that the cores share (2-3x per product on a 2-core EPYC,
    see docs/benchmarks.md). Weights with fewer outputs than inputs keep ``F.linear`` (long dot products, and no
    copy). The same value up to fp32 rounding (the additions are grouped differently). Training, autograd,
    autocast, other devices and more rows take ``F.linear``.
    """
    if not (_few_rows(x) and weight.shape[0] >= weight.shape[1] and x.dtype == weight.dtype):
        if out is not None:
            weight, bias = weight[out], None if bias is None else bias[out]
        return F.linear(x, weight, bias)
    wt = _transposed(weight)  # [in, out]
    if out is not None:
        wt, bias = wt[:, out], None if bias is None else bias[out]
    return _rows_product(x, wt, bias)


def _few_rows(x: Tensor) -> bool:
    """Whether products of ``x`` may take :func:`linear`'s transposed-weight form (CPU inference, few rows, inside
    :func:`transposed_weights`); the weight decides the rest (at least as many outputs as inputs, same dtype)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return bool(
        _SCOPES[0]
        and backends().transposed_weights
        and 0 < rows <= SMALL_ROWS
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and not torch.jit.is_tracing()
    )


def _rows_product(x: Tensor, wt: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ wt + bias`` for the few rows of ``x`` [..., in] from a transposed weight ``wt`` [in, out]."""
    k, n = wt.shape
    rows = x.numel() // k
    if rows <= 2 and k % SPLIT == 0:  # partial products over SPLIT blocks of the input, one per bmm batch entry
        blocks = x.reshape(SPLIT, 1, k // SPLIT) if rows == 1 else x.reshape(2, SPLIT, k // SPLIT).transpose(0, 1)
        y = torch.bmm(blocks, wt.view(SPLIT, k // SPLIT, n)).sum(0)  # [SPLIT, rows, n] -> [rows, n]
    else:
        y = torch.mm(x.reshape(rows, k), wt)  # [rows, n]
    if bias is not None:
        y = y.add_(bias)
    return y.view(*x.shape[:-1], n)


class _SegmentMemoryProjection(torch.autograd.Function):
    """Training's projections of one layer, ``q = x W_q^T`` for the segment and ``[k; v] = [mem; x] W_kv^T`` for
    [memory; segment], with one backward: the memory carries no gradient (it is detached), so the input gradient
    is computed for the segment's rows only (autograd would compute it for all K rows of the concatenation and drop
    M of them), as one product ``[g_q, g_kv of the segment] W``; the weight gradient is written straight into one
    [3HD, D] tensor (no zero-filled slice gradients to add). The same values up to fp32 rounding. Under autocast the
    products run in its dtype, as ``F.linear`` there."""

    @staticmethod
    def forward(ctx, mem: Tensor, x: Tensor, weight: Tensor, n_q: int) -> tuple[Tensor, Tensor]:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        w, xs = weight.to(dtype), x.to(dtype)  # [3HD, D], [B, T, D]
        xc = torch.cat([mem.to(dtype), xs], dim=1)  # [B, K, D]
        with torch.autocast(x.device.type, enabled=False):
            q = F.linear(xs, w[:n_q])  # [B, T, HD]
            kv = F.linear(xc, w[n_q:])  # [B, K, 2HD]
        ctx.save_for_backward(xs, xc, w)
        ctx.n_q, ctx.dtypes = n_q, (x.dtype, weight.dtype)
        return q, kv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_q: Tensor, g_kv: Tensor) -> tuple[None, Tensor, Tensor, None]:
        xs, xc, w = ctx.saved_tensors
        n_q, (x_dtype, w_dtype) = ctx.n_q, ctx.dtypes
        (B, T, D), K = xs.shape, xc.shape[1]
        g_q, g_kv = g_q.to(w.dtype), g_kv.to(w.dtype)
        g_x = g_w = None
        if ctx.needs_input_grad[2]:
            g_w = w.new_empty(w.shape)  # [3HD, D]
            torch.mm(g_q.reshape(B * T, n_q).t(), xs.reshape(B * T, D), out=g_w[:n_q])
            torch.mm(g_kv.reshape(B * K, -1).t(), xc.reshape(B * K, D), out=g_w[n_q:])
            g_w = g_w.to(w_dtype)
        if ctx.needs_input_grad[1]:
            g_seg = torch.cat([g_q, g_kv[:, K - T :]], dim=-1)  # [B, T, 3HD]
            g_x = torch.mm(g_seg.view(B * T, -1), w).view(B, T, D).to(x_dtype)  # [B, T, D]
        return None, g_x, g_w, None


# ---------------------------------------------------------------------------------------------------------
# 5. Relative multi-head attention (Sec. 3.3, Eq. for A^rel):
#      A_ij = (a) q_i.k_j + (b) q_i.W_kR R_{i-j} + (c) u.k_j + (d) v.W_kR R_{i-j}
#           = (q_i + u).k_j  +  (q_i + v).W_kR R_{i-j}
#    so (a)+(c) is one matmul with q + u (r_w_bias) and (b)+(d) one matmul with q + v (r_r_bias) against the
#    projected positions, followed by the shift. Queries are projected for the T current rows only; keys and
#    values for [memory; segment].
#    What every attention variant shares (projections, attend, residual) is in ``_Attention``; a variant only says
#    how positions enter (section 10 has the ablation's: attn_type 1, 2 and 3). Each variant builds its own
#    positional inputs once per forward (``prepare``), so the model's forward has no branch per variant.
# ---------------------------------------------------------------------------------------------------------


class _Attention(nn.Module):
    """Multi-head attention over [memory; segment] without the positional terms: QKV and output projections,
    post-LN (or pre-LN), dropouts, and the attend step."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.n_head, self.d_head = cfg.n_head, cfg.d_head
        hd = cfg.n_head * cfg.d_head
        self.qkv_net = nn.Linear(cfg.d_model, 3 * hd, bias=False)  # rows [W_q; W_kE; W_v]
        self.o_net = nn.Linear(hd, cfg.d_model, bias=False)
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)
        self.drop = Dropout(cfg.dropout)
        self.dropatt = Dropout(cfg.dropatt)
        self.pre_lnorm = cfg.pre_lnorm
        self.scale = 1.0 / math.sqrt(cfg.d_head)

    def project(
        self, h: Tensor, mem: Tensor | None, cache: KVCache | None, layer: int, pos: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | tuple[Tensor, Tensor]]:
        """Queries [B, T, H, Dh] of the segment, keys and values [B, H, K, Dh] of [memory; segment] (with a
        ``cache``: the cached ones of ``layer`` plus the segment's). ``pos`` [K, D] (absolute variants) is added to
        [memory; segment] first. Returns (the residual input [B, T, D], q, kv): kv is the keys and values as one
        [2, B, H, K, Dh] view of the projection's output, or (k, v) from a cache."""
        B, T, _ = h.shape
        H, Dh = self.n_head, self.d_head
        if pos is not None:  # absolute positions of [memory; segment], added out of place (the memory stays clean)
            h = h + pos[-T:]
            mem = mem + pos[: mem.shape[1]] if mem is not None else None
        x = self.layer_norm(h) if self.pre_lnorm else h
        if cache is not None or mem is None or mem.shape[1] == 0:  # keys and values come from the segment only
            qkv = linear(x, self.qkv_net.weight)  # [B, T, 3*H*Dh]: one GEMM
            q, kv = qkv[..., : H * Dh].view(B, T, H, Dh), qkv[..., H * Dh :]
            kv = kv.view(B, T, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, T, Dh]
            kv = cache.append(layer, *kv) if cache is not None else kv  # [B, H, K, Dh] each
        else:
            mem = self.layer_norm(mem) if self.pre_lnorm else mem  # [B, M, D]
            K = mem.shape[1] + T
            if backends().segment_projection and torch.is_grad_enabled() and x.requires_grad and not mem.requires_grad:
                q, kv = _SegmentMemoryProjection.apply(mem, x, self.qkv_net.weight, H * Dh)  # [B, T, HD], [B, K, 2HD]
            else:
                q = linear(x, self.qkv_net.weight, out=slice(0, H * Dh))  # queries of the segment only, [B, T, HD]
                kv = linear(torch.cat([mem, x], dim=1), self.qkv_net.weight, out=slice(H * Dh, None))  # [B, K, 2HD]
            q = q.view(B, T, H, Dh)
            kv = kv.view(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, K, Dh]
        return h, q, kv

    def memory_keys_values(self, mem: Tensor) -> Tensor:
        """The keys and values [2, B, H, M, Dh] of a memory of layer inputs ``mem`` [B, M, D] (to fill a cache):
        what :meth:`project` computes for the memory's positions."""
        B, M, _ = mem.shape
        H, Dh = self.n_head, self.d_head
        x = self.layer_norm(mem) if self.pre_lnorm else mem
        kv = linear(x, self.qkv_net.weight, out=slice(H * Dh, None))  # [B, M, 2HD]
        return kv.view(B, M, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, M, Dh]

    def forward(
        self,
        h: Tensor,
        pos: Any,
        mask: Tensor | None,
        mem: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        """The common call of every variant. ``h`` [B, T, D] segment, ``pos`` this layer's positional input (from the
        variant's ``prepare``), ``mask`` [T, K] or [B, 1, T, K] (True = masked; None: nothing is masked), ``mem``
        [B, M, D] memory; with a ``cache`` the memory is the cached keys/values of ``layer`` (only the segment is
        projected; ``mem`` is not used).

        Returns the layer output [B, T, D] and the attention probabilities [B, H, T, K] when ``need_weights``.
        """
        h, q, kv = self.project(h, mem, cache, layer, self.input_positions(pos))
        dropatt = self.dropatt.p if self.training else 0.0
        if backends().native_attention and not need_weights and native.usable(q):
            attn_vec = self.native_attention(q, pos, kv, mask, torch.is_grad_enabled(), dropatt)  # [B, T, H*Dh]
            if attn_vec is not None:
                return self.output(h, attn_vec), None
        k, v = kv  # [B, H, K, Dh] each
        q_w, bd = self.scores(q, pos, k.shape[2])
        return self.attend(h, q_w, k, v, bd, mask, need_weights)

    def native_attention(
        self,
        q: Tensor,
        pos: Any,
        kv: Tensor | tuple[Tensor, Tensor],
        mask: Tensor | None,
        grad: bool = False,
        dropatt: float = 0.0,
    ) -> Tensor | None:
        """The attention as one native call (:func:`txl.native.attention`; with ``grad``, one that keeps what its
        native backward needs), [B, T, H*Dh]; ``kv`` as :meth:`project` returns it; ``dropatt``: the dropout of the
        probabilities (with ``grad`` only). None: not for this variant or these operands."""
        return None

    def input_positions(self, pos: Any) -> Tensor | None:
        """Positions added to the layer input [memory; segment] ([K, D]; None: none, the relative variants)."""
        return None

    def scores(self, q: Tensor, pos: Any, K: int) -> tuple[Tensor, Tensor | None]:
        """The scaled queries of the content term [B, H, T, Dh] and the positional term in key order [B, H, T, K]
        (None: there is none)."""
        raise NotImplementedError

    def attend(
        self, h: Tensor, q_w: Tensor, k: Tensor, v: Tensor, bd: Tensor | None, mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """softmax(q_w.k + bd) v, projected and added to the residual ``h`` [B, T, D]. ``q_w`` [B, H, T, Dh] are the
        scaled queries of the content term, ``bd`` [B, H, T, K] the positional term in key order (None: there is
        none), ``mask`` [T, K] or [B, 1, T, K] (True = masked, None = nothing is)."""
        B, T, _ = h.shape
        grad = torch.is_grad_enabled() and q_w.requires_grad
        dropping = self.training and self.dropatt.p > 0
        fused = (  # (training as one SDPA call: Backends.sdpa_training_devices)
            grad
            and q_w.device.type in backends().sdpa_training_devices
            and not torch.is_autocast_enabled(q_w.device.type)
        )
        if need_weights or dropping or (grad and not fused):
            ac = torch.matmul(q_w, k.transpose(-1, -2))  # (a)+(c), [B, H, T, K]
            if not backends().half_precision_scores:
                ac = _fp32(ac)
            score = ac if bd is None else ac.add_(bd)  # [B, H, T, K]
            if mask is not None:
                score = mask_scores(score, mask, inplace=True)
            prob = self.dropatt(score.softmax(dim=-1).to(v.dtype))  # [B, H, T, K]
            attn_vec = torch.matmul(prob, v)  # [B, H, T, Dh]
        else:
            # Inference (and training where fused): the shifted (b)+(d) term and the mask as SDPA's additive bias.
            if bd is None:
                bias = None if mask is None else mask_scores(q_w.new_zeros(mask.shape, dtype=torch.float32), mask)
            elif mask is None:
                bias = bd
            elif not grad and bd.stride(-2) >= bd.shape[-1]:  # (no overlap: the shift of a padded row, or no shift)
                bias = mask_scores_(bd, mask)  # [B, H, T, K], in place
            else:
                bias = mask_scores(bd, mask)  # [B, H, T, K]
            bias = None if bias is None else bias.to(q_w.dtype)
            attn_vec = F.scaled_dot_product_attention(q_w, k, v, attn_mask=bias, scale=1.0)
            prob = None
        return self.output(h, attn_vec.transpose(1, 2).reshape(B, T, -1)), prob

    def output(self, h: Tensor, attn_vec: Tensor) -> Tensor:
        """W_o of the heads' values ``attn_vec`` [B, T, H*Dh], added to the residual ``h`` (then the layer norm
        unless pre-LN)."""
        attn_out = self.drop(linear(attn_vec, self.o_net.weight))  # [B, T, D]
        return h + attn_out if self.pre_lnorm else self.layer_norm(h + attn_out)


class RelPositions(NamedTuple):
    """attn_type 0's positional input of one layer: R ([K, D], dropped out) or W_kR R already projected
    (``r_k`` [H, Dh, K + SHIFT_ALIGN], from a cache), and the biases u, v ([H, Dh])."""

    pos_emb: Tensor | None
    r_k: Tensor | None
    u: Tensor
    v: Tensor


class _NativeRelAttention(torch.autograd.Function):
    """attn_type 0's attention with gradients, natively (fp32 on the CPU): the forward is the inference kernel that
    also keeps the probabilities [B, H, T, K], the backward (:func:`txl.native.attention_backward`) the softmax's and
    the five products' gradients with the shift undone in place, computing only the keys each block of queries sees
    (no [B, H, T, K] scores, shifted copies or zero-filled buffers). ``drop`` (p, seed): dropatt, the mask that
    :class:`Dropout` draws for that seed (regenerated in the backward). The same values as scores() + attend() up to
    fp32 rounding; ``use_backends(native_attention=False)`` gives the PyTorch kernels."""

    @staticmethod
    def forward(
        ctx, q: Tensor, u: Tensor, v: Tensor, kv: Tensor, r_k: Tensor, mask: Tensor | None, drop: tuple | None, scale
    ):
        qt = q.transpose(1, 2)  # [B, H, T, Dh], raw: the kernel forms (q + u) * scale and (q + v) * scale
        out, prob = native.attention_train(qt, kv[0], kv[1], qt, r_k, mask, drop, (u, v, scale))  # [B, T, H*Dh]
        ctx.save_for_backward(q, u, v, kv, r_k, prob)  # (prob [B, H, T, K])
        ctx.drop, ctx.scale = drop, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple:
        q, u, v, kv, r_k, prob = ctx.saved_tensors
        qt = q.transpose(1, 2)
        g_u, g_v, dkv, dr = native.attention_backward(
            qt, kv[0], kv[1], qt, r_k, prob, grad, ctx.drop, (u, v, ctx.scale)
        )
        # g_u, g_v [B, T, H, Dh]: the gradients of q + u and q + v, as autograd's of the two sums
        du = g_u.sum((0, 1)) if ctx.needs_input_grad[1] else None  # [H, Dh]
        dv = g_v.sum((0, 1)) if ctx.needs_input_grad[2] else None
        return g_u + g_v, du, dv, dkv, dr, None, None, None


class RelPartialLearnableMultiHeadAttn(_Attention):
    """attn_type 0: the Transformer-XL relative attention."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)  # W_kR

    @staticmethod
    def biases(model: TransformerXL) -> list[tuple[Tensor, Tensor]]:
        """Each layer's u, v ([H, Dh] each): the model's, shared by the layers, or one per layer (untie_r)."""
        u, v = model.r_w_bias, model.r_r_bias  # [H, Dh], or [n_layer, H, Dh] (untie_r)
        return (
            list(zip(u.unbind(0), v.unbind(0), strict=True)) if model.config.untie_r else [(u, v)] * len(model.layers)
        )

    @staticmethod
    def prepare(model: TransformerXL, K: int, clamp_len: int, dtype, device, cache: KVCache | None) -> list:
        """R for the distances K-1, ..., 0 (shared by all layers) and each layer's u, v; with a ``cache``, W_kR R
        of every layer, projected once for the longest span."""
        cfg = model.config
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        biases = RelPartialLearnableMultiHeadAttn.biases(model)
        if cache is None:
            pos_emb = sinusoid_embedding(K, cfg.d_model, clamp_len, device, exact)  # [K, D]
            pos_emb = model.drop(pos_emb.to(dtype))
            return [RelPositions(pos_emb, None, u, v) for u, v in biases]

        def table(attn: RelPartialLearnableMultiHeadAttn) -> Callable[[int], Tensor]:
            def project(n: int) -> Tensor:  # W_kR R for the distances n-1, ..., 0, as [H, Dh, n]
                pos = sinusoid_embedding(n, cfg.d_model, clamp_len, device, exact).to(dtype)  # [n, D]
                return torch.mm(attn.r_net.weight, pos.t()).view(attn.n_head, attn.d_head, n)

            return project

        key = (clamp_len, dtype)
        return [
            RelPositions(None, cache.positions(i, K, key, table(layer.attn)), u, v)
            for i, (layer, (u, v)) in enumerate(zip(model.layers, biases, strict=True))
        ]

    def _terms(self, q: Tensor, pos: RelPositions, K: int) -> tuple[Tensor, Tensor, Tensor]:
        """The queries of (a)+(c) and of (b)+(d), (q + u) / sqrt(Dh) and (q + v) / sqrt(Dh) ([B, T, H, Dh] each:
        the 1/sqrt(Dh) of the scores is applied to the T x Dh queries, not the T x K scores), and W_kR R."""
        return (q + pos.u) * self.scale, (q + pos.v) * self.scale, self._positions(pos, K)

    def _positions(self, pos: RelPositions, K: int) -> Tensor:
        """W_kR R for the distances K-1..0 ([H, Dh, >= K]; a cache's has zero columns after them)."""
        if pos.r_k is not None:
            return pos.r_k
        return torch.mm(self.r_net.weight, pos.pos_emb.t()).view(self.n_head, self.d_head, K)

    def native_attention(
        self,
        q: Tensor,
        pos: RelPositions,
        kv: Tensor | tuple[Tensor, Tensor],
        mask: Tensor | None,
        grad: bool = False,
        dropatt: float = 0.0,
    ) -> Tensor | None:
        # The same terms as scores() + attend(), with the (b)+(d) rows read at their shift inside the kernel; the
        # dropout of the probabilities draws its seed where attend() would, and is the mask Dropout would draw.
        if dropatt and not (grad and backends().native_dropout):
            return None
        # The kernels take the raw queries and form (q + u) / sqrt(Dh) and (q + v) / sqrt(Dh) as _terms() does.
        k, v = kv
        r_k = self._positions(pos, k.shape[2])
        qt, biases = q.transpose(1, 2), (pos.u, pos.v, self.scale)  # [B, H, T, Dh]
        if not native.attention_applies(qt, k, v, qt, r_k, query_bias=biases):
            return None
        if not grad:
            return native.attention(qt, k, v, qv=qt, r=r_k, mask=mask, query_bias=biases)
        if not isinstance(kv, Tensor):  # (a cache's keys and values, with gradients: the PyTorch kernels)
            return None
        drop = (dropatt, dropout_seed()) if dropatt else None
        return _NativeRelAttention.apply(q, pos.u, pos.v, kv, r_k, mask, drop, self.scale)

    def scores(self, q: Tensor, pos: RelPositions, K: int) -> tuple[Tensor, Tensor]:
        B, T, H, Dh = q.shape
        q_u, q_v, r_k = self._terms(q, pos, K)
        W = K  # the raw rows' width: in inference, padded (see shift_padding)
        if T > 1 and not torch.is_grad_enabled() and not torch.compiler.is_exporting():
            W = K + shift_padding(K)
            if r_k.shape[-1] < W:  # (a cache's table has the zero columns already)
                r_k = F.pad(r_k[..., :K], (0, W - K))
        r_k = r_k[..., :W]  # [H, Dh, W]: the layout of the (b)+(d) GEMM
        q_w = q_u.transpose(1, 2)  # [B, H, T, Dh]
        q_r = q_v.permute(2, 0, 1, 3).reshape(H, B * T, Dh)
        bd = torch.bmm(q_r, r_k).view(H, B, T, W).transpose(0, 1)  # (b)+(d) by distance, [B, H, T, W]
        if T > 1:  # (a single query, the newest, needs no shift: its row is already in key order)
            bd = rel_shift(bd, K)  # (b)+(d) by key, [B, H, T, K]
        return q_w, bd


# ---------------------------------------------------------------------------------------------------------
# 6. Position-wise feed-forward and the layer.
# ---------------------------------------------------------------------------------------------------------


class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.layer_1 = nn.Linear(cfg.d_model, cfg.d_inner)
        self.layer_2 = nn.Linear(cfg.d_inner, cfg.d_model)
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)
        self.drop = Dropout(cfg.dropout)
        self.pre_lnorm = cfg.pre_lnorm

    def forward(self, h: Tensor) -> Tensor:
        x = self.layer_norm(h) if self.pre_lnorm else h
        y = self.drop.relu(linear(x, self.layer_1.weight, self.layer_1.bias))  # relu, dropout: [B, T, d_inner]
        y = self.drop(linear(y, self.layer_2.weight, self.layer_2.bias))  # [B, T, D]
        return h + y if self.pre_lnorm else self.layer_norm(h + y)


class TransformerXLLayer(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.attn = attention_class(cfg.attn_type)(cfg)
        self.ff = PositionwiseFF(cfg)

    def forward(self, h: Tensor, pos: Any, mask: Tensor | None, **kw) -> tuple[Tensor, Tensor | None]:
        out, prob = self.attn(h, pos, mask, **kw)
        return self.ff(out), prob


# ---------------------------------------------------------------------------------------------------------
# 7. Adaptive input (Baevski & Auli) and projected adaptive log-softmax (Grave et al.).
#    Cluster i covers token ids [ends[i], ends[i+1]) with ends = [0, *cutoffs, n_token]; its width is
#    d_embed // div_val**i. With div_val == 1 there is one table (and one projection iff d_embed != d_model).
# ---------------------------------------------------------------------------------------------------------


def _fp32(x: Tensor) -> Tensor:
    """At least fp32 (half-precision tensors are upcast; fp64 stays fp64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _cluster_dims(cfg: TransformerXLConfig) -> list[int]:
    if cfg.div_val == 1:
        return [cfg.d_embed]
    return [cfg.d_embed // cfg.div_val**i for i in range(cfg.n_clusters + 1)]


def _has_projs(cfg: TransformerXLConfig) -> bool:
    return cfg.div_val > 1 or cfg.d_embed != cfg.d_model


class AdaptiveEmbedding(nn.Module):
    def __init__(self, cfg: TransformerXLConfig, *, init: bool = True):
        super().__init__()
        self.ends = [0, *cfg.cutoffs, cfg.n_token]
        self.div_val = cfg.div_val
        self.emb_scale = cfg.d_model**0.5
        dims = _cluster_dims(cfg)
        sizes = (
            [cfg.n_token] if cfg.div_val == 1 else [r - l for l, r in zip(self.ends[:-1], self.ends[1:], strict=True)]
        )
        # without init (weights about to be loaded) the tables are left empty: nn.Embedding's own normal_ would
        # take seconds on the meta device for a WikiText-103-size vocabulary
        self.emb_layers = nn.ModuleList(
            [
                nn.Embedding(n, d) if init else nn.Embedding(n, d, _weight=torch.empty(n, d))
                for n, d in zip(sizes, dims, strict=True)
            ]
        )
        n_proj = len(self.emb_layers) if _has_projs(cfg) else 0
        self.emb_projs = nn.ParameterList(
            [nn.Parameter(torch.empty(cfg.d_model, self.emb_layers[i].embedding_dim)) for i in range(n_proj)]
        )

    def _project(self, i: int, x: Tensor) -> Tensor:
        return F.linear(x, self.emb_projs[i]) if len(self.emb_projs) else x

    def forward(self, input_ids: Tensor) -> Tensor:  # [B, T] -> [B, T, d_model]
        if self.div_val == 1:
            return self._project(0, self.emb_layers[0](input_ids)) * self.emb_scale
        # Every cluster embeds every token at a clamped index and the right cluster is selected with where:
        # no data-dependent shapes, no host sync, dtype-consistent under autocast.
        out = None
        for i, (l, r) in enumerate(zip(self.ends[:-1], self.ends[1:], strict=True)):
            emb_i = self._project(i, self.emb_layers[i]((input_ids - l).clamp(0, r - l - 1)))  # [B, T, D]
            in_i = ((input_ids >= l) & (input_ids < r)).unsqueeze(-1)
            out = emb_i if out is None else torch.where(in_i, emb_i, out)
        return out * self.emb_scale


HEAD_ALIGN = 8
"""The adaptive softmax's head (shortlist + one logit per cluster) gets zero weight rows with a -inf bias up to a
multiple of this many columns: they take no probability (exp(-inf) = 0), and the head's product is faster (the
bench-word head of 4,002 columns: 18.7 ms as 4,002, 13.6 ms as 4,008 here). 0: no padding."""


class _SoftmaxNLL(torch.autograd.Function):
    """-log_softmax(x)[i, t_i] per row by :func:`txl.native.nll` (0 where t_i < 0); the backward is
    g_i (softmax(x_i) - onehot(t_i)), from the logits and each row's log-sum-exp."""

    @staticmethod
    def forward(ctx, x: Tensor, target: Tensor) -> Tensor:  # [N, V], [N] -> [N]
        nll, lse = native.nll(x, target)
        ctx.save_for_backward(x, target, lse)
        return nll

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        x, target, lse = ctx.saved_tensors
        return native.nll_backward(x, target, lse, grad), None


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """log p(token | h). Head = shortlist tokens + one logit per tail cluster (tail i <-> head column
    cutoffs[0] + i - 1, the Hugging Face order; then -inf columns up to a multiple of ``HEAD_ALIGN``); log p(tail
    token) = head log-prob of its cluster + tail log-prob. Always computed in fp32."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.n_token = cfg.n_token
        self.ends = [0, *cfg.cutoffs, cfg.n_token]
        self.shortlist = self.ends[1]
        self.n_clusters = cfg.n_clusters
        self.div_val = cfg.div_val
        dims = _cluster_dims(cfg)
        if cfg.n_clusters > 0:
            self.cluster_weight = nn.Parameter(torch.empty(cfg.n_clusters, cfg.d_embed))
            self.cluster_bias = nn.Parameter(torch.empty(cfg.n_clusters))
        if cfg.div_val == 1:
            self.out_layers = nn.ModuleList([nn.Linear(cfg.d_embed, cfg.n_token)])
            proj_dims = [cfg.d_embed] * (cfg.n_clusters + 1) if _has_projs(cfg) else []
        else:
            sizes = [r - l for l, r in zip(self.ends[:-1], self.ends[1:], strict=True)]
            self.out_layers = nn.ModuleList([nn.Linear(d, n) for d, n in zip(dims, sizes, strict=True)])
            proj_dims = dims
        self.out_projs = nn.ParameterList([nn.Parameter(torch.empty(cfg.d_model, d)) for d in proj_dims])

    def _cluster_params(self, i: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Weight [n_i, d_i], bias [n_i] and projection [d_model, d_i] (or None) of cluster i, fp32."""
        if self.div_val == 1:
            l, r = self.ends[i], self.ends[i + 1]
            out = self.out_layers[0]
            w, b = (out.weight, out.bias) if r - l == self.n_token else (out.weight[l:r], out.bias[l:r])
        else:
            w, b = self.out_layers[i].weight, self.out_layers[i].bias
        if i == 0 and self.n_clusters > 0:
            pad = -(w.shape[0] + self.n_clusters) % HEAD_ALIGN if HEAD_ALIGN else 0
            w = torch.cat([w, self.cluster_weight, w.new_zeros(pad, w.shape[1])], dim=0)
            b = torch.cat([b, self.cluster_bias, b.new_full((pad,), float("-inf"))], dim=0)
        proj = _fp32(self.out_projs[i]) if len(self.out_projs) else None
        return _fp32(w), _fp32(b), proj

    def _project(self, h: Tensor, i: int) -> Tensor:
        """``h`` [N, d_model] in cluster i's input width, [N, d_i]."""
        return h @ _fp32(self.out_projs[i]) if len(self.out_projs) else h

    def _logits(self, h: Tensor, i: int, projected: bool = False) -> Tensor:
        w, b, _ = self._cluster_params(i)
        return F.linear(h if projected else self._project(h, i), w, b)  # [N, n_i (+ clusters, padding: head)]

    def _log_softmax(self, h: Tensor, i: int) -> Tensor:
        return F.log_softmax(self._logits(h, i), dim=-1)

    def forward(self, hidden: Tensor, targets: Tensor | None = None, return_log_probs: bool = False):
        """``hidden`` [N, d_model], ``targets`` [N] (-100 = ignore).

        Returns (per-token NLL [N] in input order (0 where ignored) or None, log-probs [N, V] or None).
        """
        autocast = torch.is_autocast_enabled(hidden.device.type)
        with torch.autocast(hidden.device.type, enabled=False) if autocast else contextlib.nullcontext():
            h = _fp32(hidden)
            if targets is not None and not return_log_probs and backends().native_nll and native.nll_applies(h):
                return self._nll_native(h, targets), None
            head = self._log_softmax(h, 0)  # [N, shortlist + n_clusters (+ -inf columns up to HEAD_ALIGN)]
            nll = log_probs = None
            if return_log_probs and self.n_clusters == 0:
                log_probs = head  # [N, V]
            elif return_log_probs:
                parts = [head[:, : self.shortlist]]
                for i in range(1, self.n_clusters + 1):
                    parts.append(head[:, self.shortlist + i - 1, None] + self._log_softmax(h, i))
                log_probs = torch.cat(parts, dim=-1)  # [N, V]
            if targets is not None:
                nll = self._nll(h, head, log_probs, targets)
        return nll, log_probs

    def _check(self, targets: Tensor) -> Tensor:
        """``targets != -100``, after checking that the others are token ids."""
        valid = targets != -100
        if (((targets < 0) & valid) | (targets >= self.n_token)).any():
            raise ValueError(f"targets must be in [0, {self.n_token}) or -100 (ignored)")
        return valid

    def _nll_native(self, h: Tensor, targets: Tensor) -> Tensor:
        """``_nll`` with each cluster's loss from :mod:`txl.native` (``_cluster_nll``: no log-softmax tensor): a
        token's head term reads its own column, or its cluster's for a tail token."""
        valid = self._check(targets)
        col = targets.where(valid, -1)  # [N] head column of each token (-1: ignored)
        tails = []
        for i in range(1, self.n_clusters + 1):
            l, r = self.ends[i], self.ends[i + 1]
            idx = ((targets >= l) & (targets < r)).nonzero().squeeze(1)
            if idx.numel():
                col = col.index_fill(0, idx, self.shortlist + i - 1)
                tails.append((i, idx, targets[idx] - l))
        nll = self._cluster_nll(h, 0, col)  # [N]
        for i, idx, t in tails:
            nll = nll.index_add(0, idx, self._cluster_nll(h.index_select(0, idx), i, t))
        return nll

    def _cluster_nll(self, h: Tensor, i: int, target: Tensor) -> Tensor:
        """Cluster i's NLL of ``target`` [n] for the rows ``h`` [n, d_model]. Without a gradient, inside
        :func:`transposed_weights` (``txl.evaluate``): :func:`txl.native.nll_linear` on the cluster's packed output
        layer, no logits stored; otherwise from the logits (:class:`_SoftmaxNLL`)."""
        hp = self._project(h, i)  # [n, d_i]
        if _SCOPES[0] and not torch.is_grad_enabled() and hp.shape[1] <= native.LINEAR_MAX_DIM:
            return native.nll_linear(hp, self._packed(i), target)  # (h is fp32 on the CPU: _nll_native's caller)
        return _SoftmaxNLL.apply(self._logits(hp, i, projected=True), target)

    def _packed(self, i: int) -> tuple[Tensor, Tensor]:
        """Cluster i's weight and bias as :func:`txl.native.pack_linear` packs them, kept for the scope."""
        layer = self.out_layers[0 if self.div_val == 1 else i]
        sources = [layer.weight, layer.bias]
        if i == 0 and self.n_clusters > 0:
            sources += [self.cluster_weight, self.cluster_bias]
        stamp = (*_stamp(*sources), HEAD_ALIGN)
        pack = lambda: native.pack_linear(*self._cluster_params(i)[:2])  # noqa: E731
        return _kept(layer.weight, ("crit", id(self), i), stamp, pack)

    def _nll(self, h: Tensor, head: Tensor, log_probs: Tensor | None, targets: Tensor) -> Tensor:
        valid = self._check(targets)
        t = targets.where(valid, 0)
        if log_probs is not None:
            return -log_probs.gather(1, t[:, None]).squeeze(1) * valid
        # Head tokens read the head directly; a tail cluster's logits are computed only for its own targets.
        lp = head.gather(1, t.clamp(max=self.shortlist - 1)[:, None]).squeeze(1)  # [N]
        for i in range(1, self.n_clusters + 1):
            l, r = self.ends[i], self.ends[i + 1]
            idx = ((t >= l) & (t < r)).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            tail = self._log_softmax(h.index_select(0, idx), i)  # [n_i, r - l]
            lp_i = head[idx, self.shortlist + i - 1] + tail.gather(1, (t[idx] - l)[:, None]).squeeze(1)
            lp = lp.index_copy(0, idx, lp_i)  # stays in input order
        return -lp * valid


# ---------------------------------------------------------------------------------------------------------
# 8. The model: embedding, layers, and the segment-level recurrence (Sec. 3.2).
#      h_{tau+1}^{n-1} ~ [SG(m_tau^{n-1}) ; h_{tau+1}^{n-1}]   (memory = stop-gradient of cached layer inputs)
# ---------------------------------------------------------------------------------------------------------


class _DecodeLayer(NamedTuple):
    """One layer's weights as ``TransformerXL._decode`` reads them (the tensors themselves: changes in place are
    seen), and its attention (for the scores). ``norm1``/``norm2``: the arguments of ``F.layer_norm`` after the
    input."""

    attn: RelPartialLearnableMultiHeadAttn
    qkv: Tensor
    o: Tensor
    norm1: tuple
    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor
    norm2: tuple
    pre_lnorm: bool

    @classmethod
    def of(cls, layer: TransformerXLLayer) -> _DecodeLayer:
        attn, ff = layer.attn, layer.ff

        def norm(ln: nn.LayerNorm) -> tuple:
            return ln.normalized_shape, ln.weight, ln.bias, ln.eps

        return cls(
            attn, attn.qkv_net.weight, attn.o_net.weight, norm(attn.layer_norm), ff.layer_1.weight, ff.layer_1.bias,
            ff.layer_2.weight, ff.layer_2.bias, norm(ff.layer_norm), attn.pre_lnorm,
        )  # fmt: skip

    def after_attention(self, h: Tensor, vec: Tensor, product: Callable = F.linear) -> Tensor:
        """The rest of the layer for one position per row: W_o of the heads' values ``vec`` [B, H, 1, Dh], the
        residual and norm, the feed-forward, the residual and norm; ``h`` [B, 1, D] is the layer's input."""
        B, H, _, Dh = vec.shape
        out = product(vec.transpose(1, 2).reshape(B, 1, H * Dh), self.o)  # [B, 1, D]
        h = h + out if self.pre_lnorm else F.layer_norm(h + out, *self.norm1)
        x = F.layer_norm(h, *self.norm2) if self.pre_lnorm else h
        y = product(F.relu(product(x, self.w1, self.b1)), self.w2, self.b2)  # [B, 1, D]
        return h + y if self.pre_lnorm else F.layer_norm(h + y, *self.norm2)


class KVCache:
    """The memory of every layer as its projected keys and values, for inference (evaluation and generation).

    In the uncached model a segment projects keys/values for [memory; segment] (M + T positions), although the
    memory's were already computed when it was the current segment, with the same weights. The cache keeps them:
    a call projects only its T positions, appends them, attends over the window, and the window slides to the last
    ``mem_len`` positions, which is what ``TransformerXL._update_mems`` keeps. W_kR R is projected once per layer for
    the longest span. Keys stay in time order in one buffer per layer (``[n_layer, B, H, capacity, Dh]``); when its
    end is reached the window is copied to the front once (every ``capacity - mem_len`` positions), so a generated
    token costs no concatenation of the whole memory. Positions can be marked as padding (left-padded prompts of
    different lengths): they are never attended to. For fixed weights only: a model that trains must not reuse it.
    """

    def __init__(self, config: TransformerXLConfig, batch_size: int, mem_len: int, max_segment: int = 1, **kw):
        if not supports_kv_cache(config):
            raise ValueError(
                f"attn_type {config.attn_type} has absolute positions, which move as the window slides: its keys "
                "cannot be cached (evaluate without a cache; generation recomputes the memory)"
            )
        self.config = config
        self.capacity = max(2 * (mem_len + max_segment), 16)
        shape = (config.n_layer, batch_size, config.n_head, self.capacity, config.d_head)
        # (zeroed now: the pages are touched once here, not on the first pass of the window, where each segment's
        # write would fault them in one by one)
        self.k = torch.zeros(shape, **kw)
        self.v = torch.zeros(shape, **kw)
        self.padding = torch.zeros(batch_size, self.capacity, dtype=torch.bool, device=self.k.device)
        self.padded = False  # whether any position ever written was padding
        self.start = self.end = 0  # the memory is positions [start, end) of the buffer
        self._r_k: list[Tensor | None] = [None] * config.n_layer
        self._r_key: tuple | None = None
        self._r_view: list[tuple | None] = [None] * config.n_layer  # (K, table, its view for K) of the last call
        self.decode_plan: tuple | None = None  # (the model, its layers' _DecodeLayer, the native kernel's state)

    @property
    def length(self) -> int:
        """Number of positions in the memory."""
        return self.end - self.start

    def begin(self, T: int, padding: Tensor | None = None) -> Tensor | None:
        """Make room for a segment of T positions (``padding`` [B, T]: True where a position is padding); return the
        padding of the window [B, M + T] if any position in it is padding."""
        if self.end + T > self.capacity:
            n = self.length
            if n + T > self.capacity:  # a longer segment than planned: grow
                self.capacity = 2 * (n + T)
                grown = (*self.k.shape[:3], self.capacity, self.k.shape[4])
                self.k = torch.cat([self.k[:, :, :, self.start : self.end], self.k.new_empty(grown)], dim=3)
                self.v = torch.cat([self.v[:, :, :, self.start : self.end], self.v.new_empty(grown)], dim=3)
                pad = self.padding.new_zeros(self.padding.shape[0], self.capacity)
                pad[:, :n] = self.padding[:, self.start : self.end]
                self.padding = pad
            else:  # slide the window to the front (the source and destination never overlap here)
                for t in (self.k, self.v):
                    t[:, :, :, :n] = t[:, :, :, self.start : self.end].clone()
                self.padding[:, :n] = self.padding[:, self.start : self.end].clone()
            self.start, self.end = 0, n
        if padding is not None or self.padded:  # (the buffer holds no padding until a call brings some)
            self.padding[:, self.end : self.end + T] = False if padding is None else padding
            self.padded = self.padded or bool(padding is not None and padding.any())
        window = self.padding[:, self.start : self.end + T]
        return window if self.padded and bool(window.any()) else None

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the segment's keys/values [B, H, T, Dh] of ``layer``; return the window's [B, H, M + T, Dh]."""
        T = k.shape[2]
        self.k[layer, :, :, self.end : self.end + T] = k
        self.v[layer, :, :, self.end : self.end + T] = v
        return self.k[layer, :, :, self.start : self.end + T], self.v[layer, :, :, self.start : self.end + T]

    def positions(self, layer: int, K: int, key: tuple, project: Callable[[int], Tensor]) -> Tensor:
        """W_kR R of ``layer`` for the distances K-1, ..., 0, then ``SHIFT_ALIGN`` zero columns (the padding of the
        shift, see ``shift_padding``): [H, Dh, K + SHIFT_ALIGN], a view of a table that ``project(n)`` made once
        for the longest span seen (for one ``key``: clamp_len, dtype)."""
        if key != self._r_key:
            self._r_k, self._r_key = [None] * self.config.n_layer, key
        view = self._r_view[layer]
        if view is not None and view[0] == K and view[1] is self._r_k[layer]:  # (each step of a full window)
            return view[2]
        table = self._r_k[layer]
        if table is None or table.shape[-1] - SHIFT_ALIGN < K:
            table = project(max(K, self.capacity // 2))
            table = self._r_k[layer] = F.pad(table, (0, SHIFT_ALIGN))
        view = table[..., table.shape[-1] - SHIFT_ALIGN - K :]
        self._r_view[layer] = (K, table, view)
        return view

    def end_segment(self, T: int, mem_len: int) -> None:
        """The segment is now memory; keep the last ``mem_len`` positions (what ``_update_mems`` keeps)."""
        self.end += T
        self.start = max(self.start, self.end - max(mem_len, 0))

    def select(self, rows: list[int]) -> KVCache:
        """Keep only these batch rows, in this order (e.g. the requests that go on when others finished)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        self.k, self.v = self.k.index_select(1, idx), self.v.index_select(1, idx)
        self.padding = self.padding.index_select(0, idx)
        return self

    @classmethod
    def merge(cls, caches: list[KVCache]) -> KVCache:
        """One cache with the rows of all ``caches`` (one model, in this order), each row's memory right-aligned: a
        shorter memory is preceded by padding positions, which are never attended to and, being on the left, keep
        every row's relative distances. Each row then computes exactly what it would in its own cache."""
        first = caches[0]
        n = max(c.length for c in caches)
        batch = sum(c.k.shape[1] for c in caches)
        merged = cls.__new__(cls)
        merged.config = first.config
        merged.capacity = max(2 * n, first.capacity)
        shape = (first.k.shape[0], batch, first.k.shape[2], merged.capacity, first.k.shape[4])
        merged.k, merged.v = first.k.new_zeros(shape), first.v.new_zeros(shape)
        merged.padding = torch.ones(batch, merged.capacity, dtype=torch.bool, device=first.k.device)
        row = 0
        for c in caches:
            b, m = c.k.shape[1], c.length
            for src, dst in ((c.k, merged.k), (c.v, merged.v)):
                dst[:, row : row + b, :, n - m : n] = src[:, :, :, c.start : c.end]
            merged.padding[row : row + b, n - m : n] = c.padding[:, c.start : c.end]
            row += b
        merged.padding[:, n:] = False
        merged.padded = bool(merged.padding[:, :n].any())
        merged.start, merged.end = 0, n
        merged._r_k, merged._r_key = [None] * first.config.n_layer, None
        merged._r_view = [None] * first.config.n_layer
        merged.decode_plan = None
        return merged


@dataclass
class TransformerXLModelOutput:
    last_hidden_state: Tensor
    """[B, T, d_model] output of the last layer (after the final dropout)."""
    mems: list[Tensor] | None
    """Memory for the next segment: n_layer tensors [B, M', d_model] (None when mem_len == 0)."""
    hidden_states: list[Tensor] | None = None
    """n_layer + 1 tensors [B, T, d_model]: the input of every layer, then the final output."""
    attentions: list[Tensor] | None = None
    """n_layer tensors [B, H, T, K] of attention probabilities."""


class TransformerXLPreTrainedModel(PretrainedMixin, nn.Module):
    config_class = TransformerXLConfig

    def init_weights(self, modules: Iterable[nn.Module] | None = None) -> None:
        """The original initialisation (``weights_init`` of the reference ``train.py``), of every module or of
        ``modules``."""
        cfg = self.config

        def weight_(t: Tensor) -> None:
            if cfg.init == "uniform":
                nn.init.uniform_(t, -cfg.init_range, cfg.init_range)
            else:
                nn.init.normal_(t, 0.0, cfg.init_std)

        modules = list(self.modules() if modules is None else modules)
        for module in modules:
            if isinstance(module, nn.Linear):
                weight_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                weight_(module.weight)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, cfg.init_std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, AdaptiveEmbedding):
                for p in module.emb_projs:
                    nn.init.normal_(p, 0.0, cfg.proj_init_std)
            elif isinstance(module, ProjectedAdaptiveLogSoftmax):
                for p in module.out_projs:
                    nn.init.normal_(p, 0.0, cfg.proj_init_std)
                if module.n_clusters > 0:
                    weight_(module.cluster_weight)
                    nn.init.zeros_(module.cluster_bias)
            elif isinstance(module, TransformerXL) and cfg.attn_type == 0:
                weight_(module.r_w_bias)
                weight_(module.r_r_bias)
            elif isinstance(module, RelLearnableMultiHeadAttn):  # as the original train.py: biases r_bias at 0
                weight_(module.r_emb)
                weight_(module.r_w_bias)
                nn.init.zeros_(module.r_bias)
            elif isinstance(module, MultiHeadAttn) and module.r_emb is not None:
                weight_(module.r_emb)
        # The embedding tables come last so that tied output layers carry the embedding initialisation.
        for m in modules:
            if isinstance(m, AdaptiveEmbedding):
                for emb in m.emb_layers:
                    weight_(emb.weight)


class TransformerXL(TransformerXLPreTrainedModel):
    """The base model: token ids -> hidden states, with explicit memories."""

    def __init__(self, config: TransformerXLConfig, *, init: bool = True):
        super().__init__()
        self.config = config
        if config.attn_type in (1, 3) and config.max_klen < 1:
            raise ValueError(
                f"TransformerXLConfig.max_klen = {config.max_klen}: attn_type {config.attn_type} learns one embedding "
                "per position up to max_klen; set it (a training run sets tgt_len + ext_len + mem_len)"
            )
        self.word_emb = AdaptiveEmbedding(config, init=init)
        self.drop = Dropout(config.dropout)
        self.attention = attention_class(config.attn_type)  # the positional scheme: builds each layer's input
        if config.attn_type == 0:
            bias_shape = (
                (config.n_layer, config.n_head, config.d_head) if config.untie_r else (config.n_head, config.d_head)
            )
            self.r_w_bias = nn.Parameter(torch.empty(bias_shape))  # u
            self.r_r_bias = nn.Parameter(torch.empty(bias_shape))  # v
        self.layers = nn.ModuleList([TransformerXLLayer(config) for _ in range(config.n_layer)])
        if init:
            self.init_weights()

    def _check_mems(self, mems: list[Tensor], batch: int) -> int:
        cfg = self.config
        shapes = [tuple(m.shape) for m in mems]
        if len(mems) != cfg.n_layer or any(
            len(s) != 3 or s[0] != batch or s[2] != cfg.d_model or s[1] != shapes[0][1] for s in shapes
        ):
            raise ValueError(
                f"mems must be {cfg.n_layer} tensors of shape [batch={batch}, M, d_model={cfg.d_model}] "
                f"(batch-first; Hugging Face mems are time-major: transpose them), got {shapes}"
            )
        return shapes[0][1]

    def forward(
        self,
        input_ids: Tensor,
        mems: list[Tensor] | None = None,
        *,
        mem_len: int | None = None,
        same_length: bool | None = None,
        clamp_len: int | None = None,
        ext_len: int = 0,
        cache: KVCache | None = None,
        padding: Tensor | None = None,
        attention_mask: Tensor | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        detach_mems: bool = True,
    ) -> TransformerXLModelOutput:
        """Run one segment ``input_ids`` [B, T] on top of the memory ``mems``.

        ``mems=None`` is an empty memory (the original PyTorch code); pass ``n_layer`` zero tensors
        ``[B, mem_len, d_model]`` to reproduce Hugging Face's / the TF code's zero memory. ``mem_len``,
        ``same_length`` and ``clamp_len`` default to the config and can be changed per call (evaluation with a
        longer memory). The returned memory keeps the last ``mem_len`` layer inputs, excluding the last
        ``ext_len`` positions of the segment (they will be fed again as extended context).

        For inference, the memory can instead be a ``cache`` (:class:`KVCache`) of its keys/values, updated in place
        (``mems`` is then None in the output): the same result, without projecting the memory again.
        ``padding`` marks positions that are never attended to (True = padding), e.g. the left padding of texts of
        different lengths; relative distances count them, so pad on the left. With a cache it is [B, T] (the cache
        remembers the memory's); without, [B, M + T], the memory's positions then the segment's.
        ``attention_mask`` is the same in Hugging Face's form (1 = token, 0 = padding; [B, T] takes the memory as
        tokens), as a tokenizer call gives it.
        ``detach_mems=False`` keeps the returned memory in the autograd graph (gradient through several segments,
        e.g. fine-tuning a classifier on long documents); the paper's stop-gradient is the default.
        """
        cfg = self.config
        mem_len = cfg.mem_len if mem_len is None else mem_len
        same_length = cfg.same_length if same_length is None else same_length
        clamp_len = cfg.clamp_len if clamp_len is None else clamp_len
        if same_length and mem_len <= 0:
            raise ValueError("same_length=True needs mem_len > 0")
        window = mem_len + int(cfg.tf_same_length)  # (the keys a query sees with same_length, itself included)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        lo, hi = (0, 0) if torch.compiler.is_exporting() else map(int, torch.aminmax(input_ids))  # (none in a graph)
        if lo < 0 or hi >= cfg.n_token:
            raise ValueError(f"input_ids must be in [0, n_token={cfg.n_token}), got values in [{lo}, {hi}]")
        dev = input_ids.device
        if attention_mask is not None:
            if padding is not None:
                raise ValueError("pass padding (True = padding) or attention_mask (0 = padding), not both")
            padding = attention_mask.to(device=dev) == 0  # [B, T] or [B, M + T]
        word_emb = self.word_emb(input_ids)  # [B, T, D]
        if cache is None:
            mlen = self._check_mems(mems, B) if mems else 0
            if attention_mask is not None and mlen and padding.shape[-1] == T:
                padding = F.pad(padding, (mlen, 0), value=False)  # [B, M + T]: the memory's positions are tokens
            mask = (
                causal_mask(T, mlen, same_length, window, device=dev)
                if _masks_any(T, mlen, same_length, window)
                else None
            )
            if padding is not None:
                if tuple(padding.shape) != (B, mlen + T):
                    raise ValueError(
                        f"padding must be [batch, M + T] = [{B}, {mlen + T}] without a cache, not {list(padding.shape)}"
                    )
                mask = _padding_mask(mask, padding, T, mlen)
            dtype = word_emb.dtype
        else:
            mlen, mask = self._prepare_cache(cache, B, T, mems, padding, same_length, window, ext_len)
            dev, dtype = cache.k.device, cache.k.dtype
        # Each layer's positional input, built by the attention variant (attn_type) for the K = M + T keys.
        pos = self.attention.prepare(self, mlen + T, clamp_len, dtype, dev, cache)
        h = self.drop(word_emb)

        hids, attns = [h], []
        if (
            cache is not None
            and T == 1
            and backends().fast_decode
            and cfg.attn_type == 0
            and not (output_attentions or output_hidden_states)
        ):
            h = self._decode(h, pos, mask, cache)  # (the layers' own path below computes the same)
            hids.append(h)
        else:
            for i, layer in enumerate(self.layers):
                mem = mems[i] if mems else None
                h, prob = layer(h, pos[i], mask, mem=mem, need_weights=output_attentions, cache=cache, layer=i)
                hids.append(h)
                attns.append(prob)
        h = self.drop(h)
        hids[-1] = h

        if cache is not None:
            cache.end_segment(T, mem_len)
            new_mems = None
        else:
            new_mems = self._update_mems(hids[:-1], mems, mlen, T, mem_len, ext_len, detach=detach_mems)
        return TransformerXLModelOutput(
            last_hidden_state=h,
            mems=new_mems,
            hidden_states=hids if output_hidden_states else None,
            attentions=attns if output_attentions else None,
        )

    def fill_cache(self, cache: KVCache, mems: list[Tensor], mem_len: int | None = None) -> None:
        """Start an empty ``cache`` from a memory of layer inputs ``mems`` (``n_layer`` tensors [B, M, d_model], e.g.
        Hugging Face's zero memory): its keys and values, as a segment of M positions would have left them."""
        if cache.length:
            raise ValueError("fill_cache starts a cache: this one already holds a memory")
        M = self._check_mems(mems, cache.k.shape[1])
        cache.begin(M)
        for i, (layer, mem) in enumerate(zip(self.layers, mems, strict=True)):
            cache.append(i, *layer.attn.memory_keys_values(mem.to(cache.k)))
        cache.end_segment(M, self.config.mem_len if mem_len is None else mem_len)

    def _decode(self, h: Tensor, pos: list[RelPositions], mask: Tensor | None, cache: KVCache) -> Tensor:
        """Every layer for one new position per row, ``h`` [B, 1, D], with a ``cache`` (inference, attn_type 0):
        what the layers' forward computes, as one loop over their weights. For one token the arithmetic is small
        (about 15 MFLOP for the bench-char model) and the general path (module calls, attribute lookups, the checks
        of each product, the shift) costs more than it; this loop is 1.19x faster per generated token on a 2-core
        EPYC (benchmarks/levers.py). The attention's own ``scores`` gives the queries and the (b)+(d) row, which for
        the single newest query needs no shift."""
        B = h.shape[0]
        if cache.decode_plan is None or cache.decode_plan[0] is not self:
            cache.decode_plan = (self, [_DecodeLayer.of(layer) for layer in self.layers], {})
        _, plan, kernel_state = cache.decode_plan
        if backends().native_decode:  # the same loop in C, where it applies (fp32 on the CPU, a C compiler: txl.native)
            out = native.decode_step(plan, (self.r_w_bias, self.r_r_bias), h, pos, mask, cache, kernel_state)
            if out is not None:
                return out
        few = _few_rows(h) and h.dtype == plan[0].qkv.dtype  # (linear()'s checks, once per step)

        def product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:  # = linear(x, weight, bias)
            wide = weight.shape[0] >= weight.shape[1]
            return _rows_product(x, _transposed(weight), bias) if few and wide else F.linear(x, weight, bias)

        for i, (lay, p) in enumerate(zip(plan, pos, strict=True)):
            H, Dh = lay.attn.n_head, lay.attn.d_head
            x = F.layer_norm(h, *lay.norm1) if lay.pre_lnorm else h
            q, k, v = product(x, lay.qkv).view(B, 3, H, 1, Dh).unbind(1)  # [B, H, 1, Dh] each
            k, v = cache.append(i, k, v)  # the window's keys and values, [B, H, K, Dh] each
            q_w, bd = lay.attn.scores(q.transpose(1, 2), p, k.shape[2])  # (q + u) / sqrt(Dh); (b)+(d), [B, H, 1, K]
            if mask is not None:  # (same_length's window, or padding)
                bd = mask_scores(bd, mask, inplace=True)
            vec = F.scaled_dot_product_attention(q_w, k, v, attn_mask=bd, scale=1.0)  # + (a)+(c), [B, H, 1, Dh]
            h = lay.after_attention(h, vec, product)  # [B, 1, D]
        return h

    def _prepare_cache(self, cache: KVCache, B, T, mems, padding, same_length, window, ext_len):
        """The memory length and the mask ([T, K], or [B, 1, T, K] with padding) of a cache about to take a segment
        of T positions (``window``: the keys a query sees with ``same_length``)."""
        if mems or ext_len:
            raise ValueError("a KVCache holds the memory: pass no mems, and no ext_len (a training setting)")
        if self.training or torch.is_grad_enabled():
            raise ValueError("a KVCache is for inference with fixed weights: use model.eval() and torch.no_grad()")
        if cache.k.shape[1] != B:
            raise ValueError(f"the cache holds {cache.k.shape[1]} rows, the input {B}")
        mlen = cache.length
        padded = cache.begin(T, padding)  # [B, M + T] or None
        mask = None  # [T, K]
        if _masks_any(T, mlen, same_length, window):
            mask = causal_mask(T, mlen, same_length, window, device=cache.k.device)
        if padded is not None:
            mask = _padding_mask(mask, padded, T, mlen)
        return mlen, mask

    @staticmethod
    def _update_mems(
        hids: list[Tensor], mems: list[Tensor] | None, mlen: int, qlen: int, mem_len: int, ext_len: int, detach=True
    ) -> list[Tensor] | None:
        """Keep the last ``mem_len`` layer inputs of [memory; segment], ending ``ext_len`` before the end.

        (The reference code swaps ``qlen`` and ``mlen`` here; harmless only when ``ext_len == 0``.)
        Positions are absolute: the memory covers [0, mlen), the segment [mlen, mlen + qlen).
        """
        if mem_len <= 0:
            return None
        end = mlen + max(0, qlen - ext_len)
        beg = max(0, end - mem_len)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):  # detached: no graph is built at all
            if mems:
                new = [torch.cat([m, h], dim=1)[:, beg:end] for m, h in zip(mems, hids, strict=True)]
            else:
                new = [h[:, beg:end] for h in hids]
        return [t.detach() for t in new] if detach else new


# ---------------------------------------------------------------------------------------------------------
# 9. Heads.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TransformerXLLMOutput:
    losses: Tensor | None
    """[B, T] NLL of ``targets`` in input order (0 where ignored); [B, T-1] with ``labels``."""
    loss: Tensor | None
    """Mean NLL over the scored (not ignored) tokens."""
    log_probs: Tensor | None
    """[B, T, n_token] log-probabilities, when ``return_log_probs``."""
    mems: list[Tensor] | None
    last_hidden_state: Tensor
    hidden_states: list[Tensor] | None = None
    attentions: list[Tensor] | None = None

    @property
    def logits(self) -> Tensor:
        """Hugging Face's name (also ``prediction_scores``) for what its TransfoXL returned there: ``log_probs``."""
        if self.log_probs is None:
            raise AttributeError(
                "logits: the (adaptive) softmax's log-probabilities are computed on request: call the model with "
                "return_log_probs=True (Hugging Face's logits of TransfoXL were these log-probabilities)"
            )
        return self.log_probs

    prediction_scores = logits


class TransformerXLLM(TransformerXLPreTrainedModel):
    """Transformer-XL with the (adaptive) softmax language-model head."""

    base_model_prefix = "transformer"

    def __init__(self, config: TransformerXLConfig, *, init: bool = True):
        super().__init__()
        self.config = config
        self.transformer = TransformerXL(config, init=False)
        self.crit = ProjectedAdaptiveLogSoftmax(config)
        self.tie_weights()
        if init:
            self.init_weights()

    def tie_weights(self) -> None:
        """Share output weights with the embedding tables and (per ``tie_projs``) the projections."""
        cfg, emb = self.config, self.transformer.word_emb
        if cfg.tie_weight:
            for out_layer, emb_layer in zip(self.crit.out_layers, emb.emb_layers, strict=True):
                out_layer.weight = emb_layer.weight
        if len(self.crit.out_projs):
            for i, tie in enumerate(cfg.tie_projs):
                if tie:
                    self.crit.out_projs[i] = emb.emb_projs[0 if cfg.div_val == 1 else i]

    def forward(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        mems: list[Tensor] | None = None,
        return_log_probs: bool = False,
        *,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> TransformerXLLMOutput:
        """``targets[b, t]`` is the token after ``input_ids[b, t]`` (the original convention, all T positions
        scored). ``targets`` [B, T'] with T' < T scores the last T' positions only, as the reference does: the
        first T - T' inputs are context (e.g. the ``ext_len`` tokens fed again from the previous segment).
        ``labels`` is the Hugging Face convention (``labels = input_ids``, shifted inside, T-1 scores). -100 marks
        ignored positions. Other keyword arguments go to ``TransformerXL.forward``."""
        if targets is not None and labels is not None:
            raise ValueError("pass either targets (next tokens) or labels (HF convention), not both")
        out = self.transformer(input_ids, mems, **kwargs)
        h = out.last_hidden_state  # [B, T, D]
        B, T, D = h.shape
        if labels is not None:
            h, targets = h[:, :-1], labels[:, 1:]
        if targets is not None:
            if targets.dim() != 2 or targets.shape[0] != B or not 0 < targets.shape[1] <= h.shape[1]:
                raise ValueError(
                    f"targets must have shape [{B}, T'] with 0 < T' <= {h.shape[1]}, got {tuple(targets.shape)}"
                )
            h = h[:, h.shape[1] - targets.shape[1] :]  # the last T' positions are scored
        nll, log_probs = self.crit(h.reshape(-1, D), None if targets is None else targets.reshape(-1), return_log_probs)
        losses = loss = None
        if nll is not None:
            losses = nll.view(targets.shape)
            loss = losses.sum() / (targets != -100).sum().clamp(min=1)
        if log_probs is not None:
            log_probs = log_probs.view(*h.shape[:2], -1)
        return TransformerXLLMOutput(
            losses=losses,
            loss=loss,
            log_probs=log_probs,
            mems=out.mems,
            last_hidden_state=out.last_hidden_state,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    def generate(self, input_ids: Tensor, max_new_tokens: int | None = None, **kwargs: Any) -> Tensor:
        """Continue ``input_ids`` [B, T] as Hugging Face's ``model.generate`` does (greedy unless ``do_sample``;
        ``max_length``, ``attention_mask``, ``eos_token_id``, ``top_k``, ``top_p``, ``temperature``), with the
        memory kept as cached keys and values: :func:`txl.generation.generate_like_hf`."""
        from txl.generation import generate_like_hf  # (generation is built on this module)

        return generate_like_hf(self, input_ids, max_new_tokens, **kwargs)


@dataclass
class SequenceClassifierOutput:
    loss: Tensor | None
    logits: Tensor
    """[B, num_labels]."""
    mems: list[Tensor] | None
    hidden_states: list[Tensor] | None = None
    attentions: list[Tensor] | None = None


class TransformerXLForSequenceClassification(TransformerXLPreTrainedModel):
    """Scores the hidden state of the last token that is not padding: by ``attention_mask`` / ``padding`` where
    given (left padding, as txl's tokenizer call gives it, reads each text exactly as alone), else the last that is
    not ``pad_token_id`` (Hugging Face's right padding)."""

    base_model_prefix = "transformer"
    new_head = "score"  # from_pretrained of a language model: the body's weights, this head initialised anew

    def __init__(self, config: TransformerXLConfig, *, init: bool = True):
        super().__init__()
        self.config = config
        self.transformer = TransformerXL(config, init=False)
        self.score = nn.Linear(config.d_model, config.num_labels, bias=False)
        if init:
            self.init_weights()

    def forward(
        self, input_ids: Tensor, labels: Tensor | None = None, mems: list[Tensor] | None = None, **kwargs: Any
    ) -> SequenceClassifierOutput:
        """``labels``: [B] class ids (num_labels > 1), [B] floats (num_labels == 1, regression) or
        [B, num_labels] floats (multi-label)."""
        out = self.transformer(input_ids, mems, **kwargs)
        B, T = input_ids.shape
        last = torch.full((B,), T - 1, device=input_ids.device)
        mask, padding = kwargs.get("attention_mask"), kwargs.get("padding")
        real = None
        if mask is not None or padding is not None:
            real = (mask != 0 if mask is not None else ~padding)[:, -T:].to(input_ids.device)  # [B, T]
        elif self.config.pad_token_id is not None:
            real = input_ids != self.config.pad_token_id  # [B, T]
        if real is not None:
            # index of the last non-padding token (T-1 - position of the first real token from the right)
            last = torch.where(real.any(1), T - 1 - real.flip(1).int().argmax(1), last)
        pooled = out.last_hidden_state[torch.arange(B, device=input_ids.device), last]  # [B, D]
        logits = self.score(pooled)  # [B, num_labels]
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1), labels.float())
            elif labels.dtype in (torch.long, torch.int):
                loss = F.cross_entropy(logits, labels)
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels.float())
        return SequenceClassifierOutput(
            loss=loss,
            logits=logits,
            mems=out.mems,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )


# ---------------------------------------------------------------------------------------------------------
# 10. The ablation's attention variants (Sec. 4.3, Table 6), numbered as the original code's attn_type. Each differs
#     from attn_type 0 only in how positions enter; memory, masks, heads and the trainer are shared.
#     1 (Shaw et al., 2018), per layer l and distance d = min(i - j, max_klen - 1, clamp_len):
#         A_ij = (q_i + u_l).k_j  +  q_i.E_l[d]  +  b_l[d]       (the original RelLearnableMultiHeadAttn)
#       learned E_l [max_klen, H, Dh] (term (b)), b_l [max_klen, H] (term (d), one scalar per head), u_l (term (c)).
#     2 (Vaswani et al., 2017) / 3 (Al-Rfou et al., 2018): A_ij = q_i.k_j over inputs with absolute positions added:
#       2 the sinusoid at the first layer, 3 a learned table per layer. With a memory, a key's position is its index
#       in the attended window [memory; segment]: memory slot m has position m, segment token i position M+i, so a
#       text read segment by segment gets the positions of one pass over it while the memory holds all of it, and a
#       full memory gives every segment the same positions (M..M+T-1; a vanilla model's window 0..T-1). A window
#       longer than attn_type 3's table (max_klen) keeps its newest max_klen positions apart and its oldest share
#       position 0. The memory keeps the layer inputs *without* positions and positions are added anew for each
#       window (the original code adds them in place into the cached memory, so they pile up, and attn_type 2
#       crashes on its first segment with a memory). Positions move as the window slides, so keys cannot be cached.
# ---------------------------------------------------------------------------------------------------------


def _distances(K: int, limit: int, clamp_len: int, device) -> Tensor:
    """The distances K-1, ..., 0 of the K key columns (unshifted order), capped at ``limit`` and ``clamp_len``."""
    cap = min(limit, clamp_len) if clamp_len > 0 else limit
    return torch.arange(K - 1, -1, -1, device=device).clamp(max=cap)  # [K]


class RelLearnableMultiHeadAttn(_Attention):
    """attn_type 1: learned relative positions (Shaw et al., 2018) with the original code's biases."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.r_emb = nn.Parameter(torch.empty(cfg.max_klen, cfg.n_head, cfg.d_head))  # E_l, by distance
        self.r_w_bias = nn.Parameter(torch.empty(cfg.n_head, cfg.d_head))  # u_l
        self.r_bias = nn.Parameter(torch.empty(cfg.max_klen, cfg.n_head))  # b_l, by distance

    @staticmethod
    def prepare(model: TransformerXL, K: int, clamp_len: int, dtype, device, cache: KVCache | None) -> list:
        """The (capped) distance of every key column, in the order of the unshifted scores (K-1, ..., 0)."""
        cfg = model.config
        return [_distances(K, cfg.max_klen - 1, clamp_len, device)] * cfg.n_layer

    def scores(self, q: Tensor, pos: Tensor, K: int) -> tuple[Tensor, Tensor]:
        B, T, H, Dh = q.shape
        q_w = ((q + self.r_w_bias) * self.scale).transpose(1, 2)  # (q + u_l) / sqrt(Dh), [B, H, T, Dh]
        q_r = (q * self.scale).permute(2, 0, 1, 3).reshape(H, B * T, Dh)  # q / sqrt(Dh), [H, B*T, Dh]
        r_k = self.r_emb[pos].permute(1, 2, 0)  # E_l[d] for the distances K-1..0, [H, Dh, K]
        b = (self.r_bias[pos].t() * self.scale)[:, None, None, :]  # b_l[d] / sqrt(Dh), [H, 1, 1, K]
        bd = torch.bmm(q_r, r_k.to(q_r.dtype)).view(H, B, T, K)  # (b) by distance, [H, B, T, K]
        bd = (bd + b.to(bd.dtype)).transpose(0, 1)  # (b)+(d) by distance, [B, H, T, K]
        if T > 1:
            bd = rel_shift(bd)  # by key (Appendix B's shift, as for attn_type 0)
        return q_w, bd


class MultiHeadAttn(_Attention):
    """attn_type 2 and 3: standard attention, A_ij = q_i.k_j; positions are in the inputs. attn_type 3 owns its
    layer's learned position table (``r_emb`` [max_klen, d_model], row p = position p)."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.r_emb = nn.Parameter(torch.empty(cfg.max_klen, cfg.d_model)) if cfg.attn_type == 3 else None

    @staticmethod
    def prepare(model: TransformerXL, K: int, clamp_len: int, dtype, device, cache: KVCache | None) -> list:
        """The positions to add to each layer's [memory; segment] ([K, D] or None): attn_type 2 the sinusoid of
        the positions 0, ..., K-1 at the first layer (dropped out like R), attn_type 3 each layer's own rows."""
        cfg = model.config
        if clamp_len > 0:
            raise ValueError(f"clamp_len = {clamp_len} clamps relative distances; attn_type {cfg.attn_type} has none")
        if cache is not None:
            raise ValueError(
                f"attn_type {cfg.attn_type} has absolute positions, which move as the window slides: its keys "
                "cannot be cached (evaluate with cache=False; generation recomputes the memory)"
            )
        if cfg.attn_type == 2:
            exact = torch.float64 if dtype == torch.float64 else torch.float32
            table = sinusoid_embedding(K, cfg.d_model, -1, device, exact).flip(0)  # rows for the positions 0..K-1
            return [model.drop(table.to(dtype))] + [None] * (cfg.n_layer - 1)  # [K, D]
        p = (torch.arange(K, device=device) - max(0, K - cfg.max_klen)).clamp(min=0)  # [K]
        return [layer.attn.r_emb[p] for layer in model.layers]  # [K, D] per layer

    def input_positions(self, pos: Tensor | None) -> Tensor | None:
        return pos  # [K, D]: added to [memory; segment] (None for attn_type 2 above the first layer)

    def scores(self, q: Tensor, pos: Tensor | None, K: int) -> tuple[Tensor, None]:
        return (q * self.scale).transpose(1, 2), None  # q / sqrt(Dh), [B, H, T, Dh]; no positional term


def attention_class(attn_type: int) -> type[_Attention]:
    """The attention of ``attn_type`` (0 Transformer-XL, 1 Shaw et al., 2 Vaswani et al., 3 Al-Rfou et al.)."""
    return {
        0: RelPartialLearnableMultiHeadAttn,
        1: RelLearnableMultiHeadAttn,
        2: MultiHeadAttn,
        3: MultiHeadAttn,
    }[attn_type]


def supports_kv_cache(config: TransformerXLConfig) -> bool:
    """Whether keys and values can be cached across segments (relative positions: attn_type 0 and 1)."""
    return config.attn_type in (0, 1)
