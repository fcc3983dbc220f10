"""Hugging Face's TensorFlow TransfoXL classes in Keras 3: the backbone (``TFTransfoXLModel``), the language model
(``TFTransfoXLLMHeadModel``, with ``generate()`` and ``fit()`` over a token stream) and the classifier
(``TFTransfoXLForSequenceClassification``), on any Keras backend. Design notes: docs/internals.md#txlkerasmodels."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from txl.keras.distribution import check_layout
from txl.keras.layers import (
    AdaptiveEmbedding,
    AdaptiveSoftmax,
    PositionwiseFF,
    RelPartialLearnableMultiHeadAttn,
    causal_mask,
    sinusoid_embedding,
    weight_init,
)
from txl.model.config import TransformerXLConfig, check_time_major_mems

BACKENDS = ("tensorflow", "jax", "torch")
"""The Keras backends whose ops the model needs (einsum, take, where, log_softmax) and that can train it."""


def check_backend() -> str:
    """The Keras backend, or one clear error for one that cannot run the model."""
    backend = keras.backend.backend()
    if backend not in BACKENDS:
        raise RuntimeError(
            f"txl.keras runs on the Keras backends {', '.join(BACKENDS)}; this process uses {backend!r} "
            "(set KERAS_BACKEND=jax or tensorflow before importing keras)"
        )
    return backend


COMPUTED = frozenset({
    "n_token", "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed", "div_val", "cutoffs", "tie_weight",
    "tie_projs", "dropout", "dropatt", "pre_lnorm", "untie_r", "same_length", "tf_same_length", "clamp_len",
    "mem_len", "layer_norm_epsilon", "init", "init_std", "init_range", "proj_init_std", "num_labels", "pad_token_id",
})  # fmt: skip
"""The fields of ``TransformerXLConfig`` txl.keras computes as txl's PyTorch model does (tests_keras: the random
configurations against it, the initialisation's draws, the classifier's pooling, dropout in training only)."""
REFUSED = {"attn_type": 0, "gate": "residual", "identity_map": False, "cmem_len": 0}
"""The fields of txl's PyTorch-only variants, with the value txl.keras computes (the paper's): any other is refused."""
INERT = {"gate_bias": "gate", "max_klen": "attn_type", "cmem_ratio": "cmem_len", "compression": "cmem_len"}
"""Fields read only by a refused variant (the field it belongs to): any value computes the same here."""


def check_config(cfg: TransformerXLConfig) -> None:
    """The paper's model is what txl.keras computes: refuse a configuration of txl's PyTorch-only variants, and any
    field it does not know (a field added to TransformerXLConfig later) set away from its default. An allow-list:
    every field is in :data:`COMPUTED`, :data:`REFUSED` or :data:`INERT` (tests_keras walks them)."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    for name in [*REFUSED, *fields]:  # (the variants first, in REFUSED's order: a GTrXL config is named by its gate)
        value = getattr(cfg, name)
        if name in COMPUTED or name in INERT:
            continue
        paper = REFUSED[name] if name in REFUSED else _default(fields[name])
        if value != paper:
            what = "variant runs in txl's PyTorch model only" if name in REFUSED else "field is not one txl.keras reads"
            raise ValueError(
                f"TransformerXLConfig.{name} = {value!r}: txl.keras computes the paper's model ({name} = {paper!r}); "
                f"this {what}"
            )


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _getitem(self, key):  # out["mems"] as well as out.mems and out[0] (Hugging Face's ModelOutput)
    return getattr(self, key) if isinstance(key, str) else tuple.__getitem__(self, key)


def _to_tuple(self) -> tuple:
    """The outputs that are set, in order (Hugging Face's ``to_tuple()``)."""
    return tuple(v for v in self if v is not None)


def _keys(self) -> list[str]:
    return [k for k, v in zip(self._fields, self, strict=True) if v is not None]


class TFTransfoXLModelOutput(NamedTuple):
    """The backbone's outputs."""

    last_hidden_state: Any = None
    mems: list | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None
    __getitem__ = _getitem
    to_tuple = _to_tuple
    keys = _keys


