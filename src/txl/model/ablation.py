"""10. The ablation's attention variants (Sec. 4.3, Table 6), attn_type 1-3, and the choice by attn_type."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from txl.kernels.admission import stock
from txl.model.attention import Cache, RelPartialLearnableMultiHeadAttn, Stack, _Attention
from txl.model.config import TransformerXLConfig
from txl.model.positions import rel_shift, sinusoid_embedding

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


@stock
class RelLearnableMultiHeadAttn(_Attention):
    """attn_type 1: learned relative positions (Shaw et al., 2018) with the original code's biases."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.r_emb = nn.Parameter(torch.empty(cfg.max_klen, cfg.n_head, cfg.d_head))  # E_l, by distance
        self.r_w_bias = nn.Parameter(torch.empty(cfg.n_head, cfg.d_head))  # u_l
        self.r_bias = nn.Parameter(torch.empty(cfg.max_klen, cfg.n_head))  # b_l, by distance

    @staticmethod
    def prepare(model: Stack, K: int, clamp_len: int, dtype, device, cache: Cache | None) -> list:
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


@stock
class MultiHeadAttn(_Attention):
    """attn_type 2 and 3: standard attention, A_ij = q_i.k_j; positions are in the inputs. attn_type 3 owns its
    layer's learned position table (``r_emb`` [max_klen, d_model], row p = position p)."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.r_emb = nn.Parameter(torch.empty(cfg.max_klen, cfg.d_model)) if cfg.attn_type == 3 else None

    @staticmethod
    def prepare(model: Stack, K: int, clamp_len: int, dtype, device, cache: Cache | None) -> list:
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
