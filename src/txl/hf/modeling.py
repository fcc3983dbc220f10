"""Hugging Face's TransfoXL models as transformers-5 ``PreTrainedModel`` classes over txl's model.
Design notes: docs/internals.md#txlhfmodeling."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from txl.hf.configuration import TransfoXLConfig
from txl.hf.generation import MemoryGenerationMixin
from txl.hf.tokenization import library_words
from txl.interop.convert import is_hf_layout, load_hf_weights
from txl.model.config import check_time_major_mems
from txl.model.modeling import TransformerXL, TransformerXLLM
from txl.model.pretrained import CheckpointError, tied_aliases
from txl.model.transformer import init_module

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
        """txl's initialisation (the original ``weights_init``: :func:`txl.model.transformer.init_module`), one
        module at a time, with transformers' init functions (they leave weights that were loaded alone)."""
        init_module(module, self.config, ops=init)

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
        if folder.is_dir() and _txl_folder(folder) is not None:  # (a model trained with txl: its own format)
            return cls.from_txl(_txl_folder(folder), **kwargs)
        if not (folder.is_dir() and is_hf_layout(folder)):
            if folder.is_dir():  # (its weights' dtypes and shape against the config, from the headers, first)
                given = kwargs.get("config")
                has_config = isinstance(given, TransfoXLConfig) or (folder / "config.json").is_file()
                saved = given if isinstance(given, TransfoXLConfig) else None
                if has_config and saved is None:
                    saved = TransfoXLConfig.from_pretrained(folder)
                _check_headers(folder, saved, dtypes=True)
            loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
            model = loaded[0] if isinstance(loaded, tuple) else loaded  # (output_loading_info=True)
            bad = [n for n, p in model.named_parameters()
                   if p.is_floating_point() and p.device.type != "meta" and not torch.isfinite(p).all()]  # fmt: skip
            if bad:  # (probes hf18: a NaN weight loaded silently; txl's own loaders refuse it)
                raise OSError(
                    f"{folder}: non-finite values (NaN/inf: a diverged or corrupted checkpoint) in {', '.join(bad[:5])}"
                )
            return loaded
        config = kwargs.pop("config", None)
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        device = _device_of(kwargs.pop("device_map", None))
        for k in list(kwargs):  # (arguments of a download, a memory hint or transformers' own: nothing to do here)
            if k in _LOCAL_NO_OPS or k.startswith("_") or k == "subfolder" and not kwargs[k]:
                kwargs.pop(k)
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in TransfoXLConfig.__dataclass_fields__}
        if kwargs:  # (probes D6: device_map, quantization_config and the like were dropped silently)
            raise TypeError(
                f"from_pretrained({str(folder)!r}): {', '.join(sorted(kwargs))} cannot be applied to a folder in "
                "Hugging Face 4.x's TransfoXL layout (txl reads it with its converter); it takes config fields, "
                "dtype, device_map (one device) and trust_pickle. Save it once with save_pretrained to load it "
                "through transformers with every argument"
            )
        if config is None:
            config = TransfoXLConfig.from_pretrained(folder, **overrides)
        elif overrides:
            config = TransfoXLConfig.from_dict({**config.to_dict(), **overrides})
        if not isinstance(config, TransfoXLConfig):
            raise TypeError(f"config must be a TransfoXLConfig, not {type(config).__name__}")
        _check_headers(folder, config)
        try:
            txl_model, source = load_hf_weights(folder, config.to_txl(), trust_pickle)
        except CheckpointError as e:
            raise OSError(library_words(str(e))) from None
        with torch.device("meta"):
            model = cls(config, *model_args)
        return model._adopted(txl_model, source, dtype, device)

    def _adopted(self, txl_model: TransformerXL | TransformerXLLM, source: str, dtype: Any, device: Any):
        """This model (built on the meta device) with the modules of ``txl_model``, its ties declared, in ``dtype``
        on ``device`` (None: as they are), in eval mode."""
        self._adopt(txl_model, source)
        for module in self.modules():
            if isinstance(module, TransfoXLPreTrainedModel):
                module._declare_ties()
        model = self
        if dtype is not None and dtype != "auto":
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        if device is not None:
            model = model.to(device)
        return model.eval()

    def _adopt(self, txl_model: TransformerXL | TransformerXLLM, source: str) -> None:
        """Take the modules of ``txl_model`` (loaded from ``source``) in place of this model's (built on the meta
        device)."""
        raise NotImplementedError

    @classmethod
    def from_txl(cls, model: str | Path | TransformerXLLM, **kwargs: Any):
        """This class over a model trained with txl: a txl model folder, a run folder (its best checkpoint) or a
        step-N checkpoint, read by txl's loader (every tensor checked), or a ``TransformerXLLM``; the configuration
        from :meth:`TransfoXLConfig.from_txl` (``kwargs``: its fields, ``dtype``, ``device_map``). The folder's
        tokenizer stays txl's: a text model's through ``TransfoXLTokenizer``, a music model's is MidiTok's own
        ``tokenizer.json`` (``miditok.REMI.from_pretrained(folder)``)."""
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
        device = _device_of(kwargs.pop("device_map", None))
        if isinstance(model, TransformerXLLM):
            lm, source = model, "the txl model"
        else:
            folder = _txl_folder(Path(model))
            if folder is None:
                raise OSError(f"{model}: no txl model here (config.json in txl's format, a run or a step-N folder)")
            try:
                lm, source = TransformerXLLM.from_pretrained(folder), str(folder / "model.safetensors")
            except CheckpointError as e:
                raise OSError(library_words(str(e))) from None
            kwargs = _special_ids(folder) | kwargs
        config = TransfoXLConfig.from_txl(lm.config, **({"eos_token_id": None} | kwargs))
        with torch.device("meta"):
            hf = cls(config)
        if not isinstance(model, TransformerXLLM):  # (where its tokenizer.json is: model.name_or_path)
            hf.config.name_or_path = hf.name_or_path = str(folder)
        return hf._adopted(lm, source, dtype, device)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, layer: int = -1, **kwargs: Any) -> nn.Module:
        """Hugging Face 4.x's TransfoXL resize: the adaptive embedding's cluster ``layer`` (the last by default) gets
        rows added (initialised as the model initialises) or removed at its end, and so does the adaptive softmax's
        output layer of that cluster (tied again where the model ties them); ``vocab_size`` and ``cutoffs`` follow.
        Resizing another cluster than the last moves the ids after it: the tokenizer's new tokens must be placed to
        match, as in 4.x. Returns the input embedding."""
        if kwargs:  # (transformers 5's pad_to_multiple_of / mean_resizing have no adaptive equivalent)
            raise TypeError(
                f"resize_token_embeddings: {', '.join(sorted(kwargs))} is not supported by TransfoXL's adaptive "
                "embedding (it takes new_num_tokens and layer, as in Hugging Face 4.x)"
            )
        emb = self.get_input_embeddings()
        if new_num_tokens is None:
            return emb
        core = self.transformer.core if hasattr(self, "transformer") else self.core
        n = len(emb.emb_layers)
        if isinstance(layer, bool) or not isinstance(layer, int) or not -n <= layer < n:
            raise ValueError(
                f"resize_token_embeddings: layer must be an index of the {n} embedding clusters, got {layer!r}"
            )
        layer %= n
        sizes = [e.num_embeddings for e in emb.emb_layers]
        rows = new_num_tokens - (sum(sizes) - sizes[layer])
        cutoffs = list(self.config.cutoffs)
        if rows <= 0 or (n == 1 and cutoffs and new_num_tokens <= cutoffs[-1]):
            raise ValueError(
                f"resize_token_embeddings({new_num_tokens}): the cluster {layer} would have no tokens left "
                f"(cutoffs {cutoffs}, cluster sizes {sizes})"
            )
        emb.emb_layers[layer] = self._resized(emb.emb_layers[layer], rows)
        sizes[layer] = rows
        if n > 1:  # (one table per cluster: the cutoffs are the tables' cumulative sizes)
            cutoffs = [sum(sizes[: i + 1]) for i in range(n - 1)]
        ends = [0, *cutoffs, new_num_tokens]
        emb.ends = ends
        crit = getattr(self, "crit", None)
        if crit is not None:
            i = layer if n > 1 else 0
            crit.out_layers[i] = self._resized(crit.out_layers[i], rows if n > 1 else new_num_tokens)
            crit.ends, crit.n_token, crit.shortlist = ends, new_num_tokens, ends[1]
        self.config.vocab_size, self.config.cutoffs = new_num_tokens, cutoffs
        core.config.n_token, core.config.cutoffs = new_num_tokens, list(cutoffs)
        if crit is not None and core.config.tie_weight:  # (txl's rule: each output layer is its cluster's table)
            for out_layer, emb_layer in zip(crit.out_layers, emb.emb_layers, strict=True):
                out_layer.weight = emb_layer.weight
        for module in self.modules():
            if isinstance(module, TransfoXLPreTrainedModel):
                module._declare_ties()
        return self.get_input_embeddings()

    def _resized(self, module: nn.Embedding | nn.Linear, rows: int) -> nn.Module:
        """``module`` with ``rows`` rows (the first ones kept, new ones initialised as the model initialises)."""
        w = module.weight
        if isinstance(module, nn.Embedding):
            new = nn.Embedding(rows, w.shape[1], device=w.device, dtype=w.dtype)
        else:
            new = nn.Linear(w.shape[1], rows, bias=module.bias is not None, device=w.device, dtype=w.dtype)
        self._init_weights(new)
        keep = min(rows, w.shape[0])
        with torch.no_grad():
            new.weight[:keep] = w[:keep]
            if getattr(module, "bias", None) is not None:
                new.bias[:keep] = module.bias[:keep]
        return new

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


