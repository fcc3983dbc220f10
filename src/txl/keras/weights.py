"""Weights both ways, no pickle: a txl folder or a Hugging Face 4.x TransfoXL folder into a Keras model, and a Keras
model back into a txl folder. (Keras's own ``.keras`` files are ``model.save`` / ``keras.saving.load_model``: a zip of
JSON and HDF5, no pickle either.) Design notes: docs/internals.md#txlkerasweights."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from txl.util.folders import CheckpointError


def variables(model: Any) -> dict[str, Any]:
    """txl's PyTorch state-dict name of each weight -> the Keras variable holding it (a tied name -> the variable it
    shares). LayerNorm's weight/bias are Keras's gamma/beta; every kernel has PyTorch's [out, in] layout."""
    cfg = model.config
    base = model.transformer
    prefix = "transformer." if model.TORCH_TWIN != "TransformerXL" else ""  # (txl's base model has no prefix)
    out: dict[str, Any] = {f"{prefix}r_w_bias": base.r_w_bias, f"{prefix}r_r_bias": base.r_r_bias}
    emb = base.word_emb
    for i, w in enumerate(emb.emb_layers):
        out[f"{prefix}word_emb.emb_layers.{i}.weight"] = w
    for i, p in enumerate(emb.emb_projs):
        out[f"{prefix}word_emb.emb_projs.{i}"] = p
    for i, (attn, ff) in enumerate(zip(base.attn, base.ff, strict=True)):
        layer = f"{prefix}layers.{i}"
        out.update({
            f"{layer}.attn.qkv_net.weight": attn.qkv_net,
            f"{layer}.attn.o_net.weight": attn.o_net,
            f"{layer}.attn.r_net.weight": attn.r_net,
            f"{layer}.attn.layer_norm.weight": attn.layer_norm.gamma,
            f"{layer}.attn.layer_norm.bias": attn.layer_norm.beta,
            f"{layer}.ff.layer_1.weight": ff.w1,
            f"{layer}.ff.layer_1.bias": ff.b1,
            f"{layer}.ff.layer_2.weight": ff.w2,
            f"{layer}.ff.layer_2.bias": ff.b2,
            f"{layer}.ff.layer_norm.weight": ff.layer_norm.gamma,
            f"{layer}.ff.layer_norm.bias": ff.layer_norm.beta,
        })  # fmt: skip
    if model.TORCH_TWIN == "TransformerXLLM":
        crit = model.crit
        if cfg.n_clusters:
            out["crit.cluster_weight"], out["crit.cluster_bias"] = crit.cluster_weight, crit.cluster_bias
        for i, b in enumerate(crit.out_biases):
            out[f"crit.out_layers.{i}.weight"] = crit.out_weight(i)
            out[f"crit.out_layers.{i}.bias"] = b
        for i in range(crit.n_projs):
            out[f"crit.out_projs.{i}"] = crit.out_proj(i)
    if model.TORCH_TWIN == "TransformerXLForSequenceClassification":
        out["score.weight"] = model.score
    return out


def txl_class(name: str) -> type:
    import txl

    return getattr(txl, name)


def _torch_class(cls: type) -> type:
    """txl's PyTorch class of a Keras model class (its ``TORCH_TWIN``)."""
    return txl_class(cls.TORCH_TWIN)


