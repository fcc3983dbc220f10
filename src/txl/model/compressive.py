"""12. The Compressive Transformer (Rae, Potapenko, Jayakumar, Lillicrap, "Compressive Transformers for Long-Range
Sequence Modelling", ICLR 2020): Transformer-XL whose memories are not discarded when they fall out of the memory.
Design notes: docs/internals.md#txlmodelcompressive."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from txl.kernels.admission import stock
from txl.model.config import TransformerXLConfig


@stock
class Pooling(nn.Module):
    """Max or mean pooling with kernel = stride = c: [B, G c, D] -> [B, G, D]."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.c, self.kind = cfg.cmem_ratio, cfg.compression

    def forward(self, old: Tensor, usage: Tensor | None = None) -> Tensor:
        groups = old.unflatten(1, (-1, self.c))  # [B, G, c, D]
        return groups.amax(2) if self.kind == "max" else groups.mean(2)


@stock
class ConvCompression(nn.Module):
    """A 1D convolution with kernel = stride = c (``dilated_conv``: a stack of kernel-2 convolutions with dilations
    1, 2, 4, ... covering each group of c exactly): [B, G c, D] -> [B, G, D]."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        D, c = cfg.d_model, cfg.cmem_ratio
        self.c = c
        self.strided = cfg.compression == "conv" or c == 1  # (one convolution over the whole sequence)
        if self.strided:
            self.convs = nn.ModuleList([nn.Conv1d(D, D, c, stride=c)])
        else:
            dilations, reach = [], 1  # (each kernel-2 layer adds its dilation to the receptive field)
            while reach < c:
                d = min(reach, c - reach)
                dilations.append(d)
                reach += d
            self.convs = nn.ModuleList([nn.Conv1d(D, D, 2, dilation=d) for d in dilations])

    def forward(self, old: Tensor, usage: Tensor | None = None) -> Tensor:
        B, n, D = old.shape
        if self.strided:
            return self.convs[0](old.transpose(1, 2)).transpose(1, 2)  # [B, G, D]
        x = old.reshape(B * (n // self.c), self.c, D).transpose(1, 2)  # each group alone: [B G, D, c]
        for i, conv in enumerate(self.convs):
            x = conv(x if i == 0 else F.relu(x))
        return x.reshape(B, n // self.c, D)  # (one output per group)


@stock
class MostUsed(nn.Module):
    """Of each group of c memories, the one that received the most attention (``usage`` [B, G c]): [B, G, D]."""

    def __init__(self, cfg: TransformerXLConfig):
        super().__init__()
        self.c = cfg.cmem_ratio

    def forward(self, old: Tensor, usage: Tensor | None = None) -> Tensor:
        B, n, D = old.shape
        if usage is None:
            raise ValueError("compression most_used needs the attention each memory received (usage)")
        pick = usage.unflatten(1, (-1, self.c)).argmax(-1)  # [B, G]
        first = torch.arange(0, n, self.c, device=old.device)  # [G]
        return old.gather(1, (first + pick)[..., None].expand(B, -1, D))


def make_compression(cfg: TransformerXLConfig) -> nn.Module:
    """The compression function f_c of one layer, as ``cfg.compression`` names it."""
    if cfg.compression in ("max", "mean"):
        return Pooling(cfg)
    if cfg.compression == "most_used":
        return MostUsed(cfg)
    return ConvCompression(cfg)


def evicted(n: int, mem_len: int, c: int) -> int:
    """Of ``n`` positions (memory then segment), how many leave the memory to be compressed: the oldest whole groups
    of c beyond the last ``mem_len`` (fewer than c wait in the memory for the next segment)."""
    return max(0, n - mem_len) // c * c


def _usage(cfg: TransformerXLConfig, attns: list, i: int, first: int, n: int) -> Tensor | None:
    """most_used's: the attention layer ``i``'s keys ``first`` .. ``first + n`` received, averaged over the heads
    and the queries ([B, n]); None for the other functions."""
    return attns[i].mean((1, 2))[:, first : first + n] if cfg.compression == "most_used" else None


def content_attention(attn: nn.Module, h: Tensor, m: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v of the queries of ``h`` [B, T, D] over the keys and values of ``m`` [B, S, D]
    by the attention module's own input norm (pre_lnorm) and projection, their weights held fixed (the
    reconstruction loss trains f_c alone): [B, T, H Dh]."""
    fixed = {name: p.detach() for name, p in attn.named_parameters()}

    def project(x: Tensor) -> Tensor:  # [B, S, 3 H Dh]
        if attn.pre_lnorm:
            x = functional_call(attn.layer_norm, _sub(fixed, "layer_norm."), (x,))
        return functional_call(attn.qkv_net, _sub(fixed, "qkv_net."), (x,))

    H, Dh = attn.n_head, attn.d_head
    q = project(h).unflatten(-1, (3, H, Dh))[:, :, 0].transpose(1, 2)  # [B, H, T, Dh]
    k, v = project(m).unflatten(-1, (3, H, Dh))[:, :, 1:].permute(2, 0, 3, 1, 4)  # [B, H, S, Dh] each
    vec = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)  # [B, H, T, Dh]
    return vec.transpose(1, 2).flatten(2)


