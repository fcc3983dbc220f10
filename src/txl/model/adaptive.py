"""7. Adaptive input (Baevski & Auli) and the projected adaptive log-softmax (Grave et al.)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.kernels.admission import stock
from txl.kernels.linear import output_logits, plain_linear, projection
from txl.kernels.nll import adaptive_nll, cluster_nll
from txl.model.attention import at_least_fp32
from txl.model.config import TransformerXLConfig

# ---------------------------------------------------------------------------------------------------------
# 7. Adaptive input (Baevski & Auli) and projected adaptive log-softmax (Grave et al.).
#    Cluster i covers token ids [ends[i], ends[i+1]) with ends = [0, *cutoffs, n_token]; its width is
#    d_embed // div_val**i. With div_val == 1 there is one table (and one projection iff d_embed != d_model).
# ---------------------------------------------------------------------------------------------------------


def _cluster_dims(cfg: TransformerXLConfig) -> list[int]:
    if cfg.div_val == 1:
        return [cfg.d_embed]
    return [cfg.d_embed // cfg.div_val**i for i in range(cfg.n_clusters + 1)]


def _has_projs(cfg: TransformerXLConfig) -> bool:
    return cfg.div_val > 1 or cfg.d_embed != cfg.d_model


@stock
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


def input_dtype(layer: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype a layer takes: its floating-point weight's, else ``default`` (a quantized layer, whose ``weight``
    is a method returning int8 values, takes floats: torch.ao's dynamic quantization)."""
    w = getattr(layer, "weight", None)
    return w.dtype if isinstance(w, Tensor) and w.is_floating_point() else default


