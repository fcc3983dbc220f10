"""6. The position-wise feed-forward and the layer; 8. the model: embedding, layers and the segment-level
recurrence (Sec. 3.2)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels.admission import stock
from txl.kernels.compiled import layer_call
from txl.kernels.decode import decode_step
from txl.kernels.dropout import Dropout
from txl.kernels.graphs import segment_layers
from txl.kernels.linear import project, rows_linear
from txl.model.ablation import MultiHeadAttn, RelLearnableMultiHeadAttn, attention_class
from txl.model.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from txl.model.attention import RelPositions
from txl.model.cache import KVCache
from txl.model.compressive import (
    compress_cached,
    compress_memories,
    joined,
    make_compression,
    split_mems,
)
from txl.model.config import Reading, TransformerXLConfig
from txl.model.gating import make_gate
from txl.model.positions import _masks_any, _padding_mask, causal_mask, mask_scores
from txl.model.pretrained import PretrainedMixin

# ---------------------------------------------------------------------------------------------------------
# 6. Position-wise feed-forward and the layer.
# ---------------------------------------------------------------------------------------------------------


@stock
class PositionwiseFF(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.layer_1 = nn.Linear(cfg.d_model, cfg.d_inner)
        self.layer_2 = nn.Linear(cfg.d_inner, cfg.d_model)
        self.layer_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon)
        self.drop = Dropout(cfg.dropout)
        self.pre_lnorm = cfg.pre_lnorm
        self.identity_map = cfg.identity_map  # (GTrXL: a ReLU on the output before it joins the residual stream)
        self.gate = make_gate(cfg)  # (None: the residual sum)

    def forward(self, h: Tensor) -> Tensor:
        x = self.layer_norm(h) if self.pre_lnorm else h
        y = self.drop.relu(project(self.layer_1, x))  # relu, dropout: [B, T, d_inner]
        y = self.drop(project(self.layer_2, y))  # [B, T, D]
        if not self.pre_lnorm:
            return self.layer_norm(h + y)
        y = F.relu(y) if self.identity_map else y
        return h + y if self.gate is None else self.gate(h, y)


@stock
class TransformerXLLayer(nn.Module):
    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.attn = attention_class(cfg.attn_type)(cfg)
        self.ff = PositionwiseFF(cfg)

    def forward(self, h: Tensor, pos: Any, mask: Tensor | None, **kw) -> tuple[Tensor, Tensor | None]:
        out, prob = self.attn(h, pos, mask, **kw)
        return self.ff(out), prob

    def step(
        self, h: Tensor, keys_values: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
        positional: Callable[[Tensor, int], tuple[Tensor, Tensor]], product: Callable = F.linear,
        attend: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:  # fmt: skip
        """The layer for one new position per row, ``h`` [B, 1, D] -> [B, 1, D] (relative attention): the one-token
        step over a KVCache's window (:meth:`TransformerXL.step`) and over a ring (txl.model.cache.Ring). What the
        memory's layout decides is passed in: ``keys_values(k, v)`` stores the new position's keys and values
        [B, H, 1, Dh] and returns those attended [B, H, K, Dh]; ``positional(q, K)`` gives (q + u)/sqrt(Dh) and the
        (b)+(d) scores [B, H, 1, K] with the mask added (-inf) for the queries ``q`` [B, H, 1, Dh]; ``attend(q_w, k,
        v, bd)`` the heads' values [B, H, 1, Dh] (default: softmax(q_w k + bd) v as one SDPA call)."""
        B, attn = h.shape[0], self.attn
        H, Dh = attn.n_head, attn.d_head
        x = attn.layer_norm(h) if attn.pre_lnorm else h
        q, k, v = product(x, attn.qkv_net.weight).view(B, 3, H, 1, Dh).unbind(1)  # [B, H, 1, Dh] each
        k, v = keys_values(k, v)  # [B, H, K, Dh]
        q_w, bd = positional(q, k.shape[2])  # [B, H, 1, Dh], [B, H, 1, K]
        if attend is None:
            vec = F.scaled_dot_product_attention(q_w, k, v, attn_mask=bd, scale=1.0)  # + (a)+(c), [B, H, 1, Dh]
        else:
            vec = attend(q_w, k, v, bd)
        # the rest is the layer's own: W_o, the residual, norm or gate (attn.output), then its feed-forward
        return self.ff(attn.output(h, vec.transpose(1, 2).reshape(B, 1, H * Dh)))  # [B, 1, D]