def _sub(params: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def reconstruction_loss(attn: nn.Module, h: Tensor, old: Tensor, compressed: Tensor) -> Tensor:
    """The attention-reconstruction loss of one layer: || attn(h, old) - attn(h, compressed) ||^2 (the mean over
    the elements), with ``h`` and ``old`` stop-gradients: only ``compressed`` (f_c's output) carries a gradient."""
    h, old = h.detach(), old.detach()
    with torch.no_grad():
        target = content_attention(attn, h, old)
    return F.mse_loss(content_attention(attn, h, compressed).float(), target.float())


def split_mems(
    mems: list[Tensor] | None, n_layer: int, cmem_len: int, compressive: bool
) -> tuple[list[Tensor] | None, list[Tensor] | None]:
    """A forward's ``mems`` as (the memory, the compressed memory): n_layer tensors [B, M, D], then (reading with
    ``cmem_len`` > 0) n_layer tensors [B, Mc, D] of compressed slots (absent: none yet). The compressed memory is
    None for a Transformer-XL reading, [] when it holds nothing yet."""
    if cmem_len <= 0:
        if mems and len(mems) == 2 * n_layer:
            raise ValueError(
                f"mems holds a compressed memory (2 x n_layer = {2 * n_layer} tensors), and this call reads "
                "without one (cmem_len 0): pass mems[:n_layer], or read with cmem_len > 0"
            )
        return mems, None
    if not compressive:
        raise ValueError(
            f"cmem_len = {cmem_len}: this model has no compression function (its config's cmem_len is 0): "
            "read it with cmem_len 0"
        )
    if not mems or len(mems) == n_layer:
        return mems, []
    if len(mems) != 2 * n_layer:
        raise ValueError(
            f"mems must be n_layer = {n_layer} tensors (the memory), or 2 x n_layer = {2 * n_layer} (the memory, "
            f"then the compressed memory), got {len(mems)}"
        )
    plain, compressed = list(mems[:n_layer]), list(mems[n_layer:])
    want = (plain[0].shape[0], plain[0].shape[2])
    shapes = [tuple(t.shape) for t in compressed]
    if any(len(s) != 3 or (s[0], s[2]) != want or s[1] != shapes[0][1] for s in shapes):
        raise ValueError(f"the compressed memories (mems[{n_layer}:]) must be [batch, Mc, d_model] each, got {shapes}")
    return plain, compressed


def joined(mems: list[Tensor] | None, cmems: list[Tensor] | None) -> list[Tensor] | None:
    """What each layer attends to before its segment: [compressed memory; memory], per layer."""
    if not cmems or not cmems[0].shape[1]:
        return mems
    return [torch.cat([cm, m], dim=1) for cm, m in zip(cmems, mems, strict=True)]


def compress_memories(
    model: nn.Module, hids: list[Tensor], mems: list[Tensor] | None, cmems: list[Tensor], attns: list,
    read: object, T: int, ext_len: int, detach: bool,
) -> tuple[list[Tensor], Tensor | None]:  # fmt: skip
    """The next memory of a segment: each layer's last ``mem_len`` inputs (``hids``, [B, T, D] each, after its
    memory ``mems``), the oldest whole groups of c beyond them compressed by the layer's f_c onto its compressed
    memory (the last ``cmem_len`` slots kept); returned as ``mems`` is taken (the memory, then the compressed
    memory). With gradients on, also the attention-reconstruction loss (0 with nothing compressed: f_c still takes
    part, as DDP needs), else None. ``attns``: each layer's attention [B, H, T, K] (most_used reads it)."""
    cfg = model.config
    Mc = cmems[0].shape[1] if cmems else 0
    M = mems[0].shape[1] if mems else 0
    end = M + max(0, T - ext_len)
    train = torch.is_grad_enabled()
    new_mems, new_cmems, losses = [], [], []
    n = evicted(end, read.mem_len, cfg.cmem_ratio)
    for i, (h, f_c) in enumerate(zip(hids, model.compress, strict=True)):
        full = (torch.cat([mems[i], h], dim=1) if mems else h)[:, :end]  # [B, M + T', D]
        old, kept = full[:, :n], full[:, n:]  # (to compress, [B, G c, D]; the memory kept)
        cm = cmems[i] if cmems else full.new_zeros(full.shape[0], 0, full.shape[2])
        if n:
            new = f_c(old.detach(), _usage(cfg, attns, i, Mc, n))  # [B, G, D]
            if train:
                losses.append(reconstruction_loss(model.layers[i].attn, h, old, new))
            cm = torch.cat([cm, new.detach()], dim=1)[:, -read.cmem_len :]
        new_mems.append(kept.detach() if detach else kept)
        new_cmems.append(cm)
    if train and not losses:  # (nothing compressed yet: f_c's parameters still take part, as DDP needs)
        losses = [p.sum() * 0.0 for p in model.compress.parameters()]
    return new_mems + new_cmems, sum(losses, hids[0].new_zeros(())) if train else None


def compress_cached(model: nn.Module, cache: object, hids: list[Tensor], attns: list, read: object, T: int) -> None:
    """:func:`compress_memories` on a K/V cache (``txl.model.cache.KVCache``) after a segment of T positions. The
    cache's window is [slots; memory; segment] in its buffer: the layers' inputs ``hids`` are kept at the segment's
    positions, the oldest whole groups of c beyond the last ``mem_len`` are compressed by each layer's f_c and
    projected by its attention into keys and values, and the slots (the last ``cmem_len`` of the old and the new)
    are written just before the memory that remains, which is where the window then starts: the attention, the
    positions and the one-token kernels read one contiguous window, as for Transformer-XL."""
    cfg, start, end, S = model.config, cache.start, cache.end, cache.slots
    cache.hidden[:, :, 0, end : end + T] = torch.stack(hids)  # [L, B, T, D]
    memory = start + S  # (the memory's first position)
    n = evicted(end + T - memory, read.mem_len, cfg.cmem_ratio)
    cache.end = end + T
    if not n:
        return
    G = n // cfg.cmem_ratio
    keep = max(0, min(S, read.cmem_len - G))  # (old slots kept, the newest of them)
    new = min(G, read.cmem_len)
    first = memory + n - keep - new  # (>= start: the evicted positions make room for the new slots)
    for name in ("k", "v"):  # the kept slots moved up to just before the new ones (source before destination)
        t = getattr(cache, name)
        t[:, :, :, first : first + keep] = t[:, :, :, memory - keep : memory].clone()
    for i, (layer, f_c) in enumerate(zip(model.layers, model.compress, strict=True)):
        old = cache.hidden[i, :, 0, memory : memory + n]  # [B, G c, D]
        kv = layer.attn.memory_keys_values(f_c(old, _usage(cfg, attns, i, S, n))[:, G - new :])  # [2, B, H, new, Dh]
        cache.k[i, :, :, first + keep : first + keep + new] = kv[0]
        cache.v[i, :, :, first + keep : first + keep + new] = kv[1]
    cache.start, cache.slots = first, keep + new