@stock
class ProjectedAdaptiveLogSoftmax(nn.Module):
    """log p(token | h). Head = shortlist tokens + one logit per tail cluster (tail i <-> head column
    cutoffs[0] + i - 1, the Hugging Face order; then -inf columns up to a multiple of ``HEAD_ALIGN``); log p(tail
    token) = head log-prob of its cluster + tail log-prob. Computed in fp32 (under autocast, the products'
    operands may be in its dtype: :func:`~txl.kernels.linear.logits_linear`)."""

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

    def _weights(self) -> list[tuple[Tensor, Tensor]]:
        """Each cluster's output weight [n_i, d_i] and bias [n_i]. With div_val 1 the clusters are row blocks of one
        layer, taken by one ``split`` per forward: its backward writes the blocks' gradients into one tensor (a slice
        per cluster would each add a zero-filled gradient of the whole vocabulary)."""
        if self.div_val > 1:
            return [(layer.weight, layer.bias) for layer in self.out_layers]
        out = self.out_layers[0]
        sizes = [r - l for l, r in zip(self.ends[:-1], self.ends[1:], strict=True)]
        return list(zip(out.weight.split(sizes), out.bias.split(sizes), strict=True))

    def _cluster_params(
        self, i: int, weights: list[tuple[Tensor, Tensor]] | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Weight [n_i, d_i], bias [n_i] and projection [d_model, d_i] (or None) of cluster i, fp32 (``weights``:
        this forward's :meth:`_weights`)."""
        w, b = (weights or self._weights())[i]
        if i == 0 and self.n_clusters > 0:
            pad = -(w.shape[0] + self.n_clusters) % HEAD_ALIGN if HEAD_ALIGN else 0
            w = torch.cat([w, self.cluster_weight, w.new_zeros(pad, w.shape[1])], dim=0)
            b = torch.cat([b, self.cluster_bias, b.new_full((pad,), float("-inf"))], dim=0)
        proj = at_least_fp32(self.out_projs[i]) if len(self.out_projs) else None
        return at_least_fp32(w), at_least_fp32(b), proj

    def _project(self, h: Tensor, i: int, autocast: torch.dtype | None = None) -> Tensor:
        """``h`` [N, d_model] in cluster i's input width, [N, d_i]."""
        return projection(h, at_least_fp32(self.out_projs[i]), autocast) if len(self.out_projs) else h

    def _logits(
        self, h: Tensor, i: int, projected: bool = False, autocast: torch.dtype | None = None, weights=None
    ) -> Tensor:
        """Cluster i's logits [N, n_i (+ clusters, padding: head)], fp32; ``autocast``: the caller's autocast dtype
        (the products' precision is :func:`~txl.kernels.linear.logits_linear`'s to choose)."""
        hp = h if projected else self._project(h, i, autocast)
        if not self.plain():
            return self._called_logits(hp, i)
        params = lambda: self._cluster_params(i, weights)[:2]  # noqa: E731
        return output_logits(hp, params, autocast, (id(self), i, HEAD_ALIGN), self._sources(i))

    def plain(self) -> bool:
        """Whether the output layers are plain ``nn.Linear`` with no hooks: then their weights are read (one row
        block per cluster, packed copies in inference); any other layer (an adapter, a quantised one) is called."""
        return all(plain_linear(layer) for layer in self.out_layers)

    def _called_logits(self, hp: Tensor, i: int) -> Tensor:
        """Cluster i's logits from a call of its output layer (the whole layer with div_val 1, its rows sliced):
        what :meth:`_logits` computes from the weights, for a layer that is not plain. fp32 [N, n_i (+ clusters,
        padding: head)]."""
        layer = self.out_layers[0 if self.div_val == 1 else i]
        y = layer(hp.to(input_dtype(layer, hp.dtype))).float()  # [N, n] (the whole vocabulary with div_val 1)
        if self.div_val == 1:
            y = y[:, self.ends[i] : self.ends[i + 1]]
        if i == 0 and self.n_clusters > 0:
            pad = -(y.shape[1] + self.n_clusters) % HEAD_ALIGN if HEAD_ALIGN else 0
            heads = F.linear(hp, at_least_fp32(self.cluster_weight), at_least_fp32(self.cluster_bias))
            y = torch.cat([y, heads, y.new_full((y.shape[0], pad), float("-inf"))], dim=1)
        return y

    def _sources(self, i: int) -> list[Tensor]:
        """The parameters that cluster i's output weight and bias are made from."""
        layer = self.out_layers[0 if self.div_val == 1 else i]
        sources = [layer.weight, layer.bias]
        return sources + [self.cluster_weight, self.cluster_bias] if i == 0 and self.n_clusters > 0 else sources

    def _log_softmax(self, h: Tensor, i: int, autocast: torch.dtype | None = None, weights=None) -> Tensor:
        return F.log_softmax(self._logits(h, i, autocast=autocast, weights=weights), dim=-1)

    def forward(self, hidden: Tensor, targets: Tensor | None = None, return_log_probs: bool = False):
        """``hidden`` [N, d_model], ``targets`` [N] (-100 = ignore).

        Returns (per-token NLL [N] in input order (0 where ignored) or None, log-probs [N, V] or None).
        """
        dev = hidden.device.type
        autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        with torch.autocast(dev, enabled=False) if autocast else contextlib.nullcontext():
            h = at_least_fp32(hidden)
            weights = self._weights() if self.plain() else None  # (a layer that is not plain is called)
            if targets is not None and not return_log_probs:  # (the loss alone: a native backend may compute it)

                def reference() -> Tensor:
                    return self._nll(h, self._log_softmax(h, 0, autocast, weights), None, targets, autocast, weights)

                if not self.plain():  # (the native backends read the weights)
                    return reference(), None
                return adaptive_nll(self, h, reference, lambda: self._nll_native(h, targets, weights)), None
            head = self._log_softmax(h, 0, autocast, weights)  # [N, shortlist + n_clusters (+ -inf columns)]
            nll = log_probs = None
            if return_log_probs and self.n_clusters == 0:
                log_probs = head  # [N, V]
            elif return_log_probs:
                parts = [head[:, : self.shortlist]]
                for i in range(1, self.n_clusters + 1):
                    parts.append(head[:, self.shortlist + i - 1, None] + self._log_softmax(h, i, autocast, weights))
                log_probs = torch.cat(parts, dim=-1)  # [N, V]
            if targets is not None:
                nll = self._nll(h, head, log_probs, targets, autocast, weights)
        return nll, log_probs

    def _clusters(self, targets: Tensor) -> tuple[Tensor, Tensor, list[tuple[int, Tensor]]]:
        """``targets != -100``, the targets with the ignored ones at 0, and the rows [n_i] of each tail cluster i that
        has targets, after checking that the targets are token ids: one read by the host for all of it (the check and
        the clusters' sizes), so that a GPU waits once per loss, not once per cluster. Without tail clusters, code
        being compiled reads nothing (no graph break); with them, that one read is the graph's one break."""
        valid = targets != -100
        t = targets.where(valid, 0)
        if not self.n_clusters and torch.compiler.is_compiling():
            return valid, t, []  # (in a graph, no host read: the targets are the caller's to check)
        bad = (((targets < 0) & valid) | (targets >= self.n_token)).any()
        cluster, sizes = None, bad.new_zeros(0, dtype=torch.long)
        if self.n_clusters:
            cluster = sum((t >= c).long() for c in self.ends[1:-1])  # [N] (0: head)
            # each tail's size, counted into a fixed shape (bincount's shape depends on the data: a graph break)
            ids = torch.arange(1, self.n_clusters + 1, device=t.device)  # [n_clusters] (the tails' cluster ids)
            sizes = (cluster[None] == ids[:, None]).sum(1)
        bad, *sizes = torch.cat([bad.long()[None], sizes]).tolist()
        if bad:
            raise ValueError(f"targets must be in [0, {self.n_token}) or -100 (ignored)")
        tails = [(i, torch.nonzero_static(cluster == i, size=n)[:, 0]) for i, n in enumerate(sizes, 1) if n]
        return valid, t, tails

    def _nll_native(self, h: Tensor, targets: Tensor, weights=None) -> Tensor:
        """``_nll`` with each cluster's loss from :mod:`txl.kernels.native` (``_cluster_nll``: no log-softmax tensor): a
        token's head term reads its own column, or its cluster's for a tail token."""
        valid, t, tails = self._clusters(targets)
        col = targets.where(valid, -1)  # [N] head column of each token (-1: ignored)
        for i, idx in tails:
            col = col.index_fill(0, idx, self.shortlist + i - 1)
        nll = self._cluster_nll(h, 0, col, weights)  # [N]
        for i, idx in tails:
            tail = self._cluster_nll(h.index_select(0, idx), i, t[idx] - self.ends[i], weights)
            nll = nll.index_add(0, idx, tail)
        return nll

    def _cluster_nll(self, h: Tensor, i: int, target: Tensor, weights=None) -> Tensor:
        """Cluster i's NLL of ``target`` [n] for the rows ``h`` [n, d_model], from its logits; in evaluation
        :func:`txl.kernels.nll.cluster_nll` may compute it from a packed copy of the cluster's output layer (its
        weight and bias: ``sources``, the copy remade when they change), with no logits stored."""
        hp = self._project(h, i)  # [n, d_i]
        return cluster_nll(
            hp, target, lambda: self._logits(hp, i, projected=True, weights=weights),
            lambda: self._cluster_params(i)[:2], ("crit", id(self), i, HEAD_ALIGN), self._sources(i),
        )  # fmt: skip

    def _nll(
        self,
        h: Tensor,
        head: Tensor,
        log_probs: Tensor | None,
        targets: Tensor,
        autocast: torch.dtype | None = None,
        weights=None,
    ) -> Tensor:
        valid, t, tails = self._clusters(targets)
        if log_probs is not None:
            return -log_probs.gather(1, t[:, None]).squeeze(1) * valid
        # Head tokens read the head directly; a tail cluster's logits are computed only for its own targets.
        lp = head.gather(1, t.clamp(max=self.shortlist - 1)[:, None]).squeeze(1)  # [N]
        for i, idx in tails:
            l = self.ends[i]
            tail = self._log_softmax(h.index_select(0, idx), i, autocast, weights)  # [n_i, r - l]
            lp_i = head[idx, self.shortlist + i - 1] + tail.gather(1, (t[idx] - l)[:, None]).squeeze(1)
            lp = lp.index_copy(0, idx, lp_i)  # stays in input order
        return -lp * valid
