"""Hugging Face's TransfoXL models as transformers-5 ``PreTrainedModel`` classes over txl's model.

Each class is a thin adapter: the network is txl's (``txl.model``: ``TransformerXL`` and its adaptive softmax, the
same modules, so hooks, PEFT's LoRA and quantised layers work on them); the adapter translates Hugging Face's
arguments and outputs: memories time-major ([mem_len, batch, d_model]), a zero-filled first memory (``mem_init``),
labels shifted inside, ``losses`` / ``prediction_scores`` (log-probabilities) / ``mems``, and the sequence
classifier's pooling and problem types. Generation is transformers' ``GenerationMixin`` with ``mems`` as the cache,
as transformers 4.x's TransfoXL did it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from txl.hf.configuration import TransfoXLConfig
from txl.interop.convert import is_hf_layout, load_hf_weights
from txl.model.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from txl.model.modeling import TransformerXL, TransformerXLLM
from txl.model.pretrained import CheckpointError, tied_aliases

# ---------------------------------------------------------------------------------------------------------
# Outputs: Hugging Face 4.x's, field for field (tuple order included).
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TransfoXLModelOutput(ModelOutput):
    last_hidden_state: Tensor | None = None
    """[batch, seq_len, d_model]: the last layer's output."""
    mems: list[Tensor] | None = None
    """n_layer tensors [mem_len, batch, d_model] (time-major): the memory for the next segment."""
    hidden_states: tuple[Tensor, ...] | None = None
    """n_layer + 1 tensors [batch, seq_len, d_model]: each layer's input, then the output."""
    attentions: tuple[Tensor, ...] | None = None
    """n_layer tensors [batch, n_head, seq_len, mem_len + seq_len]."""


@dataclass
class TransfoXLLMHeadModelOutput(ModelOutput):
    losses: Tensor | None = None
    """[batch, seq_len - 1]: each position's loss, with ``labels`` (0 where the label is -100)."""
    prediction_scores: Tensor | None = None
    """[batch, seq_len, vocab_size]: log-probabilities (after the adaptive softmax), without ``labels``."""
    mems: list[Tensor] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    loss: Tensor | None = None
    """The mean of ``losses`` over the positions scored."""

    @property
    def logits(self) -> Tensor | None:
        """``prediction_scores`` (Hugging Face's name for generation: log-probabilities, whose softmax is the same
        distribution)."""
        return self.prediction_scores


