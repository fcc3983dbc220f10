"""The network in Keras 3 (``keras.ops``: one definition for TensorFlow, JAX and PyTorch), section by section as the
paper and ``txl.model`` have it: the adaptive input, the sinusoid table R, the relative attention with Appendix B's
shift, the position-wise feed-forward layer, the layer, and the projected adaptive log-softmax.
Design notes: docs/internals.md#txlkeraslayers."""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from txl.model.config import TransformerXLConfig

MASKED = -1e30
"""The score of a masked key (its probability is exactly 0 after the softmax), as Hugging Face's TransfoXL."""


def _normal(std: float) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=std)


def weight_init(cfg: TransformerXLConfig) -> keras.initializers.Initializer:
    """A weight's initialisation, as txl's (the original ``weights_init``): U(-init_range, init_range) with
    ``init="uniform"``, else N(0, init_std)."""
    if cfg.init == "uniform":
        return keras.initializers.RandomUniform(-cfg.init_range, cfg.init_range)
    return _normal(cfg.init_std)


def _layer_norm(cfg: TransformerXLConfig) -> keras.layers.LayerNormalization:
    """A LayerNorm initialised as txl's: gamma ~ N(1, init_std), beta 0."""
    gamma = keras.initializers.RandomNormal(mean=1.0, stddev=cfg.init_std)
    return keras.layers.LayerNormalization(epsilon=cfg.layer_norm_epsilon, gamma_initializer=gamma, name="layer_norm")


def linear(x: Any, kernel: Any, bias: Any = None) -> Any:
    """``x @ kernel.T + bias`` with PyTorch's ``[out, in]`` kernel."""
    y = ops.matmul(x, ops.transpose(kernel))
    return y if bias is None else y + bias


# ---------------------------------------------------------------------------------------------------------
# Adaptive input (Baevski & Auli): cluster i covers ids [ends[i], ends[i+1]), width d_embed // div_val**i, then a
# projection to d_model; times sqrt(d_model).
# ---------------------------------------------------------------------------------------------------------


def cluster_dims(cfg: TransformerXLConfig) -> list[int]:
    return [cfg.d_embed] if cfg.div_val == 1 else [cfg.d_embed // cfg.div_val**i for i in range(cfg.n_clusters + 1)]


def has_projections(cfg: TransformerXLConfig) -> bool:
    return cfg.div_val > 1 or cfg.d_embed != cfg.d_model


@keras.saving.register_keras_serializable(package="txl")
class AdaptiveEmbedding(keras.layers.Layer):
    """Hugging Face's ``TFAdaptiveEmbedding``: token ids ``[B, T]`` -> embeddings ``[B, T, d_model]``."""

    def __init__(self, config: TransformerXLConfig, **kwargs: Any):
        super().__init__(**kwargs)
        cfg = self.config = config
        self.ends = [0, *cfg.cutoffs, cfg.n_token]
        self.emb_scale = cfg.d_model**0.5
        sizes = [cfg.n_token] if cfg.div_val == 1 else [r - l for l, r in zip(self.ends, self.ends[1:], strict=False)]
        dims = cluster_dims(cfg)
        self.emb_layers = [
            self.add_weight(shape=(n, d), initializer=weight_init(cfg), name=f"emb_layers_{i}")
            for i, (n, d) in enumerate(zip(sizes, dims, strict=True))
        ]
        n_proj = len(dims) if has_projections(cfg) else 0
        self.emb_projs = [
            self.add_weight(shape=(cfg.d_model, dims[i]), initializer=_normal(cfg.proj_init_std), name=f"emb_projs_{i}")
            for i in range(n_proj)
        ]

    def _project(self, i: int, x: Any) -> Any:
        return linear(x, self.emb_projs[i]) if self.emb_projs else x

    def call(self, input_ids: Any) -> Any:  # [B, T] -> [B, T, d_model]
        ids = ops.cast(input_ids, "int32")
        if len(self.emb_layers) == 1:
            return self._project(0, ops.take(self.emb_layers[0], ids, axis=0)) * self.emb_scale
        out = None  # every cluster embeds every token at a clamped index; where() keeps the right one (static shapes)
        for i, (l, r) in enumerate(zip(self.ends, self.ends[1:], strict=False)):
            emb = self._project(i, ops.take(self.emb_layers[i], ops.clip(ids - l, 0, r - l - 1), axis=0))
            inside = ops.expand_dims(ops.logical_and(ids >= l, ids < r), -1)
            out = emb if out is None else ops.where(inside, emb, out)
        return out * self.emb_scale

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AdaptiveEmbedding:
        config = dict(config)
        return cls(TransformerXLConfig.from_dict(config.pop("config")), **config)


# ---------------------------------------------------------------------------------------------------------
# The relative positional encoding R (Sec. 3.3): sinusoids of the distances K-1, ..., 0 (sin half, cos half).
# ---------------------------------------------------------------------------------------------------------


def sinusoid_embedding(klen: int, d_model: int, clamp_len: int = -1) -> Any:
    """R ``[K, D]`` for the distances ``klen-1, ..., 0``, clamped at ``clamp_len`` (> 0)."""
    pos_seq = ops.arange(klen - 1, -1, -1, dtype="float32")  # [K]
    if clamp_len > 0:
        pos_seq = ops.minimum(pos_seq, float(clamp_len))
    inv_freq = 1.0 / (10000.0 ** (ops.arange(0, d_model, 2, dtype="float32") / d_model))  # [D/2]
    sinusoid = ops.expand_dims(pos_seq, 1) * ops.expand_dims(inv_freq, 0)  # [K, D/2]
    return ops.concatenate([ops.sin(sinusoid), ops.cos(sinusoid)], axis=-1)


def rel_shift(x: Any) -> Any:
    """Appendix B: ``[..., T, K]`` scores by distance -> by key, ``out[.., i, j] = x[.., i, j + T-1-i]`` (a zero column
    in front, the rows read shifted; the entries j > M+i, which causality masks, read the next row)."""
    *lead, T, K = x.shape
    padded = ops.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])  # [.., T, K+1]
    padded = ops.reshape(padded, (*lead, K + 1, T))[..., 1:, :]  # [.., K, T]
    return ops.reshape(padded, (*lead, T, K))