# ---------------------------------------------------------------------------------------------------------
# 8. The model: embedding, layers, and the segment-level recurrence (Sec. 3.2).
#      h_{tau+1}^{n-1} ~ [SG(m_tau^{n-1}) ; h_{tau+1}^{n-1}]   (memory = stop-gradient of cached layer inputs)
# ---------------------------------------------------------------------------------------------------------


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
    recon_loss: Tensor | None = None
    """A Compressive Transformer's attention-reconstruction loss (with gradients on; it trains f_c alone)."""


@dataclass
class Segment:
    """A segment prepared for the layers (``TransformerXL._prepare``)."""

    h: Tensor
    """[B, T, D] the layers' input: the word embedding, dropped out."""
    T: int
    mlen: int
    """Positions of memory before the segment."""
    mask: Tensor | None
    """[T, K] or [B, 1, T, K], True = masked (None: nothing is)."""
    pos: list
    """Each layer's positional input (the attention variant's ``prepare``)."""
    heads: list
    """Each layer's head mask [1, H, 1, 1] or None."""
    cache: KVCache | None
    mems: list[Tensor] | None
    read: Reading
    window: int
    """The keys a query sees with same_length."""


FORWARD_ARGUMENTS = """Arguments of ``TransformerXL.forward``:

* ``input_ids`` [B, T], or ``inputs_embeds`` [B, T, d_model]: the word embedding's output
  (``model.word_emb(ids)``, its scale included, as Hugging Face's TransfoXL takes it), e.g. soft prompts.
* ``mems``: the memory, n_layer tensors [B, M, d_model] (None: empty; n_layer zero tensors [B, mem_len, d_model]
  reproduce Hugging Face's / the TF code's zero memory). The returned memory keeps the last ``mem_len`` layer inputs,
  excluding the last ``ext_len`` positions of the segment (fed again as extended context).
  A Compressive Transformer's (``cmem_len`` > 0) are 2 x n_layer tensors: the memory as above, then each layer's
  compressed memory [B, Mc, d_model] (Mc <= cmem_len slots, oldest first; n_layer tensors alone: none yet); each
  layer attends to [compressed memory; memory; segment] (txl.model.compressive).
* ``reading`` (:class:`~txl.model.config.Reading`), or ``mem_len``, ``same_length``, ``clamp_len``, ``cmem_len`` one
  by one (which win over ``reading``): how this call reads, each None the config's (evaluation with a longer
  memory, or a longer compressed memory).
* ``cache`` (:class:`KVCache`): the memory as its keys and values, updated in place (``mems`` is then None in the
  output): the same result, without projecting the memory again (inference).
* ``padding``: positions never attended to (True = padding), e.g. the left padding of texts of different lengths
  (relative distances count them: pad on the left); with a cache [B, T] (the cache remembers the memory's), without
  [B, M + T]. ``attention_mask``: the same in Hugging Face's form (1 = token, 0 = padding; [B, T] takes the memory
  as tokens).
* ``key_mask`` [B, T, M + T] (True = that query never attends that key), on top of the causal mask: e.g. an agent's
  episode boundaries (``txl.rl``).
* ``head_mask`` ([n_head], or [n_layer, n_head]; Hugging Face's) multiplies each head's attention probabilities:
  1 keeps a head, 0 silences it.
* ``output_hidden_states``: every layer's input then the output; ``output_attentions``: every layer's probabilities.
* ``detach_mems=False`` keeps the returned memory in the autograd graph (gradient through several segments); the
  paper's stop-gradient is the default.
"""