_LOCAL_NO_OPS = ("low_cpu_mem_usage", "local_files_only", "cache_dir", "force_download", "proxies", "token",
                 "revision", "code_revision", "trust_remote_code", "use_safetensors", "adapter_kwargs")  # fmt: skip
"""``from_pretrained`` arguments that change nothing when a local 4.x-layout folder is read whole into memory."""


def _special_ids(folder: Path) -> dict[str, int | None]:
    """The generation ids of a txl folder's tokenizer: a music model's BOS / EOS / PAD (MidiTok's), a text model's
    end of line (``<eos>``) where it has one; none without a tokenizer."""
    from txl.data import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        return {}
    tok = Tokenizer.load(path)
    if getattr(tok, "kind", None) == "remi":
        return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    eos = tok.eos_token
    return {"eos_token_id": tok.token_to_id(eos)} if eos else {}


def _txl_folder(folder: Path) -> Path | None:
    """The model folder of a txl folder (its own, a run's best checkpoint or a step-N), or None: not txl's format."""
    from txl.model.pretrained import FORMAT, model_folder
    from txl.util.folders import read_json

    try:
        found = model_folder(folder)
        return found if read_json(found / "config.json").get("format") == FORMAT else None
    except Exception:  # (not a txl folder: transformers' own loading says what is wrong)
        return None