@dataclass
class TransfoXLSequenceClassifierOutputWithPast(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None
    """[batch, num_labels]."""
    mems: list[Tensor] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


# ---------------------------------------------------------------------------------------------------------
# The base class: initialisation, tied weights, loading Hugging Face 4.x folders.
# ---------------------------------------------------------------------------------------------------------


class TransfoXLPreTrainedModel(PreTrainedModel):
    config_class = TransfoXLConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerXLLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """txl's initialisation (the original ``weights_init``), one module at a time, with transformers' init
        functions (they leave weights that were loaded alone)."""
        cfg = self.config

        def weight_(t: Tensor) -> None:
            if cfg.init == "uniform":
                init.uniform_(t, -cfg.init_range, cfg.init_range)
            else:
                init.normal_(t, 0.0, cfg.init_std)

        if isinstance(module, nn.Linear):
            weight_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            weight_(module.weight)
        elif isinstance(module, nn.LayerNorm):
            init.normal_(module.weight, 1.0, cfg.init_std)
            init.zeros_(module.bias)
        elif isinstance(module, AdaptiveEmbedding):
            for p in module.emb_projs:
                init.normal_(p, 0.0, cfg.proj_init_std)
        elif isinstance(module, ProjectedAdaptiveLogSoftmax):
            for p in module.out_projs:
                init.normal_(p, 0.0, cfg.proj_init_std)
            if module.n_clusters > 0:
                weight_(module.cluster_weight)
                init.zeros_(module.cluster_bias)
        elif isinstance(module, TransformerXL):
            weight_(module.r_w_bias)
            weight_(module.r_r_bias)

    def post_init(self) -> None:
        self._declare_ties()
        super().post_init()

    def _declare_ties(self) -> None:
        """The tied names as transformers' saving matches them (``_tied_weights_keys``: patterns of the copies that
        are not written), from the ties txl made."""
        self._tied_weights_keys = {re.escape(alias) + "$": source for alias, source in tied_aliases(self).items()}
        self.all_tied_weights_keys = self.get_expanded_tied_weights_keys()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """The tied weights as transformers 5 wants them ({target: source}), read from the model itself: txl ties the
        softmax's output layers to the embedding tables (``tie_word_embeddings``) and each cluster's projection per
        ``tie_projs``, which transformers' own rule (``tie_word_embeddings`` alone) cannot express."""
        return tied_aliases(self)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
        """transformers' ``from_pretrained``; a folder in Hugging Face 4.x's TransfoXL layout (``dec_attn`` /
        ``pos_ff`` names, ``model.safetensors``, or ``pytorch_model.bin`` with ``trust_pickle=True``: it is then read
        with ``torch.load(weights_only=True)``) is read by txl's converter, which checks every key, shape and tie."""
        folder = Path(str(pretrained_model_name_or_path))
        trust_pickle = bool(kwargs.pop("trust_pickle", False))
        if not (folder.is_dir() and is_hf_layout(folder)):
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        config = kwargs.pop("config", None)
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in TransfoXLConfig.__dataclass_fields__}
        if config is None:
            config = TransfoXLConfig.from_pretrained(folder, **overrides)
        elif overrides:
            config = TransfoXLConfig.from_dict({**config.to_dict(), **overrides})
        if not isinstance(config, TransfoXLConfig):
            raise TypeError(f"config must be a TransfoXLConfig, not {type(config).__name__}")
        try:
            txl_model, source = load_hf_weights(folder, config.to_txl(), trust_pickle)
        except CheckpointError as e:
            raise OSError(str(e)) from None
        with torch.device("meta"):
            model = cls(config, *model_args)
        model._adopt(txl_model, source)
        for module in model.modules():
            if isinstance(module, TransfoXLPreTrainedModel):
                module._declare_ties()
        if dtype is not None and dtype != "auto":
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        return model.eval()

    def _adopt(self, txl_model: TransformerXL | TransformerXLLM, source: str) -> None:
        """Take the modules of ``txl_model`` (loaded from ``source``) in place of this model's (built on the meta
        device)."""
        raise NotImplementedError

    def _body(self, *args: Any) -> tuple[TransfoXLModelOutput, bool]:
        """A head's call of its base model ``self.transformer`` with the forward's arguments (input_ids, mems,
        head_mask, inputs_embeds, output_attentions, output_hidden_states, return_dict, attention_mask): its output
        as a dataclass, and whether the head returns one."""
        *first, return_dict, attention_mask = args
        out = self.transformer(*first, True, attention_mask)
        return out, self.config.return_dict if return_dict is None else return_dict

    def _fresh(self, name: str, module: nn.Module, source: str) -> nn.Module:
        """``module`` (a head the checkpoint does not have) initialised anew, with Hugging Face's warning."""
        module = module.to_empty(device="cpu")
        for m in module.modules():
            self._init_weights(m)
        warnings.warn(
            f"{source}: {name} of {type(self).__name__} is newly initialised; train it before use", stacklevel=3
        )
        return module


def _core(txl_model: TransformerXL | TransformerXLLM) -> TransformerXL:
    return txl_model.transformer if isinstance(txl_model, TransformerXLLM) else txl_model


# ---------------------------------------------------------------------------------------------------------
# The base model.
# ---------------------------------------------------------------------------------------------------------


