"""5. The relative multi-head attention (Sec. 3.3): the four terms (a)-(d) and the shift."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels.admission import stock
from txl.kernels.attention import attend, rel_attention, score_sum
from txl.kernels.dropout import Dropout
from txl.kernels.linear import plain_linear, project, segment_memory_projection
from txl.model.config import TransformerXLConfig
from txl.model.gating import make_gate
from txl.model.positions import mask_scores, mask_scores_, rel_shift, shift_padding, sinusoid_embedding


class Cache(Protocol):
    """What the attention reads of a K/V cache (``txl.model.cache.KVCache``; a protocol: model/ has no import
    circle)."""

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def positions(self, layer: int, K: int, key: tuple, project: Callable[[int], Tensor]) -> Tensor: ...


class Stack(Protocol):
    """What the positions' preparation reads of the layer stack (``txl.model.transformer.TransformerXL``)."""

    config: TransformerXLConfig
    layers: nn.ModuleList
    drop: nn.Module
    r_w_bias: Tensor
    r_r_bias: Tensor


def at_least_fp32(x: Tensor) -> Tensor:
    """At least fp32 (half-precision tensors are upcast; fp64 stays fp64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


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


@stock
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
        self.identity_map = cfg.identity_map  # (GTrXL: a ReLU on the output before it joins the residual stream)
        self.gate = make_gate(cfg)  # (None: the residual sum)
        self.scale = 1.0 / math.sqrt(cfg.d_head)

    def project(
        self, h: Tensor, mem: Tensor | None, cache: Cache | None, layer: int, pos: Tensor | None = None
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
            qkv = project(self.qkv_net, x)  # [B, T, 3*H*Dh]: one GEMM
            q, kv = qkv[..., : H * Dh].view(B, T, H, Dh), qkv[..., H * Dh :]
            kv = kv.view(B, T, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, T, Dh]
            kv = cache.append(layer, *kv) if cache is not None else kv  # [B, H, K, Dh] each
        else:
            mem = self.layer_norm(mem) if self.pre_lnorm else mem  # [B, M, D]
            K = mem.shape[1] + T
            q, kv = segment_memory_projection(self.qkv_net, mem, x, H * Dh)  # [B, T, HD], [B, K, 2HD]
            q = q.reshape(B, T, H, Dh)
            kv = kv.view(B, K, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, K, Dh]
        return h, q, kv

    def memory_keys_values(self, mem: Tensor) -> Tensor:
        """The keys and values [2, B, H, M, Dh] of a memory of layer inputs ``mem`` [B, M, D] (to fill a cache):
        what :meth:`project` computes for the memory's positions."""
        B, M, _ = mem.shape
        H, Dh = self.n_head, self.d_head
        x = self.layer_norm(mem) if self.pre_lnorm else mem
        kv = project(self.qkv_net, x, out=slice(H * Dh, None))  # [B, M, 2HD]
        return kv.view(B, M, 2, H, Dh).permute(2, 0, 3, 1, 4)  # [2, B, H, M, Dh]

    def forward(
        self,
        h: Tensor,
        pos: Any,
        mask: Tensor | None,
        mem: Tensor | None = None,
        need_weights: bool = False,
        cache: Cache | None = None,
        layer: int = 0,
        head_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The common call of every variant. ``h`` [B, T, D] segment, ``pos`` this layer's positional input (from the
        variant's ``prepare``), ``mask`` [T, K] or [B, 1, T, K] (True = masked; None: nothing is masked), ``mem``
        [B, M, D] memory; with a ``cache`` the memory is the cached keys/values of ``layer`` (only the segment is
        projected; ``mem`` is not used).

        ``head_mask`` [1, H, 1, 1] multiplies each head's probabilities (Hugging Face's: 0 silences a head).
        Returns the layer output [B, T, D] and the attention probabilities [B, H, T, K] when ``need_weights``.
        """
        h, q, kv = self.project(h, mem, cache, layer, self.input_positions(pos))
        dropatt = self.dropatt.p if self.training else 0.0

        def reference() -> tuple[Tensor, Tensor | None]:  # the scores, then attend: [B, T, H*Dh], probabilities
            k, v = kv  # [B, H, K, Dh] each
            q_w, bd = self.scores(q, pos, k.shape[2])
            return self.attend(q_w, k, v, bd, mask, need_weights, head_mask)

        if need_weights or head_mask is not None:
            attn_vec, prob = reference()
        else:  # (the whole attention as one named operation, whose backends compute what reference() does)
            attn_vec, prob = self.heads(q, pos, kv, mask, dropatt, lambda: reference()[0]), None
        return self.output(h, attn_vec), prob

    def heads(
        self,
        q: Tensor,
        pos: Any,
        kv: Tensor | tuple[Tensor, Tensor],
        mask: Tensor | None,
        dropatt: float,
        reference: Callable[[], Tensor],
    ) -> Tensor:
        """The heads' values [B, T, H*Dh], when no probabilities or head mask are asked for: ``reference()`` (scores()
        + attend()), or a variant's named operation that computes it (attn_type 0: ``txl.kernels.attention``).
        ``kv`` as :meth:`project` returns it; ``dropatt``: the dropout of the probabilities (training)."""
        return reference()

    def input_positions(self, pos: Any) -> Tensor | None:
        """Positions added to the layer input [memory; segment] ([K, D]; None: none, the relative variants)."""
        return None

    def scores(self, q: Tensor, pos: Any, K: int) -> tuple[Tensor, Tensor | None]:
        """The scaled queries of the content term [B, H, T, Dh] and the positional term in key order [B, H, T, K]
        (None: there is none)."""
        raise NotImplementedError

    def attend(
        self,
        q_w: Tensor,
        k: Tensor,
        v: Tensor,
        bd: Tensor | None,
        mask: Tensor | None,
        need_weights: bool,
        head_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """softmax(q_w.k + bd) v: the heads' values [B, T, H*Dh] and the probabilities [B, H, T, K] where they are
        computed. ``q_w`` [B, H, T, Dh] are the scaled queries of the content term, ``bd`` [B, H, T, K] the positional
        term in key order (None: there is none), ``mask`` [T, K] or [B, 1, T, K] (True = masked, None = nothing is).
        The reference is :meth:`explicit`; ``txl.kernels.attention.attend`` runs it, or one fused call where that
        computes the same."""
        B, H, T, _ = q_w.shape
        probabilities = need_weights or (self.training and self.dropatt.p > 0) or head_mask is not None
        attn_vec, prob = attend(
            q_w, k, v, lambda: self.explicit(q_w, k, v, bd, mask, head_mask),
            lambda grad: self.bias(q_w, bd, mask, grad), probabilities,
        )  # fmt: skip
        return attn_vec.transpose(1, 2).reshape(B, T, -1), prob

    def explicit(
        self, q_w: Tensor, k: Tensor, v: Tensor, bd: Tensor | None, mask: Tensor | None, head_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The attention as the paper writes it: the scores, the mask, the softmax, the dropout of the probabilities,
        the value sum. Returns the heads' values [B, H, T, Dh] and the probabilities [B, H, T, K]."""
        ac = torch.matmul(q_w, k.transpose(-1, -2))  # (a)+(c), [B, H, T, K]
        score = score_sum(ac, bd)  # + (b)+(d), [B, H, T, K]
        if mask is not None:
            score = mask_scores(score, mask, inplace=True)
        prob = self.dropatt(score.softmax(dim=-1).to(v.dtype))  # [B, H, T, K]
        if head_mask is not None:
            prob = prob * head_mask.to(prob.dtype)  # [1, H, 1, 1]: a head's weights scaled (0: silenced)
        return torch.matmul(prob, v), prob  # [B, H, T, Dh]

    @staticmethod
    def bias(q_w: Tensor, bd: Tensor | None, mask: Tensor | None, grad: bool) -> Tensor | None:
        """The shifted (b)+(d) term with the masked keys at -inf, as an additive bias of the scores ([B, H, T, K], or
        [T, K] without bd; None: no term, no mask); in place where no gradient needs ``bd`` and its rows do not
        overlap (the shift of a padded row, or no shift)."""
        if bd is None:
            return None if mask is None else mask_scores(q_w.new_zeros(mask.shape, dtype=torch.float32), mask)
        if mask is None:
            return bd
        if not grad and bd.stride(-2) >= bd.shape[-1]:
            return mask_scores_(bd, mask)  # [B, H, T, K], in place
        return mask_scores(bd, mask)  # [B, H, T, K]

    def output(self, h: Tensor, attn_vec: Tensor) -> Tensor:
        """W_o of the heads' values ``attn_vec`` [B, T, H*Dh], added to the residual ``h`` (then the layer norm
        unless pre-LN); with GTrXL's options, through a ReLU and joined by the gate (txl.model.gating)."""
        attn_out = self.drop(project(self.o_net, attn_vec))  # [B, T, D]
        if not self.pre_lnorm:
            return self.layer_norm(h + attn_out)
        attn_out = F.relu(attn_out) if self.identity_map else attn_out
        return h + attn_out if self.gate is None else self.gate(h, attn_out)