def _check_headers(folder: Path, config: TransfoXLConfig | None, dtypes: bool = False) -> None:
    """From the safetensors headers of a local folder (nothing allocated), before the model is built: the config's
    shape (n_layer, d_model, d_inner, vocab_size, n_head x d_head) against the weights (probes rl29, hl1-hl5: a
    config.json asking for 1,000,000 layers over the weights of 2 was built first), and with ``dtypes`` floating-point
    tensors only (probes hf22: transformers' loading cast an int64 weight silently; txl's loaders never cast). One
    OSError naming the field or the tensor."""
    from txl.model.pretrained import check_config_fits_weights, safetensors_index

    index: dict[str, tuple] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            entries = safetensors_index(path)[0]
        except CheckpointError:
            return  # (the loader names what is wrong with the file)
        whole = [(k, e[0]) for k, e in entries.items() if not e[0].is_floating_point]
        if dtypes and whole:
            raise OSError(
                f"{path}: {whole[0][0]} holds {whole[0][1]} values; the model's weights are floating-point (txl never "
                "casts weights: convert the file, or save the model again)"
            )
        index |= entries
    if config is None:
        return
    try:
        shapes = {k: e[1] for k, e in index.items()}
        check_config_fits_weights(config.to_txl(), shapes, str(folder / "config.json"), f"{folder}'s weights")
    except CheckpointError as e:
        raise OSError(str(e)) from None


