"""2-4. Where positions enter: the relative position table R (Sec. 3.3), Appendix B's shift, and the mask over
[memory; segment]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from txl.kernels.runtime import functorch_wrapped

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
    if torch.compiler.is_compiling():  # (a compiled graph: the same view by padding and slicing, no as_strided)
        return rel_shift_padded(bd_raw[..., :klen])
    if bd_raw.stride(-1) != 1 or bd_raw.stride(-2) != width:
        bd_raw = bd_raw.contiguous()
    if width == klen:
        return _RelShift.apply(bd_raw)
    stride = (*bd_raw.stride()[:-2], width - 1, 1)
    return bd_raw.as_strided((*lead, qlen, klen), stride, bd_raw.storage_offset() + qlen - 1)


def rel_shift_padded(bd_raw: Tensor) -> Tensor:
    """:func:`rel_shift` by one zero column and a slice of the flattened rows (the original code's trick, batch
    first): ``bd[.., i, j] = bd_raw[.., i, j + T-1-i]`` is element ``T-1 + i*K + j`` of the rows padded to K+1
    columns. Views and a pad, which a compiler traces and fuses into the scores' sum."""
    *lead, qlen, klen = bd_raw.shape
    flat = F.pad(bd_raw, (0, 1)).flatten(-2)  # [..., T * (K + 1)]
    return flat[..., qlen - 1 : qlen - 1 + qlen * klen].view(*lead, qlen, klen)


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
    bias = torch.zeros(mask.shape, dtype=score.dtype, device=score.device)
    if functorch_wrapped(mask):  # (under vmap, e.g. TorchRL's value estimators: out of place)
        bias = bias.masked_fill(mask, float("-inf"))
    else:
        bias.masked_fill_(mask, float("-inf"))
    return score.add_(bias) if inplace else score + bias


def mask_scores_(score: Tensor, mask: Tensor) -> Tensor:
    """:func:`mask_scores` in place, for inference: on the CPU only the columns from the first masked one on are
    touched (with the causal mask, the last T-1 columns)."""
    lo = 0
    # (elsewhere finding the column would wait for the device, or be a data-dependent shape in a graph)
    if mask.device.type == "cpu" and not (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or get_proxy_mode() is not None
        or functorch_wrapped(mask)
    ):  # (nor in a trace: txl.kernels.graphs' CPU stand-in for a graph; nor under vmap)
        masked = mask.reshape(-1, mask.shape[-1]).any(0)  # [K]
        lo = int(masked.to(torch.uint8).argmax()) if bool(masked.any()) else mask.shape[-1]
    if lo < mask.shape[-1]:
        mask_scores(score[..., lo:], mask[..., lo:], inplace=True)
    return score