def causal_mask(qlen: int, mlen: int, same_length: bool, window: int) -> Any:
    """Boolean ``[T, K]``, True = masked: query i (absolute M+i) sees key j iff j <= M+i, and with ``same_length`` only
    the last ``window`` keys up to itself."""
    i = ops.expand_dims(ops.arange(qlen), 1) + mlen
    j = ops.expand_dims(ops.arange(mlen + qlen), 0)
    mask = j > i
    if same_length:
        mask = ops.logical_or(mask, j <= i - window)
    return mask


# ---------------------------------------------------------------------------------------------------------
# The relative multi-head attention: A_ij = (q_i + u).k_j + (q_i + v).W_kR R_{i-j}, the second term shifted.
# ---------------------------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="txl")
class RelPartialLearnableMultiHeadAttn(keras.layers.Layer):
    """One layer's attention over [memory; segment], with its residual and layer norm (post-LN or pre-LN)."""

    def __init__(self, config: TransformerXLConfig, **kwargs: Any):
        super().__init__(**kwargs)
        cfg = self.config = config
        H, Dh, D = cfg.n_head, cfg.d_head, cfg.d_model
        init = weight_init(cfg)
        self.qkv_net = self.add_weight(shape=(3 * H * Dh, D), initializer=init, name="qkv_net")  # [W_q; W_kE; W_v]
        self.o_net = self.add_weight(shape=(D, H * Dh), initializer=init, name="o_net")
        self.r_net = self.add_weight(shape=(H * Dh, D), initializer=init, name="r_net")  # W_kR
        self.layer_norm = _layer_norm(cfg)
        with keras.name_scope(self.name):  # (its variables' paths under this layer's: unique in the model)
            self.layer_norm.build((None, D))
        self.drop = keras.layers.Dropout(cfg.dropout)
        self.dropatt = keras.layers.Dropout(cfg.dropatt)
        self.scale = 1.0 / math.sqrt(Dh)

    def call(
        self,
        h: Any,
        pos_emb: Any,
        u: Any,
        v: Any,
        mask: Any,
        mem: Any = None,
        head_mask: Any = None,
        training: bool = False,
    ) -> tuple[Any, Any]:
        """``h`` [B, T, D], ``pos_emb`` R [K, D], ``u``/``v`` [H, Dh], ``mask`` [T, K] (True = masked), ``mem``
        [B, M, D] or None, ``head_mask`` [H] or None. Returns the layer's output [B, T, D] and the probabilities
        [B, H, T, K]."""
        cfg = self.config
        B, T = ops.shape(h)[0], h.shape[1]
        H, Dh = cfg.n_head, cfg.d_head
        cat = h if mem is None else ops.concatenate([mem, h], axis=1)  # [B, K, D]
        K = cat.shape[1]
        x = self.layer_norm(cat) if cfg.pre_lnorm else cat
        qkv = linear(x, self.qkv_net)  # [B, K, 3HD]
        q = ops.reshape(qkv[:, -T:, : H * Dh], (B, T, H, Dh))
        k = ops.reshape(qkv[:, :, H * Dh : 2 * H * Dh], (B, K, H, Dh))
        val = ops.reshape(qkv[:, :, 2 * H * Dh :], (B, K, H, Dh))
        r_k = ops.reshape(linear(pos_emb, self.r_net), (K, H, Dh))  # W_kR R, [K, H, Dh]
        ac = ops.einsum("bihd,bjhd->bhij", q + u, k)  # (a) + (c), [B, H, T, K]
        bd = rel_shift(ops.einsum("bihd,jhd->bhij", q + v, r_k))  # (b) + (d), by key
        score = (ac + bd) * self.scale
        score = ops.where(mask, MASKED, score)  # [T, K] broadcast
        prob = ops.softmax(score, axis=-1)  # [B, H, T, K]
        prob = self.dropatt(prob, training=training)
        if head_mask is not None:
            prob = prob * ops.reshape(ops.cast(head_mask, prob.dtype), (1, H, 1, 1))
        attn_vec = ops.reshape(ops.einsum("bhij,bjhd->bihd", prob, val), (B, T, H * Dh))
        out = self.drop(linear(attn_vec, self.o_net), training=training)  # [B, T, D]
        return (h + out if cfg.pre_lnorm else self.layer_norm(h + out)), prob

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RelPartialLearnableMultiHeadAttn:
        config = dict(config)
        return cls(TransformerXLConfig.from_dict(config.pop("config")), **config)