def _device_of(device_map: Any) -> torch.device | None:
    """The one device of a ``device_map`` (a device, its name or index, ``"auto"``, or ``{"": device}``); a map that
    splits the model over several devices is refused."""
    if device_map is None:
        return None
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device("cuda", device_map)
    if isinstance(device_map, str | torch.device):
        return torch.device(device_map)
    raise ValueError(
        f"device_map={device_map!r}: a folder in Hugging Face 4.x's layout loads onto one device (a device, its "
        'name or index, "auto", or {"": device}); save it with save_pretrained to split it over several'
    )


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

    @property
    def mem_len(self) -> int:
        """The memory length: ``config.mem_len``, the one value every call reads (set it here, in the config, or with
        :meth:`reset_memory_length`)."""
        return self.config.mem_len

    @mem_len.setter
    def mem_len(self, mem_len: int) -> None:
        self.reset_memory_length(mem_len)

    def reset_memory_length(self, mem_len: int) -> None:
        """Hugging Face 4.x's: remember ``mem_len`` positions from now on (``config.mem_len`` too)."""
        if isinstance(mem_len, bool) or not isinstance(mem_len, int) or mem_len < 0:
            raise ValueError(f"reset_memory_length: mem_len must be an integer >= 0, got {mem_len!r}")
        if mem_len == 0 and self.config.same_length:
            raise ValueError("reset_memory_length: mem_len 0 with same_length=True (same_length needs a memory)")
        self.config.mem_len = mem_len
        self.core.config.mem_len = mem_len

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
        if (input_ids is None) == (inputs_embeds is None):  # (probes D9b: an AttributeError on None.shape)
            raise ValueError("You have to specify either input_ids or inputs_embeds (one of them)")
        batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        if mems is None and cfg.mem_init == "zeros":
            mems = self.init_mems(batch)
        if mems is not None:
            check_time_major_mems(mems, batch, cfg)
        out = self.core(
            input_ids,
            None if mems is None else [m.transpose(0, 1) for m in mems],  # -> txl's [batch, M, d_model]
            mem_len=cfg.mem_len,  # (config.mem_len, read at every call: probes D2)
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


class TransfoXLLMHeadModel(TransfoXLPreTrainedModel, MemoryGenerationMixin):
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
            if not isinstance(labels, Tensor) or tuple(labels.shape) != (B, T):  # (probes D9c)
                got = list(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
                raise ValueError(f"labels must be [batch, seq_len] = [{B}, {T}] (usually input_ids), got {got}")
            targets = labels[:, 1:].to(h.device)  # [B, T - 1]: "tokens < n predict n"
            nll, _ = self.crit(h[:, :-1].reshape(-1, D), targets.reshape(-1))
            scored = (targets != -100).sum()
            loss = nll.sum() / scored.clamp(min=1)
            if not self.config.keep_order and self.crit.n_clusters > 0:  # (4.x groups by cluster only with clusters)
                nll = self._grouped(nll, targets.reshape(-1))
            losses = nll.view(B, T - 1)
        else:
            _, log_probs = self.crit(h.reshape(-1, D), None, True)
            scores = log_probs.view(B, T, -1)
        if not return_dict:  # Hugging Face 4.x's tuples, () where its prediction_scores were empty (with labels)
            rest = tuple(v for v in (out.mems, out.hidden_states, out.attentions) if v is not None)
            first = () if scores is None else scores
            if self.config.trainer_compatible:
                head = (first, losses) if losses is not None else (first,)
                return ((loss,) + head + rest) if loss is not None else head + rest
            head = ((losses, first) if losses is not None else (first,)) + rest
            return head + (loss,) if loss is not None else head
        return TransfoXLLMHeadModelOutput(
            losses=losses,
            prediction_scores=scores,
            mems=out.mems,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
            loss=loss,
        )

    def reset_memory_length(self, mem_len: int) -> None:
        """Hugging Face 4.x's: the memory length from now on (see ``TransfoXLModel.reset_memory_length``)."""
        self.transformer.reset_memory_length(mem_len)

    def init_mems(self, bsz: int) -> list[Tensor] | None:
        return self.transformer.init_mems(bsz)

    def _grouped(self, nll: Tensor, targets: Tensor) -> Tensor:
        """The losses in Hugging Face 4.x's order (``keep_order=False``): the head cluster's positions first, then
        each tail cluster's (row-major within each), the unscored ones (zeros) last."""
        ends = torch.tensor(self.crit.ends[1:-1], device=targets.device)
        cluster = torch.bucketize(targets, ends, right=True)  # [N]: 0 (head), 1, 2, ...
        cluster = torch.where(targets == -100, len(self.crit.ends), cluster)
        return nll[torch.argsort(cluster, stable=True)]


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