class TransfoXLModel(TransfoXLPreTrainedModel):
    """Hugging Face's ``TransfoXLModel``: txl's ``TransformerXL`` (``self.core``) with Hugging Face's arguments and
    outputs."""

    def __init__(self, config: TransfoXLConfig, core: TransformerXL | None = None):
        super().__init__(config)
        self.core = core if core is not None else TransformerXL(config.to_txl(), init=False)
        self.post_init()

    def _adopt(self, txl_model: TransformerXL | TransformerXLLM, source: str) -> None:
        self.core = _core(txl_model)

    def get_input_embeddings(self) -> nn.Module:
        return self.core.word_emb

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.core.word_emb = value

    def init_mems(self, bsz: int) -> list[Tensor] | None:
        """Hugging Face's first memory: ``mem_len`` zeros per layer ([mem_len, bsz, d_model]; None when mem_len is
        0)."""
        cfg = self.config
        if cfg.mem_len <= 0:
            return None
        param = next(self.parameters())
        return [torch.zeros(cfg.mem_len, bsz, cfg.d_model, dtype=param.dtype, device=param.device)] * cfg.n_layer

    def forward(
        self,
        input_ids: Tensor | None = None,
        mems: list[Tensor] | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        attention_mask: Tensor | None = None,
    ) -> TransfoXLModelOutput | tuple:
        """Hugging Face's forward. ``mems``: n_layer tensors [mem_len, batch, d_model] (time-major); None starts from
        the memory ``config.mem_init`` says (Hugging Face's: zeros). ``attention_mask`` (txl's addition, 1 = token,
        0 = padding, [batch, seq_len]) keeps padding from being attended to; the memory's positions count as tokens."""
        cfg = self.config
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = cfg.return_dict if return_dict is None else return_dict
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        if mems is None and cfg.mem_init == "zeros":
            mems = self.init_mems(batch)
        out = self.core(
            input_ids,
            None if mems is None else [m.transpose(0, 1) for m in mems],  # -> txl's [batch, M, d_model]
            inputs_embeds=inputs_embeds,
            head_mask=head_mask,
            attention_mask=attention_mask,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        result = TransfoXLModelOutput(
            last_hidden_state=out.last_hidden_state,
            mems=None if out.mems is None else [m.transpose(0, 1) for m in out.mems],  # -> [M, batch, d_model]
            hidden_states=tuple(out.hidden_states) if output_hidden_states else None,
            attentions=tuple(out.attentions) if output_attentions else None,
        )
        return result if return_dict else result.to_tuple()


# ---------------------------------------------------------------------------------------------------------
# The language model.
# ---------------------------------------------------------------------------------------------------------


class TransfoXLLMHeadModel(TransfoXLPreTrainedModel, GenerationMixin):
    """Hugging Face's ``TransfoXLLMHeadModel``: the base model and txl's adaptive softmax (``crit``), tied as txl
    ties them (``tie_word_embeddings``, ``tie_projs``)."""

    def __init__(self, config: TransfoXLConfig):
        super().__init__(config)
        lm = TransformerXLLM(config.to_txl(), init=False)  # (txl's head, tied to the embedding by txl's rule)
        self.transformer = TransfoXLModel(config, core=lm.transformer)
        self.crit = lm.crit
        self.post_init()

    def _adopt(self, txl_model: TransformerXL | TransformerXLLM, source: str) -> None:
        self.transformer.core = _core(txl_model)
        if isinstance(txl_model, TransformerXLLM):
            self.crit = txl_model.crit
        else:  # (a bare TransfoXLModel checkpoint: the softmax starts anew, tied to the embedding as configured)
            lm = TransformerXLLM(self.config.to_txl(), init=False)
            lm.transformer = txl_model
            lm.crit = self._fresh("crit", lm.crit, source)
            lm.tie_weights()
            self.crit = lm.crit

    def get_output_embeddings(self) -> None:
        return None  # (the adaptive softmax has no single output matrix; txl ties it to the embedding itself)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is ``mems`` (transformers 5 keeps that path for XLNet)

    def forward(
        self,
        input_ids: Tensor | None = None,
        mems: list[Tensor] | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        attention_mask: Tensor | None = None,
    ) -> TransfoXLLMHeadModelOutput | tuple:
        """Hugging Face's forward: with ``labels`` (usually ``input_ids``; -100 = not scored) the position t predicts
        ``labels[:, t + 1]`` (``losses`` [batch, seq_len - 1], ``loss`` their mean over the scored positions),
        else ``prediction_scores`` [batch, seq_len, vocab_size] (log-probabilities)."""
        out, return_dict = self._body(
            input_ids, mems, head_mask, inputs_embeds, output_attentions, output_hidden_states, return_dict,
            attention_mask,
        )  # fmt: skip
        h = out.last_hidden_state  # [B, T, D]
        B, T, D = h.shape
        losses = loss = scores = None
        if labels is not None:
            targets = labels[:, 1:].to(h.device)  # [B, T - 1]: "tokens < n predict n"
            nll, _ = self.crit(h[:, :-1].reshape(-1, D), targets.reshape(-1))
            scored = (targets != -100).sum()
            loss = nll.sum() / scored.clamp(min=1)
            if not self.config.keep_order:
                nll = self._grouped(nll, targets.reshape(-1))
            losses = nll.view(B, T - 1)
        else:
            _, log_probs = self.crit(h.reshape(-1, D), None, True)
            scores = log_probs.view(B, T, -1)
        result = TransfoXLLMHeadModelOutput(
            losses=losses,
            prediction_scores=scores,
            mems=out.mems,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            loss=loss,
        )
        return result if return_dict else result.to_tuple()

    def _grouped(self, nll: Tensor, targets: Tensor) -> Tensor:
        """The losses in Hugging Face 4.x's order (``keep_order=False``): the head cluster's positions first, then
        each tail cluster's (row-major within each), the unscored ones (zeros) last."""
        ends = torch.tensor(self.crit.ends[1:-1], device=targets.device)
        cluster = torch.bucketize(targets, ends, right=True)  # [N]: 0 (head), 1, 2, ...
        cluster = torch.where(targets == -100, len(self.crit.ends), cluster)
        return nll[torch.argsort(cluster, stable=True)]

    # Generation: transformers' GenerationMixin, with the memory as the cache (as transformers 4.x's TransfoXL).
    def prepare_inputs_for_generation(
        self, input_ids: Tensor, past_key_values: list[Tensor] | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The first step reads the whole prompt; every later step the newest token on top of the memory."""
        if past_key_values:
            return {"input_ids": input_ids[:, -1:], "mems": past_key_values}
        return {"input_ids": input_ids}

    @staticmethod
    def _reorder_cache(mems: list[Tensor], beam_idx: Tensor) -> list[Tensor]:
        """Beam search: each beam's memory follows the beam it continues (memories are [mem_len, batch, d_model])."""
        return [m.index_select(1, beam_idx.to(m.device)) for m in mems]


# ---------------------------------------------------------------------------------------------------------
# Sequence classification.
# ---------------------------------------------------------------------------------------------------------


class TransfoXLForSequenceClassification(TransfoXLPreTrainedModel):
    """Hugging Face's ``TransfoXLForSequenceClassification``: a linear ``score`` of the last token's hidden state
    that is not padding (Hugging Face's rule: the position before the first ``pad_token_id``, else the last), with
    its problem types (regression for one label, single- or multi-label classification)."""

    def __init__(self, config: TransfoXLConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = TransfoXLModel(config)
        self.score = nn.Linear(config.d_model, config.num_labels, bias=False)
        self.post_init()

    def _adopt(self, txl_model: TransformerXL | TransformerXLLM, source: str) -> None:
        self.transformer.core = _core(txl_model)
        self.score = self._fresh("score", self.score, source)

    def forward(
        self,
        input_ids: Tensor | None = None,
        mems: list[Tensor] | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        attention_mask: Tensor | None = None,
    ) -> TransfoXLSequenceClassifierOutputWithPast | tuple:
        """``labels``: [batch] class ids, [batch] floats (``num_labels`` 1: regression) or [batch, num_labels] floats
        (multi-label); ``config.problem_type`` decides where it is set."""
        cfg = self.config
        out, return_dict = self._body(
            input_ids, mems, head_mask, inputs_embeds, output_attentions, output_hidden_states, return_dict,
            attention_mask,
        )  # fmt: skip
        h = out.last_hidden_state  # [B, T, D]
        B, T = h.shape[:2]
        if input_ids is None or cfg.pad_token_id is None:
            if cfg.pad_token_id is None and B != 1 and input_ids is not None:
                raise ValueError("batches of more than one text need config.pad_token_id (the pooled token)")
            last = torch.full((B,), T - 1, device=h.device)
        else:  # the position before the first padding token (-1: none, the last one)
            last = (torch.eq(input_ids, cfg.pad_token_id).int().argmax(-1) - 1) % T
            last = last.to(h.device)
        logits = self.score(h[torch.arange(B, device=h.device), last])  # [B, num_labels]
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if cfg.problem_type is None:
                if self.num_labels == 1:
                    cfg.problem_type = "regression"
                elif labels.dtype in (torch.long, torch.int):
                    cfg.problem_type = "single_label_classification"
                else:
                    cfg.problem_type = "multi_label_classification"
            if cfg.problem_type == "regression":
                loss = F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
            elif cfg.problem_type == "single_label_classification":
                loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        result = TransfoXLSequenceClassifierOutputWithPast(
            loss=loss, logits=logits, mems=out.mems, hidden_states=out.hidden_states, attentions=out.attentions
        )
        return result if return_dict else result.to_tuple()