@keras.saving.register_keras_serializable(package="txl")
class PositionwiseFF(keras.layers.Layer):
    """LN(x + W_2 ReLU(W_1 x)) (post-LN), or x + W_2 ReLU(W_1 LN(x)) (pre-LN); dropouts after the ReLU and W_2."""

    def __init__(self, config: TransformerXLConfig, **kwargs: Any):
        super().__init__(**kwargs)
        cfg = self.config = config
        init = weight_init(cfg)
        self.w1 = self.add_weight(shape=(cfg.d_inner, cfg.d_model), initializer=init, name="layer_1_weight")
        self.b1 = self.add_weight(shape=(cfg.d_inner,), initializer="zeros", name="layer_1_bias")
        self.w2 = self.add_weight(shape=(cfg.d_model, cfg.d_inner), initializer=init, name="layer_2_weight")
        self.b2 = self.add_weight(shape=(cfg.d_model,), initializer="zeros", name="layer_2_bias")
        self.layer_norm = _layer_norm(cfg)
        with keras.name_scope(self.name):
            self.layer_norm.build((None, cfg.d_model))
        self.drop = keras.layers.Dropout(cfg.dropout)

    def call(self, h: Any, training: bool = False) -> Any:
        x = self.layer_norm(h) if self.config.pre_lnorm else h
        y = self.drop(ops.relu(linear(x, self.w1, self.b1)), training=training)
        y = self.drop(linear(y, self.w2, self.b2), training=training)
        return h + y if self.config.pre_lnorm else self.layer_norm(h + y)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PositionwiseFF:
        config = dict(config)
        return cls(TransformerXLConfig.from_dict(config.pop("config")), **config)


