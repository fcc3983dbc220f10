"""9. The heads: the language model (LM head, Hugging Face's generate()) and sequence classification."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.model.adaptive import ProjectedAdaptiveLogSoftmax
from txl.model.config import TransformerXLConfig
from txl.model.transformer import TransformerXL, TransformerXLPreTrainedModel
from txl.util.entry_points import implementation

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
    recon_loss: Tensor | None = None
    """A Compressive Transformer's attention-reconstruction loss (with gradients on): add it to ``loss`` to train
    the compression functions (its gradient reaches them alone)."""

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
        input_ids: Tensor | None = None,
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
            recon_loss=out.recon_loss,
        )

    def generate(self, input_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Hugging Face's ``model.generate`` (its arguments and defaults; greedy, sampling, beam search) on the K/V
        cache: :func:`txl.infer.generation.generate_like_hf`, which documents the arguments. Generation is built on
        the model, so the model layer names it (``txl.util.entry_points``) instead of importing it."""
        return implementation("TransformerXLLM.generate")(self, input_ids, *args, **kwargs)


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
        self, input_ids: Tensor | None = None, labels: Tensor | None = None, mems: list[Tensor] | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput:  # fmt: skip
        """``labels``: [B] class ids (num_labels > 1), [B] floats (num_labels == 1, regression) or
        [B, num_labels] floats (multi-label). ``inputs_embeds`` (a keyword) may replace ``input_ids``; without ids
        the pooled position is the last one unless an ``attention_mask`` or ``padding`` says otherwise."""
        out = self.transformer(input_ids, mems, **kwargs)
        B, T = out.last_hidden_state.shape[:2]
        dev = out.last_hidden_state.device
        last = torch.full((B,), T - 1, device=dev)
        mask, padding = kwargs.get("attention_mask"), kwargs.get("padding")
        real = None
        if mask is not None or padding is not None:
            real = (mask != 0 if mask is not None else ~padding)[:, -T:].to(dev)  # [B, T]
        elif self.config.pad_token_id is not None and input_ids is not None:
            real = input_ids != self.config.pad_token_id  # [B, T]
        if real is not None:
            # index of the last non-padding token (T-1 - position of the first real token from the right)
            last = torch.where(real.any(1), T - 1 - real.flip(1).int().argmax(1), last)
        pooled = out.last_hidden_state[torch.arange(B, device=dev), last]  # [B, D]
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