def init_module(module: nn.Module, cfg: Any, ops: Any = nn.init) -> None:
    """The original initialisation (``weights_init`` of the reference ``train.py``) of ``module`` itself (not its
    children), with ``ops``'s functions (``torch.nn.init``; transformers' ``initialization``, which leaves loaded
    weights alone). ``cfg``: txl's or Hugging Face's configuration (init, init_range, init_std, proj_init_std)."""

    def weight_(t: Tensor) -> None:
        if cfg.init == "uniform":
            ops.uniform_(t, -cfg.init_range, cfg.init_range)
        else:
            ops.normal_(t, 0.0, cfg.init_std)

    if isinstance(module, nn.Linear):
        weight_(module.weight)
        if module.bias is not None:
            ops.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        weight_(module.weight)
    elif isinstance(module, nn.LayerNorm):
        ops.normal_(module.weight, 1.0, cfg.init_std)
        ops.zeros_(module.bias)
    elif isinstance(module, AdaptiveEmbedding):
        for p in module.emb_projs:
            ops.normal_(p, 0.0, cfg.proj_init_std)
    elif isinstance(module, ProjectedAdaptiveLogSoftmax):
        for p in module.out_projs:
            ops.normal_(p, 0.0, cfg.proj_init_std)
        if module.n_clusters > 0:
            weight_(module.cluster_weight)
            ops.zeros_(module.cluster_bias)
    elif isinstance(module, TransformerXL) and getattr(cfg, "attn_type", 0) == 0:
        weight_(module.r_w_bias)
        weight_(module.r_r_bias)
    elif isinstance(module, RelLearnableMultiHeadAttn):  # as the original train.py: biases r_bias at 0
        weight_(module.r_emb)
        weight_(module.r_w_bias)
        ops.zeros_(module.r_bias)
    elif isinstance(module, MultiHeadAttn) and module.r_emb is not None:
        weight_(module.r_emb)