# ---------------------------------------------------------------------------------------------------------
# The projected adaptive log-softmax (Grave et al.): head = shortlist + one logit per tail cluster (tail i at head
# column cutoffs[0] + i - 1); log p(tail token) = head log-prob of its cluster + its log-prob in the tail.
# ---------------------------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="txl")
class AdaptiveSoftmax(keras.layers.Layer):
    """Hugging Face's ``TFAdaptiveSoftmaxMask``: hidden states ``[..., d_model]`` -> log-probabilities ``[..., V]``.
    Tied weights (``tie_weight``, ``tie_projs``) are the embedding's own variables, not copies."""

    def __init__(self, config: TransformerXLConfig, embedding: AdaptiveEmbedding | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        cfg = self.config = config
        self.ends = [0, *cfg.cutoffs, cfg.n_token]
        self.shortlist, self.n_clusters = self.ends[1], cfg.n_clusters
        dims = cluster_dims(cfg)
        # The tied weights are the embedding's variables, read through a function (not an attribute: Keras would
        # count them as this layer's too, and an optimizer would see them twice).
        self._embedding = (lambda: embedding) if embedding is not None else None
        if cfg.n_clusters > 0:
            self.cluster_weight = self.add_weight(
                shape=(cfg.n_clusters, cfg.d_embed), initializer=weight_init(cfg), name="cluster_weight"
            )
            self.cluster_bias = self.add_weight(shape=(cfg.n_clusters,), initializer="zeros", name="cluster_bias")
        sizes = [cfg.n_token] if cfg.div_val == 1 else [r - l for l, r in zip(self.ends, self.ends[1:], strict=False)]
        self.tied_weight = cfg.tie_weight and embedding is not None
        self.out_weights = [
            self.add_weight(shape=(n, d), initializer=weight_init(cfg), name=f"out_layers_{i}_weight")
            for i, (n, d) in enumerate(zip(sizes, dims, strict=True))
            if not self.tied_weight
        ]
        self.out_biases = [
            self.add_weight(shape=(n,), initializer="zeros", name=f"out_layers_{i}_bias") for i, n in enumerate(sizes)
        ]
        proj_dims = (dims * (cfg.n_clusters + 1) if cfg.div_val == 1 else dims) if has_projections(cfg) else []
        self.n_projs = len(proj_dims)
        self.tied_projs = [bool(cfg.tie_projs[i]) and embedding is not None for i in range(len(proj_dims))]
        self.own_projs = {
            str(i): self.add_weight(
                shape=(cfg.d_model, d), initializer=_normal(cfg.proj_init_std), name=f"out_projs_{i}"
            )
            for i, d in enumerate(proj_dims)
            if not self.tied_projs[i]
        }

    def out_weight(self, i: int) -> Any:
        """Output layer i's weight (the embedding table's with tie_weight)."""
        return self._embedding().emb_layers[i] if self.tied_weight else self.out_weights[i]

    def out_proj(self, i: int) -> Any:
        """Cluster i's projection [d_model, d_i] (the embedding's where tie_projs says so)."""
        if self.tied_projs[i]:
            return self._embedding().emb_projs[0 if self.config.div_val == 1 else i]
        return self.own_projs[str(i)]

    def _cluster(self, i: int) -> tuple[Any, Any]:
        """Cluster i's output weight [n_i, d_i] and bias [n_i] (div_val 1: row blocks of the one layer)."""
        if len(self.out_biases) > 1:
            return self.out_weight(i), self.out_biases[i]
        lo, hi = self.ends[i], self.ends[i + 1]
        return self.out_weight(0)[lo:hi], self.out_biases[0][lo:hi]

    def _logits(self, h: Any, i: int) -> Any:
        hp = ops.matmul(h, self.out_proj(i)) if self.n_projs else h  # [.., d_i]
        w, b = self._cluster(i)
        if i == 0 and self.n_clusters:
            w = ops.concatenate([w, self.cluster_weight], axis=0)
            b = ops.concatenate([b, self.cluster_bias], axis=0)
        return linear(hp, w, b)

    def call(self, hidden: Any) -> Any:
        """log p(token | hidden) ``[..., V]``, fp32."""
        h = ops.cast(hidden, "float32")
        head = ops.log_softmax(self._logits(h, 0), axis=-1)  # [.., shortlist + n_clusters]
        if not self.n_clusters:
            return head
        parts = [head[..., : self.shortlist]]
        for i in range(1, self.n_clusters + 1):
            tail = ops.log_softmax(self._logits(h, i), axis=-1)
            parts.append(head[..., self.shortlist + i - 1 : self.shortlist + i] + tail)
        return ops.concatenate(parts, axis=-1)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}