class TFTransfoXLLMHeadModelOutput(NamedTuple):
    """The language model's outputs: ``prediction_scores`` [B, T, V] (log-probabilities); with ``labels``, ``losses``
    [B, T-1] (position t predicts ``labels[:, t + 1]``, in positional order; 0 where ``labels`` is -100) and ``loss``
    (their mean over the scored positions)."""

    prediction_scores: Any = None
    mems: list | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None
    losses: Any = None
    loss: Any = None
    __getitem__ = _getitem
    to_tuple = _to_tuple
    keys = _keys


class TFTransfoXLSequenceClassifierOutputWithPast(NamedTuple):
    """The classifier's outputs."""

    loss: Any = None
    logits: Any = None
    mems: list | None = None
    hidden_states: tuple | None = None
    attentions: tuple | None = None
    __getitem__ = _getitem
    to_tuple = _to_tuple
    keys = _keys


@keras.saving.register_keras_serializable(package="txl")
class SegmentMemory(keras.layers.Layer):
    """The memory a stateful model carries between calls: ``n_layer`` x ``[batch, mem_len, d_model]`` in one
    non-trainable variable. A ``.keras`` file saved while it is carried keeps it (``keras.saving.load_model`` gives a
    model that carries the same memory: a resumed ``fit`` continues the stream); txl's folders
    (``save_pretrained``) hold weights only."""

    def __init__(self, n_layer: int, batch_size: int, mem_len: int, d_model: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.shape_ = (n_layer, batch_size, mem_len, d_model)
        self.state = self.add_weight(shape=self.shape_, initializer="zeros", trainable=False, name="state")

    def read(self) -> list:
        return [self.state[i] for i in range(self.shape_[0])]

    def write(self, mems: list) -> None:
        self.state.assign(ops.stack(mems, axis=0))

    def reset(self) -> None:
        self.state.assign(ops.zeros(self.shape_))

    def get_config(self) -> dict[str, Any]:
        n_layer, batch_size, mem_len, d_model = self.shape_
        return {**super().get_config(), "n_layer": n_layer, "batch_size": batch_size, "mem_len": mem_len,
                "d_model": d_model}  # fmt: skip


def _unpack(inputs: Any, **given: Any) -> dict[str, Any]:
    """Hugging Face's TF convention: the first argument may be a dict of the named ones."""
    if isinstance(inputs, dict):
        return {**given, **inputs}
    return {**given, "input_ids": inputs}


class _Base(keras.Model):
    """What the three models share: the config, Keras serialization, the memory's conventions."""

    def __init__(self, config: TransformerXLConfig | dict, mem_init: str = "zeros", **kwargs: Any):
        super().__init__(**kwargs)
        check_backend()
        self.config = config if isinstance(config, TransformerXLConfig) else TransformerXLConfig.from_dict(config)
        check_config(self.config)
        check_layout(self.config)
        if mem_init not in ("zeros", "empty"):
            raise ValueError(
                f"mem_init = {mem_init!r}: 'zeros' (Hugging Face's, the TF code's) or 'empty' (the original PyTorch "
                "code's)"
            )
        self.mem_init = mem_init
        self.tokenizer = None  # (txl's, when the weights came from a folder with a tokenizer.json: generate on text)

    def get_config(self) -> dict[str, Any]:
        memory = self._backbone().memory
        carried = None if memory is None else memory.shape_[1]  # (the batch size of a carried memory)
        return {"config": self.config.to_dict(), "mem_init": self.mem_init, "name": self.name, "carried": carried}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _Base:
        config = dict(config)
        carried = config.pop("carried", None)
        model = cls(**config)
        if carried is not None:  # (its state is then loaded with the weights: the memory saved)
            model.carry_memory(carried)
        return model

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> _Base:
        """The model with the weights of a txl folder (config.json + model.safetensors: ``txl train``'s, a
        checkpoint's, a run's) or a Hugging Face 4.x TransfoXL folder; see :func:`txl.keras.weights.load`."""
        from txl.keras.weights import load

        return load(cls, path, **kwargs)

    def save_pretrained(self, path: str) -> None:
        """A txl folder (config.json + model.safetensors) that ``txl eval`` and ``TransformerXLLM`` read."""
        from txl.keras.weights import save

        save(self, path)

    def reset_memory_length(self, mem_len: int) -> None:
        """Hugging Face's: the memory length from now on (mems returned, the zero memory, same_length's window)."""
        self.config = TransformerXLConfig.from_dict({**self.config.to_dict(), "mem_len": int(mem_len)})
        self._backbone().config = self.config

    def _backbone(self) -> TransfoXLBackbone:
        return self.transformer


@keras.saving.register_keras_serializable(package="txl")
class TransfoXLBackbone(keras.layers.Layer):
    """Hugging Face's ``TFTransfoXLMainLayer``: embeddings, the layers with their memories, the new memories. Takes
    and returns batch-first memories ``[B, M, D]``; the models turn them into Hugging Face's time-major ones."""

    def __init__(self, config: TransformerXLConfig, **kwargs: Any):
        super().__init__(**kwargs)
        cfg = self.config = config
        self.word_emb = AdaptiveEmbedding(cfg, name="word_emb")
        bias_shape = (cfg.n_layer, cfg.n_head, cfg.d_head) if cfg.untie_r else (cfg.n_head, cfg.d_head)
        init = weight_init(cfg)
        self.r_w_bias = self.add_weight(shape=bias_shape, initializer=init, name="r_w_bias")  # u
        self.r_r_bias = self.add_weight(shape=bias_shape, initializer=init, name="r_r_bias")  # v
        self.attn = [RelPartialLearnableMultiHeadAttn(cfg, name=f"layers_{i}_attn") for i in range(cfg.n_layer)]
        self.ff = [PositionwiseFF(cfg, name=f"layers_{i}_ff") for i in range(cfg.n_layer)]
        self.drop = keras.layers.Dropout(cfg.dropout)
        self.memory: SegmentMemory | None = None
        self.built = True

    def biases(self, i: int) -> tuple[Any, Any]:
        """Layer i's u, v [H, Dh]."""
        if self.config.untie_r:
            return self.r_w_bias[i], self.r_r_bias[i]
        return self.r_w_bias, self.r_r_bias

    def call(
        self,
        input_ids: Any = None,
        mems: list | None = None,
        head_mask: Any = None,
        inputs_embeds: Any = None,
        training: bool = False,
        mem_pad: Any = None,
    ) -> tuple[Any, list | None, list, list]:
        """Returns (the last layer's output [B, T, D], the new memories (n_layer x [B, <=mem_len, D], or None when
        mem_len is 0), every layer's input and the output (n_layer + 1 x [B, T, D]), each layer's probabilities).
        ``mem_pad``: the memories' first positions that are not states (a memory kept at one length, as generation
        keeps it: one shape for every step); no query sees them, and the others are as without them."""
        cfg = self.config
        word = self.word_emb(input_ids) if input_ids is not None else ops.cast(inputs_embeds, "float32")  # [B, T, D]
        T = word.shape[1]
        M = 0 if mems is None else mems[0].shape[1]
        window = cfg.mem_len + 1 if cfg.tf_same_length else cfg.mem_len
        mask = causal_mask(T, M, cfg.same_length, window)  # [T, K]
        if mem_pad is not None:  # (a tensor, so that a compiled step serves every length of the memory)
            mask = ops.logical_or(mask, ops.expand_dims(ops.arange(M + T) < mem_pad, 0))
        pos_emb = self.drop(sinusoid_embedding(M + T, cfg.d_model, cfg.clamp_len), training=training)  # [K, D]
        h = self.drop(word, training=training)
        hids, probs = [], []
        for i in range(cfg.n_layer):
            hids.append(h)
            u, v = self.biases(i)
            head = None if head_mask is None else head_mask[i]
            h, prob = self.attn[i](h, pos_emb, u, v, mask, None if mems is None else mems[i], head, training=training)
            h = self.ff[i](h, training=training)
            probs.append(prob)
        h = self.drop(h, training=training)
        hids.append(h)
        new_mems = None
        if cfg.mem_len > 0:
            new_mems = [
                ops.stop_gradient((x if mems is None else ops.concatenate([m, x], axis=1))[:, -cfg.mem_len :])
                for m, x in zip(mems or [None] * cfg.n_layer, hids, strict=False)
            ]
        return h, new_mems, hids, probs

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "config": self.config.to_dict()}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TransfoXLBackbone:
        config = dict(config)
        return cls(TransformerXLConfig.from_dict(config.pop("config")), **config)