def read_torch(cls: type, path: str | Path, trust_pickle: bool = False) -> Any:
    """The PyTorch twin (txl's model) of a Keras class, with the weights of the folder ``path``: a txl folder (a
    model, a ``step-N`` checkpoint, a run) or a Hugging Face 4.x TransfoXL folder."""
    from txl.interop.convert import convert_hf_checkpoint, is_hf_layout

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder (a txl model folder or a Hugging Face TransfoXL folder)")
    config = path / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{config}: not a JSON object ({e})") from None
        if model_type not in (None, "transfo-xl", "txl", "transformer-xl"):
            raise CheckpointError(
                f"{config}: model_type is {model_type!r}, not a Transformer-XL; give a txl folder or a Hugging Face "
                "TransfoXL ('transfo-xl') folder"
            )
    torch_cls = _torch_class(cls)
    if path.is_dir() and is_hf_layout(path):
        model = convert_hf_checkpoint(path, trust_pickle=trust_pickle)
        if torch_cls is txl_class("TransformerXLLM") and not isinstance(model, torch_cls):
            raise CheckpointError(
                f"{path}: a TransfoXLModel checkpoint (no crit.*): it has no language-model head; load it as "
                "TFTransfoXLModel, or TFTransfoXLForSequenceClassification to train a new head"
            )
        if not isinstance(model, torch_cls):  # (an HF LM folder for the base model or the classifier: its body)
            twin = torch_cls(model.config)
            body = getattr(model, "transformer", model)
            (twin.transformer if hasattr(twin, "transformer") else twin).load_state_dict(body.state_dict())
            if hasattr(twin, "score"):  # (as txl's and Hugging Face's from_pretrained say it)
                warnings.warn(
                    f"{path}: a language model's checkpoint: the classification head (score.*) of "
                    f"{cls.__name__} is newly initialised; train it (fit) before use",
                    stacklevel=3,
                )
            model = twin
        return model.eval()
    return torch_cls.from_pretrained(path).eval()


def load(cls: type, path: str | Path, trust_pickle: bool = False, **kwargs: Any) -> Any:
    """The Keras model ``cls`` with the weights of the folder ``path`` (see :func:`read_torch`), exact (fp32)."""
    twin = read_torch(cls, path, trust_pickle)
    model = cls(twin.config, **kwargs)  # (a variant the Keras model does not compute is refused here, by name)
    set_weights(model, {k: v.detach().float().numpy() for k, v in twin.state_dict().items()}, str(path))
    model.tokenizer = read_tokenizer(Path(path))
    return model


def read_tokenizer(path: Path) -> Any:
    """The folder's txl tokenizer (``tokenizer.json``: a txl folder's, or the one a step-N checkpoint or run keeps;
    None without one), for ``generate`` on text. A Hugging Face folder's vocabulary is converted by ``txl convert
    hf``."""
    from txl.data import Tokenizer
    from txl.model.pretrained import model_folder

    try:
        folder = model_folder(path)
    except (CheckpointError, OSError, ValueError):
        folder = path
    if not (Path(folder) / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_pretrained(folder)
    except ValueError as e:  # (a music run's MidiTok tokenizer without MidiTok: the weights load all the same)
        if "MidiTok" not in str(e):
            raise
        warnings.warn(f"{folder}: the model's weights are loaded without its tokenizer ({e})", stacklevel=3)
        return None


def set_weights(model: Any, tensors: dict[str, np.ndarray], source: str = "the weights") -> None:
    """Assign txl state-dict ``tensors`` (every name ``variables(model)`` has; tied names equal) to the model."""
    targets = variables(model)
    missing = sorted(set(targets) - set(tensors))
    if missing:
        raise CheckpointError(f"{source}: missing {len(missing)} weights the model needs, e.g. {missing[:3]}")
    for name, var in targets.items():
        value = np.array(tensors[name], dtype="float32", copy=True)  # (a copy: JAX may share a numpy array's memory)
        if tuple(value.shape) != tuple(var.shape):
            raise CheckpointError(f"{source}: {name} is {list(value.shape)}, the model needs {list(var.shape)}")
        var.assign(value)


def get_weights(model: Any) -> dict[str, np.ndarray]:
    """txl state-dict name -> value (tied names: the same values)."""
    from keras import ops

    return {name: np.asarray(ops.convert_to_numpy(var)) for name, var in variables(model).items()}


def save(model: Any, path: str | Path) -> Path:
    """Write a txl folder (config.json + model.safetensors, through txl's own ``save_pretrained``)."""
    import torch

    twin = _torch_class(type(model))(model.config)
    state = {k: torch.from_numpy(v.copy()) for k, v in get_weights(model).items()}
    twin.load_state_dict(state, strict=True)
    out = twin.save_pretrained(path)
    if getattr(model, "tokenizer", None) is not None:
        model.tokenizer.save(Path(out) / "tokenizer.json")
    return out