class TransformerXLPreTrainedModel(PretrainedMixin, nn.Module):
    config_class = TransformerXLConfig

    def init_weights(self, modules: Iterable[nn.Module] | None = None) -> None:
        """The original initialisation (:func:`init_module`) of every module or of ``modules``; the embedding tables
        come last, so that tied output layers carry the embedding initialisation."""
        modules = list(self.modules() if modules is None else modules)
        for module in modules:
            init_module(module, self.config)
        for m in modules:
            if isinstance(m, AdaptiveEmbedding):
                for emb in m.emb_layers:  # (nn.Embedding tables)
                    init_module(emb, self.config)


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
        if config.cmem_len:  # 12. the Compressive Transformer: each layer's compression function f_c
            self.compress = nn.ModuleList([make_compression(config) for _ in range(config.n_layer)])
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
        self, input_ids: Tensor | None = None, mems: list[Tensor] | None = None, *,
        inputs_embeds: Tensor | None = None, head_mask: Tensor | None = None, reading: Reading | None = None,
        mem_len: int | None = None, same_length: bool | None = None, clamp_len: int | None = None, ext_len: int = 0,
        cache: KVCache | None = None, padding: Tensor | None = None, attention_mask: Tensor | None = None,
        key_mask: Tensor | None = None, output_hidden_states: bool = False, output_attentions: bool = False,
        detach_mems: bool = True, cmem_len: int | None = None,
    ) -> TransformerXLModelOutput:  # fmt: skip
        """Run one segment ``input_ids`` [B, T] on top of the memory ``mems`` (n_layer tensors [B, M, d_model];
        None: an empty memory, as the original PyTorch code; zeros: Hugging Face's / the TF code's), or of a
        ``cache`` (:class:`KVCache`, inference: the memory's keys and values, updated in place). See
        :data:`FORWARD_ARGUMENTS` for every argument. Returns the last layer's output and the next memory."""
        cfg = self.config
        read = Reading.of(
            reading, cfg, mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, cmem_len=cmem_len
        )
        mems, cmems = split_mems(mems, cfg.n_layer, read.cmem_len, cfg.cmem_len > 0)  # (cmems: Compressive only)
        if cmems is None and cache is not None and cache.slots:
            raise ValueError("this cache holds compressed slots: read it with cmem_len > 0")
        if cmems is not None and padding is not None and bool(padding.any()):
            raise ValueError("a Compressive Transformer reads no padding: a group of c would compress it into a slot")
        seg = self._prepare(
            input_ids, inputs_embeds, joined(mems, cmems), cache, padding, attention_mask, key_mask, head_mask, read,
            ext_len,
        )  # fmt: skip
        usage = cmems is not None and cfg.compression == "most_used"  # (the attention each memory received)
        inputs = output_hidden_states or (cache is not None and cmems is not None)  # (the layer inputs compressed)
        h, hids, attns = self._run(seg, inputs, output_attentions or usage)  # every layer
        hids[-1] = h = self.drop(h)
        recon = new_mems = None
        if cache is not None and cmems is not None:
            compress_cached(self, cache, hids[:-1], attns, read, seg.T)  # (the segment is memory now)
        elif cache is not None:
            cache.end_segment(seg.T, read.mem_len)  # (the segment is memory now)
        elif cmems is not None and read.mem_len > 0:  # 12. the Compressive Transformer's two memories
            new_mems, recon = compress_memories(self, hids[:-1], mems, cmems, attns, read, seg.T, ext_len, detach_mems)
        else:
            new_mems = self._update_mems(hids[:-1], mems, seg.mlen, seg.T, read.mem_len, ext_len, detach_mems)
        return TransformerXLModelOutput(
            last_hidden_state=h,
            mems=new_mems,
            hidden_states=hids if output_hidden_states else None,
            attentions=attns if output_attentions else None,
            recon_loss=recon,
        )

    def _prepare(
        self, input_ids: Tensor | None, inputs_embeds: Tensor | None, mems: list[Tensor] | None,
        cache: KVCache | None, padding: Tensor | None, attention_mask: Tensor | None, key_mask: Tensor | None,
        head_mask: Tensor | None, read: Reading, ext_len: int,
    ) -> Segment:  # fmt: skip
        """The segment's input h (embedded, dropped out), its mask over the memory's and its keys, every layer's
        positional input and head mask: what the layers take."""
        cfg = self.config
        if read.same_length and read.mem_len <= 0:
            raise ValueError("same_length=True needs mem_len > 0")
        window = read.mem_len + max(read.cmem_len, 0) + int(cfg.tf_same_length)  # (the keys a query sees with
        # same_length, itself included: the compressed memory's slots too)
        word_emb, dev = self._embed(input_ids, inputs_embeds)  # [B, T, D]
        B, T = word_emb.shape[:2]
        if attention_mask is not None:
            if padding is not None:
                raise ValueError("pass padding (True = padding) or attention_mask (0 = padding), not both")
            padding = attention_mask.to(device=dev) == 0  # [B, T] or [B, M + T]
        heads = self._head_masks(head_mask)  # (per layer: [1, H, 1, 1] or None)
        if cache is None:
            mlen = self._check_mems(mems, B) if mems else 0
            if attention_mask is not None and mlen and padding.shape[-1] == T:
                padding = F.pad(padding, (mlen, 0), value=False)  # [B, M + T]: the memory's positions are tokens
            mask = None
            if _masks_any(T, mlen, read.same_length, window):
                mask = causal_mask(T, mlen, read.same_length, window, device=dev)  # [T, K]
            if padding is not None:
                if tuple(padding.shape) != (B, mlen + T):
                    raise ValueError(
                        f"padding must be [batch, M + T] = [{B}, {mlen + T}] without a cache, not {list(padding.shape)}"
                    )
                mask = _padding_mask(mask, padding, T, mlen)  # [B, 1, T, K]
            dtype = word_emb.dtype
        else:
            mlen, mask = self._prepare_cache(cache, B, T, mems, padding, read.same_length, window, ext_len)
            dev, dtype = cache.k.device, cache.k.dtype
        if key_mask is not None:
            mask = self._with_key_mask(mask, key_mask, B, T, mlen)  # [B, 1, T, K]
        # Each layer's positional input, built by the attention variant (attn_type) for the K = M + T keys.
        pos = self.attention.prepare(self, mlen + T, read.clamp_len, dtype, dev, cache)
        return Segment(self.drop(word_emb), T, mlen, mask, pos, heads, cache, mems, read, window)

    def _embed(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> tuple[Tensor, torch.device]:
        """The word embedding's output [B, T, D] of ``input_ids`` (checked against n_token), or ``inputs_embeds``."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give input_ids or inputs_embeds (the word embedding's output), one of them")
        if inputs_embeds is not None:
            if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.d_model:
                raise ValueError(
                    f"inputs_embeds must be [batch, seq_len, d_model={cfg.d_model}], got {tuple(inputs_embeds.shape)}"
                )
            return inputs_embeds, inputs_embeds.device
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        # (not in a graph being exported or compiled: a host read there; the ids are then the caller's to check)
        graph = torch.compiler.is_exporting() or torch.compiler.is_compiling()
        lo, hi = (0, 0) if graph else map(int, torch.aminmax(input_ids))
        if lo < 0 or hi >= cfg.n_token:
            raise ValueError(f"input_ids must be in [0, n_token={cfg.n_token}), got values in [{lo}, {hi}]")
        return self.word_emb(input_ids), input_ids.device

    def _run(self, s: Segment, want_hids: bool, want_attns: bool) -> tuple[Tensor, list[Tensor], list]:
        """Every layer on the segment: the output [B, T, D], every layer's input then the output, and the attention
        weights (where asked for). Without a cache the layers' forward; with one, the cached operations of
        txl.kernels (a step of one token, a segment), whose reference is this model's own
        :meth:`layers_forward` and :meth:`step`."""
        hids: list[Tensor] = [s.h]
        if s.cache is None:
            attns: list = []
            return self.layers_forward(s, want_attns, (hids, attns)), hids, attns  # (the inputs: the next memory)
        record = (hids, []) if want_hids or want_attns else None
        step = decode_step if s.T == 1 else segment_layers  # (the cached operations; the references are below)
        h = step(self, s, record, want_attns)
        if record is None:
            hids.append(h)
        return h, hids, record[1] if record else []

    def layers_forward(self, s: Segment, need_weights: bool = False, record: tuple[list, list] | None = None) -> Tensor:
        """Every layer's forward on the segment ``s`` (the layer's own, compiled where it pays): [B, T, D]; with
        ``record`` (lists), each layer's output and attention weights appended to them."""
        h = s.h
        for i, layer in enumerate(self.layers):
            kw = dict(mem=s.mems[i] if s.mems else None, need_weights=need_weights, cache=s.cache, layer=i)
            if s.heads[i] is not None:
                kw["head_mask"] = s.heads[i]
            h, prob = layer_call(layer, h, s.pos[i], s.mask, **kw)
            if record is not None:
                record[0].append(h)
                record[1].append(prob)
        return h

    def step(self, s: Segment, record: tuple[list, list] | None = None) -> Tensor:
        """The plain one-token step: every layer for one new position per row ``s.h`` [B, 1, D] with a cache
        (inference, attn_type 0), each layer's :meth:`TransformerXLLayer.step` over the cache's window; ``record``:
        each layer's output appended. What :meth:`layers_forward` computes for one position, without the general
        path's module calls, attribute lookups, checks and shift (for one token they cost more than the arithmetic,
        about 15 MFLOP for the bench-char model; the native decode's reference)."""
        cache, mask, h = s.cache, s.mask, s.h
        product = rows_linear(h, self.layers[0].attn.qkv_net.weight.dtype)  # = linear(x, weight), checked once
        for i, (layer, p) in enumerate(zip(self.layers, s.pos, strict=True)):

            def positional(q: Tensor, K: int, attn: nn.Module = layer.attn, p: RelPositions = p) -> tuple:
                q_w, bd = attn.scores(q.transpose(1, 2), p, K)  # (q + u) / sqrt(Dh); (b)+(d), [B, H, 1, K]
                return q_w, bd if mask is None else mask_scores(bd, mask, inplace=True)  # (same_length, padding)

            h = layer.step(h, functools.partial(cache.append, i), positional, product)  # [B, 1, D]
            if record is not None:
                record[0].append(h)
        return h

    @staticmethod
    def _with_key_mask(mask: Tensor | None, key_mask: Tensor, B: int, T: int, mlen: int) -> Tensor:
        """The causal ``mask`` ([T, K], [B, 1, T, K] or None) with ``key_mask`` [B, T, K] masked too: [B, 1, T, K]."""
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, T, mlen + T):
            raise ValueError(
                f"key_mask must be a bool tensor [batch, T, M + T] = [{B}, {T}, {mlen + T}], got "
                f"{key_mask.dtype} {list(key_mask.shape)}"
            )
        causal = mask if mask is not None else causal_mask(T, mlen, False, 0, device=key_mask.device)
        return causal | key_mask[:, None]  # [B, 1, T, K]

    def _head_masks(self, head_mask: Tensor | None) -> list[Tensor | None]:
        """Each layer's head mask as [1, H, 1, 1] (None: every head kept), from [n_head] (all layers) or [n_layer,
        n_head] (Hugging Face's shapes)."""
        cfg = self.config
        if head_mask is None:
            return [None] * cfg.n_layer
        if head_mask.dim() == 1 and head_mask.shape[0] == cfg.n_head:
            head_mask = head_mask.expand(cfg.n_layer, -1)
        if tuple(head_mask.shape) != (cfg.n_layer, cfg.n_head):
            raise ValueError(
                f"head_mask must be [n_head={cfg.n_head}] or [n_layer={cfg.n_layer}, n_head={cfg.n_head}], got "
                f"{tuple(head_mask.shape)}"
            )
        return [m.view(1, cfg.n_head, 1, 1) for m in head_mask.unbind(0)]

    def fill_cache(self, cache: KVCache, mems: list[Tensor], mem_len: int | None = None) -> None:
        """Start an empty ``cache`` from a memory of layer inputs ``mems`` (``n_layer`` tensors [B, M, d_model], e.g.
        Hugging Face's zero memory): its keys and values, as a segment of M positions would have left them."""
        if cache.length:
            raise ValueError("fill_cache starts a cache: this one already holds a memory")
        plain, cmems = split_mems(mems, self.config.n_layer, int(cache.compressive), cache.compressive)
        M = self._check_mems(plain, cache.k.shape[1])
        if cmems:  # (a Compressive Transformer's slots first: [compressed memory; memory], one position each)
            plain = [torch.cat([cm, m], dim=1) for cm, m in zip(cmems, plain, strict=True)]
        S = plain[0].shape[1] - M
        cache.begin(S + M)
        for i, (layer, mem) in enumerate(zip(self.layers, plain, strict=True)):
            cache.append(i, *layer.attn.memory_keys_values(mem.to(cache.k)))
        if cache.compressive:  # (the memory's layer inputs kept; all of it: up to c - 1 positions past mem_len)
            cache.hidden[:, :, 0, cache.end + S : cache.end + S + M] = torch.stack(plain)[:, :, S:].to(cache.hidden)
            cache.slots, cache.end = S, cache.end + S + M
        else:
            cache.end_segment(M, self.config.mem_len if mem_len is None else mem_len)

    def _prepare_cache(self, cache: KVCache, B, T, mems, padding, same_length, window, ext_len):
        """The memory length and the mask ([T, K], or [B, 1, T, K] with padding) of a cache about to take a segment
        of T positions (``window``: the keys a query sees with ``same_length``)."""
        if mems or ext_len:
            raise ValueError("a KVCache holds the memory: pass no mems, and no ext_len (a training setting)")
        if self.training or torch.is_grad_enabled():
            raise ValueError("a KVCache is for inference with fixed weights: use model.eval() and torch.no_grad()")
        if cache.k.shape[1] != B:
            raise ValueError(f"the cache holds {cache.k.shape[1]} rows, the input {B}")
        mlen = cache.length  # (a Compressive Transformer's slots included: the window's first positions)
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