class RelPositions(NamedTuple):
    """attn_type 0's positional input of one layer: R ([K, D], dropped out) or W_kR R already projected
    (``r_k`` [H, Dh, K + SHIFT_ALIGN], from a cache), and the biases u, v ([H, Dh])."""

    pos_emb: Tensor | None
    r_k: Tensor | None
    u: Tensor
    v: Tensor


@stock
class RelPartialLearnableMultiHeadAttn(_Attention):
    """attn_type 0: the Transformer-XL relative attention."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__(cfg)
        self.r_net = nn.Linear(cfg.d_model, cfg.n_head * cfg.d_head, bias=False)  # W_kR

    @staticmethod
    def biases(model: Stack) -> list[tuple[Tensor, Tensor]]:
        """Each layer's u, v ([H, Dh] each): the model's, shared by the layers, or one per layer (untie_r)."""
        u, v = model.r_w_bias, model.r_r_bias  # [H, Dh], or [n_layer, H, Dh] (untie_r)
        return (
            list(zip(u.unbind(0), v.unbind(0), strict=True)) if model.config.untie_r else [(u, v)] * len(model.layers)
        )

    @staticmethod
    def prepare(model: Stack, K: int, clamp_len: int, dtype, device, cache: Cache | None) -> list:
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
                return attn.project_positions(pos)

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
        return self.project_positions(pos.pos_emb)

    def project_positions(self, pos_emb: Tensor) -> Tensor:
        """W_kR R: the positions ``pos_emb`` [K, D] projected by ``r_net``, laid out [H, Dh, K] for the (b)+(d)
        product (a plain layer: one product straight into that layout; any other is called)."""
        K = pos_emb.shape[0]
        if plain_linear(self.r_net):
            return torch.mm(self.r_net.weight, pos_emb.t()).view(self.n_head, self.d_head, K)
        return self.r_net(pos_emb).t().reshape(self.n_head, self.d_head, K)

    def heads(
        self,
        q: Tensor,
        pos: RelPositions,
        kv: Tensor | tuple[Tensor, Tensor],
        mask: Tensor | None,
        dropatt: float,
        reference: Callable[[], Tensor],
    ) -> Tensor:
        # The same terms as scores() + attend() (the kernels form (q + u) / sqrt(Dh) and (q + v) / sqrt(Dh) as
        # _terms() does, and read the (b)+(d) rows at their shift).
        positions = functools.partial(self._positions, pos)
        return rel_attention(self, q, pos.u, pos.v, kv, positions, self.scale, mask, dropatt, reference)

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