def _head_mask(head_mask: Any, cfg: TransformerXLConfig) -> Any:
    """Hugging Face's head_mask ([n_head], or [n_layer, n_head]; 1 keeps a head, 0 silences it) as [n_layer, H]."""
    if head_mask is None:
        return None
    hm = ops.convert_to_tensor(head_mask, "float32")
    if tuple(hm.shape) == (cfg.n_head,):
        return ops.broadcast_to(hm[None], (cfg.n_layer, cfg.n_head))
    if tuple(hm.shape) != (cfg.n_layer, cfg.n_head):
        raise ValueError(
            f"head_mask must be [n_head = {cfg.n_head}] or [n_layer = {cfg.n_layer}, n_head], got {list(hm.shape)}"
        )
    return hm


@keras.saving.register_keras_serializable(package="txl")
class TFTransfoXLModel(_Base):
    """Hugging Face's ``TFTransfoXLModel``: the hidden states of the last layer, and the new memories."""

    TORCH_TWIN = "TransformerXL"
    PRIMARY = "last_hidden_state"  # (what predict() returns: the head's main output)
    _predicting = False
    """txl's PyTorch class with the same weights (txl.keras.weights reads and writes its folders)."""

    def __init__(self, config: TransformerXLConfig | dict, mem_init: str = "zeros", **kwargs: Any):
        super().__init__(config, mem_init, **kwargs)
        self.transformer = TransfoXLBackbone(self.config, name="transformer")
        self.built = True

    def body(
        self,
        input_ids: Any = None,
        mems: Any = None,
        head_mask: Any = None,
        inputs_embeds: Any = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        training: bool = False,
    ) -> TFTransfoXLModelOutput:
        """The backbone with Hugging Face's conventions (what the heads call)."""
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You have to specify either input_ids or inputs_embeds (one of them)")
        if input_ids is not None:
            input_ids = ops.convert_to_tensor(input_ids)
            if len(input_ids.shape) != 2 or "int" not in str(input_ids.dtype):
                raise ValueError(f"input_ids must be integer token ids [batch, seq_len], got {list(input_ids.shape)} "
                                 f"{input_ids.dtype}")  # fmt: skip
        else:
            inputs_embeds = ops.convert_to_tensor(inputs_embeds)
            if len(inputs_embeds.shape) != 3 or inputs_embeds.shape[-1] != cfg.d_model:
                raise ValueError(
                    f"inputs_embeds must be [batch, seq_len, d_model = {cfg.d_model}], got {list(inputs_embeds.shape)}"
                )
        first = input_ids if input_ids is not None else inputs_embeds
        batch = first.shape[0]
        memory = self.transformer.memory
        if mems is not None:
            check_time_major_mems(mems, batch, cfg)
            mems_bf = [ops.transpose(ops.cast(m, "float32"), (1, 0, 2)) for m in mems]  # [B, M, D]
        elif memory is not None:  # the memory this model carries (carry_memory)
            if batch is not None and batch != memory.shape_[1]:
                raise ValueError(
                    f"this model carries a memory for batches of {memory.shape_[1]} (carry_memory); got a batch of "
                    f"{batch}: give batches of that size, or call carry_memory again"
                )
            mems_bf = memory.read()
        elif self.mem_init == "zeros" and cfg.mem_len > 0:
            mems_bf = [ops.zeros((ops.shape(first)[0], cfg.mem_len, cfg.d_model))] * cfg.n_layer
        else:
            mems_bf = None
        h, new, hids, probs = self.transformer(
            input_ids, mems_bf, _head_mask(head_mask, cfg), inputs_embeds, training=training
        )
        if mems is None and memory is not None and new is not None:
            memory.write(new)
        return TFTransfoXLModelOutput(
            last_hidden_state=h,
            mems=None if new is None else [ops.transpose(m, (1, 0, 2)) for m in new],  # [M, B, D]
            hidden_states=tuple(hids) if output_hidden_states else None,
            attentions=tuple(probs) if output_attentions else None,
        )

    def call(
        self,
        input_ids: Any = None,
        mems: Any = None,
        head_mask: Any = None,
        inputs_embeds: Any = None,
        labels: Any = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        training: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Hugging Face's call (``input_ids`` may be a dict of the named arguments): the backbone, then the head."""
        args = _unpack(
            input_ids,
            mems=mems,
            head_mask=head_mask,
            inputs_embeds=inputs_embeds,
            labels=labels,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        labels = args.pop("labels")
        out = self.head(self.body(**args, training=training), labels, args.get("input_ids"))
        return getattr(out, self.PRIMARY) if self._predicting else out

    def head(self, out: TFTransfoXLModelOutput, labels: Any, input_ids: Any) -> Any:
        """The outputs of the model from the backbone's (this one: the backbone's own; it takes no labels)."""
        if labels is not None:
            raise ValueError("TFTransfoXLModel takes no labels (the language model or the classifier do)")
        return out

    def carry_memory(self, batch_size: int) -> None:
        """From now on the model carries its memory from call to call (``mems`` not given), for batches of
        ``batch_size``: what ``fit()``, ``evaluate()`` and ``predict()`` over a token stream need. Starts at zeros."""
        cfg = self.config
        if cfg.mem_len <= 0:
            raise ValueError("carry_memory: the model has mem_len = 0 (no memory to carry); set mem_len > 0")
        self.transformer.memory = SegmentMemory(cfg.n_layer, int(batch_size), cfg.mem_len, cfg.d_model, name="memory")

    def fit(self, *args: Any, shuffle: bool | None = None, **kwargs: Any) -> Any:
        """Keras's ``fit``; with a carried memory the batches stay in the stream's order (Keras shuffles the batches of
        a ``PyDataset`` and the rows of arrays by default, which would put each batch after another one's past)."""
        if self.transformer.memory is not None:
            if shuffle:
                raise ValueError(
                    "fit(shuffle=True) with a carried memory (carry_memory): each batch continues the one before it; "
                    "shuffling would give it another batch's memory. Leave shuffle unset (or False)"
                )
            shuffle = False
        return super().fit(*args, shuffle=True if shuffle is None else shuffle, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Keras's ``evaluate``; with a carried memory it reads its data as a stream of its own: from a zero memory,
        and the memory carried before it is back afterwards (``fit``'s validation calls it: validation never reads
        the training stream's memory)."""
        with self._own_stream():
            return super().evaluate(*args, **kwargs)

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """Keras's ``predict``: the head's main output for every row, as one array (the language model's
        ``prediction_scores`` [N, T, V], log-probabilities; the base model's ``last_hidden_state``; the classifier's
        ``logits``); with a carried memory, ``x`` is read as a stream of its own, as :meth:`evaluate` reads."""
        with self._own_stream(), self._primary():
            return super().predict(x, *args, **kwargs)

    def predict_on_batch(self, x: Any) -> Any:
        with self._primary():
            return super().predict_on_batch(x)

    @contextmanager
    def _primary(self) -> Iterator[None]:
        self._predicting = True
        try:
            yield
        finally:
            self._predicting = False

    @contextmanager
    def _own_stream(self) -> Iterator[None]:
        memory = self._backbone().memory
        if memory is None:
            yield
            return
        kept = np.array(ops.convert_to_numpy(memory.state), copy=True)
        memory.reset()
        try:
            yield
        finally:
            memory.state.assign(kept)

    def reset_memory(self) -> None:
        """Zero the carried memory (a new stream, or a new epoch)."""
        if self.transformer.memory is not None:
            self.transformer.memory.reset()

    def forget_memory(self) -> None:
        """Stop carrying a memory (calls without ``mems`` start from ``mem_init`` again)."""
        self.transformer.memory = None


@keras.saving.register_keras_serializable(package="txl")
class TFTransfoXLLMHeadModel(TFTransfoXLModel):
    """Hugging Face's ``TFTransfoXLLMHeadModel``: the adaptive softmax over the backbone; ``generate()`` (greedy,
    sampling, beam search) and ``fit()`` over a token stream (:meth:`carry_memory`)."""

    TORCH_TWIN = "TransformerXLLM"
    PRIMARY = "prediction_scores"

    def __init__(self, config: TransformerXLConfig | dict, mem_init: str = "zeros", **kwargs: Any):
        super().__init__(config, mem_init, **kwargs)
        self.crit = AdaptiveSoftmax(self.config, self.transformer.word_emb, name="crit")
        self.built = True

    def head(self, out: TFTransfoXLModelOutput, labels: Any, input_ids: Any) -> TFTransfoXLLMHeadModelOutput:
        scores = self.crit(out.last_hidden_state)  # [B, T, V]
        losses = loss = None
        if labels is not None:
            labels = ops.convert_to_tensor(labels)
            if tuple(labels.shape) != tuple(scores.shape[:2]):
                raise ValueError(f"labels must be [batch, seq_len] = {list(scores.shape[:2])} (usually input_ids), "
                                 f"got {list(labels.shape)}")  # fmt: skip
            losses, loss = token_nll(scores[:, :-1], labels[:, 1:])  # position t predicts labels[:, t + 1]
        return TFTransfoXLLMHeadModelOutput(scores, out.mems, out.hidden_states, out.attentions, losses, loss)

    # fit(): y is the next tokens of x (the (data, target) convention of txl and the paper's code)
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):  # noqa: ANN001, ANN201
        scores = getattr(y_pred, "prediction_scores", y_pred)
        if y is None and getattr(y_pred, "loss", None) is not None:
            loss = y_pred.loss
        else:
            _, loss = token_nll(scores, y, sample_weight)
        return loss + ops.sum(self.losses) if self.losses else loss

    def compute_metrics(self, x, y, y_pred, sample_weight=None):  # noqa: ANN001, ANN201
        return super().compute_metrics(x, y, getattr(y_pred, "prediction_scores", y_pred), sample_weight)

    def log_probs(self, input_ids: Any, mems: list | None, mem_pad: Any = None) -> tuple[Any, list | None]:
        """One step of generation: log-probs of the next token after each row [B, V] and the new memories
        (batch-first; ``mems`` batch-first too, [] or None: none; ``mem_pad``: their first positions that are
        padding)."""
        h, new, _, _ = self.transformer(input_ids, mems or None, None, None, training=False, mem_pad=mem_pad)
        return self.crit(h[:, -1]), new

    def generate(self, input_ids: Any, max_new_tokens: int, **kwargs: Any) -> Any:
        """``input_ids`` [B, T] followed by up to ``max_new_tokens`` new tokens, as txl's ``generate`` (greedy with
        ``temperature=0``, sampling, or ``num_beams`` > 1: beam search); see :mod:`txl.keras.generation`. A text (or a
        list of texts of one length in tokens) is encoded and the continuations decoded with the folder's tokenizer."""
        from txl.keras.generation import generate

        if isinstance(input_ids, str | list) and (isinstance(input_ids, str) or isinstance(input_ids[0], str)):
            if self.tokenizer is None:
                raise ValueError("generate on text needs a tokenizer: load a folder with tokenizer.json, or give ids")
            texts = [input_ids] if isinstance(input_ids, str) else input_ids
            ids = [self.tokenizer.encode(t) for t in texts]
            if len({len(i) for i in ids}) != 1 or not ids[0]:
                raise ValueError("generate on texts: give texts of one (non-zero) length in tokens, or ids")
            out = generate(self, np.array(ids), max_new_tokens, **kwargs)
            new = [self.tokenizer.decode(row[len(ids[0]) :].tolist()) for row in out]
            return new[0] if isinstance(input_ids, str) else new
        return generate(self, input_ids, max_new_tokens, **kwargs)


class ResetMemory(keras.callbacks.Callback):
    """Zero the carried memory at the start of every epoch of ``fit`` (a new pass over the stream: the old memory
    does not precede it), as txl's trainer does."""

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.model.reset_memory()


def token_nll(scores: Any, targets: Any, sample_weight: Any = None) -> tuple[Any, Any]:
    """-log p(target) per position ([B, T], 0 where the target is -100 or weighted 0) and their mean over the scored
    positions, from log-probabilities ``scores`` [B, T, V]."""
    targets = ops.cast(targets, "int32")
    scored = ops.cast(targets != -100, "float32")
    if sample_weight is not None:  # (Keras's per-row weights [B], or per position [B, T])
        weight = ops.cast(sample_weight, "float32")
        scored = scored * (ops.expand_dims(weight, -1) if len(weight.shape) == 1 else weight)
    picked = ops.take_along_axis(scores, ops.expand_dims(ops.maximum(targets, 0), -1), axis=-1)[..., 0]
    losses = -picked * scored
    return losses, ops.sum(losses) / ops.maximum(ops.sum(scored), 1.0)


@keras.saving.register_keras_serializable(package="txl")
class TFTransfoXLForSequenceClassification(TFTransfoXLModel):
    """Hugging Face's ``TFTransfoXLForSequenceClassification``: a linear ``score`` of the last token that is not
    padding (the position before the first ``pad_token_id``, else the last); regression with one label."""

    TORCH_TWIN = "TransformerXLForSequenceClassification"
    PRIMARY = "logits"

    def __init__(self, config: TransformerXLConfig | dict, mem_init: str = "zeros", **kwargs: Any):
        super().__init__(config, mem_init, **kwargs)
        cfg = self.config
        self.score = self.add_weight(
            shape=(cfg.num_labels, cfg.d_model), initializer=weight_init(cfg),
            name="score",
        )  # fmt: skip
        self.built = True

    def head(
        self, out: TFTransfoXLModelOutput, labels: Any, input_ids: Any
    ) -> TFTransfoXLSequenceClassifierOutputWithPast:
        h = out.last_hidden_state  # [B, T, D]
        T = h.shape[1]
        cfg = self.config
        ids = input_ids
        if ids is None or cfg.pad_token_id is None:
            if cfg.pad_token_id is None and ids is not None and h.shape[0] not in (1, None):
                raise ValueError("batches of more than one text need config.pad_token_id (the pooled token)")
            last = ops.full((ops.shape(h)[0],), T - 1, dtype="int32")
        else:
            is_pad = ops.cast(ops.equal(ops.convert_to_tensor(ids), cfg.pad_token_id), "int32")
            last = (ops.cast(ops.argmax(is_pad, axis=-1), "int32") - 1) % T  # (no padding: argmax 0, -1 % T)
        pooled = ops.take_along_axis(h, ops.reshape(last, (-1, 1, 1)), axis=1)[:, 0]  # [B, D]
        logits = ops.matmul(pooled, ops.transpose(self.score))  # [B, num_labels]
        loss = None if labels is None else self.classification_loss(logits, labels)
        return TFTransfoXLSequenceClassifierOutputWithPast(loss, logits, out.mems, out.hidden_states, out.attentions)

    def classification_loss(self, logits: Any, labels: Any) -> Any:
        """Mean squared error for one label (regression), else the cross-entropy of the class ids."""
        if self.config.num_labels == 1:
            return ops.mean(ops.square(logits[:, 0] - ops.cast(ops.reshape(labels, (-1,)), "float32")))
        labels = ops.cast(ops.reshape(labels, (-1,)), "int32")
        lp = ops.log_softmax(logits, axis=-1)
        return -ops.mean(ops.take_along_axis(lp, labels[:, None], axis=-1))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):  # noqa: ANN001, ANN201
        if y is None and getattr(y_pred, "loss", None) is not None:
            loss = y_pred.loss
        else:
            loss = self.classification_loss(y_pred.logits, y)
        return loss + ops.sum(self.losses) if self.losses else loss

    def compute_metrics(self, x, y, y_pred, sample_weight=None):  # noqa: ANN001, ANN201
        return super().compute_metrics(x, y, getattr(y_pred, "logits", y_pred), sample_weight)


TFAdaptiveEmbedding = AdaptiveEmbedding
TFAdaptiveSoftmaxMask = AdaptiveSoftmax
TFTransfoXLMainLayer = TransfoXLBackbone
