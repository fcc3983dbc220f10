"""Import Hugging Face TransfoXL checkpoints (``TransfoXLLMHeadModel`` / ``TransfoXLModel``).
Design notes: docs/internals.md#txlinteropconvert."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from txl.interop.hf_vocab import TEXT_VOCAB, convert_hf_tokenizer
from txl.model.modeling import HF_CONFIG_NAMES, TransformerXL, TransformerXLConfig, TransformerXLLM
from txl.model.pretrained import (
    CheckpointError,
    check_config_fits_weights,
    hub_hint,
    load_weights,
    read_json,
    read_safetensors,
    tied_aliases,
)

SAME_NAMES = (
    "n_layer", "d_model", "n_head", "d_head", "d_inner", "d_embed", "div_val", "cutoffs", "tie_projs", "dropout",
    "dropatt", "pre_lnorm", "untie_r", "same_length", "clamp_len", "mem_len", "layer_norm_epsilon", "init", "init_std",
    "init_range", "proj_init_std", "pad_token_id",
)  # fmt: skip
"""The configuration fields Hugging Face's TransfoXL and txl both have under one name."""
CONFIG_MAP = HF_CONFIG_NAMES | {"n_token": "n_token"} | {k: k for k in SAME_NAMES}
"""HF config field -> txl config field (fields not listed are ignored: the hub's files carry many)."""
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 267735, "cutoffs": [20000, 40000, 200000], "d_model": 1024, "d_embed": 1024, "n_head": 16,
    "d_head": 64, "d_inner": 4096, "div_val": 4, "pre_lnorm": False, "n_layer": 18, "mem_len": 1600, "clamp_len": 1000,
    "same_length": True, "proj_share_all_but_first": True, "dropout": 0.1, "dropatt": 0.0, "untie_r": True,
    "init": "normal", "init_range": 0.01, "proj_init_std": 0.01, "init_std": 0.02, "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}  # fmt: skip
"""HF's TransfoXLConfig defaults (the WT103 model), for fields a config.json leaves out."""


def hf_config_to_txl(hf: dict[str, Any], source: str = "config.json") -> TransformerXLConfig:
    """Translate an HF ``TransfoXLConfig`` dict; unknown extra fields are ignored."""
    if hf.get("model_type", "transfo-xl") != "transfo-xl":
        raise CheckpointError(f"{source}: model_type is {hf['model_type']!r}, expected 'transfo-xl'")
    if hf.get("attn_type", 0) != 0:
        raise CheckpointError(f"{source}: attn_type {hf['attn_type']} is not supported (only 0, Transformer-XL)")
    full = {**HF_DEFAULTS, **hf}
    if "tie_projs" not in full:  # HF derives it in the constructor from proj_share_all_but_first
        share = full["proj_share_all_but_first"]
        full["tie_projs"] = [False] + [bool(share)] * len(full["cutoffs"])
    ours = {dst: full[src] for src, dst in CONFIG_MAP.items() if src in full}
    id2label = hf.get("id2label")
    if hf.get("num_labels") is not None:
        ours["num_labels"] = int(hf["num_labels"])
    elif isinstance(id2label, dict) and id2label:
        ours["num_labels"] = len(id2label)
    try:
        return TransformerXLConfig(**ours)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def read_hf_weights(src: Path, trust_pickle: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """Read ``model.safetensors`` (or its sharded index); ``pytorch_model.bin`` only with ``trust_pickle``."""
    single, index = src / "model.safetensors", src / "model.safetensors.index.json"
    if single.exists():
        return read_safetensors(single), str(single)
    if index.exists():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(read_safetensors(src / shard))
        return tensors, str(index)
    binary = src / "pytorch_model.bin"
    if binary.exists():
        if not trust_pickle:
            raise CheckpointError(
                f"{binary} is a pickle file; pickles can run arbitrary code when loaded. "
                "If you trust its origin, pass --trust-pickle (it is then read with torch.load(weights_only=True))."
            )
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses any non-tensor object
            raise CheckpointError(
                f"{binary}: not a plain tensor state dict ({_refusal(e)}); it is not loaded"
            ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{binary}: expected a dict of tensors")
        return dict(state), str(binary)
    raise CheckpointError(f"{src}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def _refusal(e: Exception) -> str:
    """What torch.load(weights_only=True) refused, in one line, without its advice to load the file unsafely
    (probes.md s02: "Re-running torch.load with weights_only set to False will likely succeed")."""
    text = " ".join(str(e).split())
    found = re.search(
        r"(Trying to load unsupported GLOBAL [\w.]+|Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+)", text
    )
    what = found.group(1).strip() if found else type(e).__name__
    return f"torch.load(weights_only=True) refused it: {what}"


_LAYER_RENAMES = [
    (r"dec_attn\.(qkv_net|r_net|o_net)\.weight", r"attn.\1.weight"),
    (r"dec_attn\.layer_norm\.(weight|bias)", r"attn.layer_norm.\1"),
    (r"pos_ff\.CoreNet\.0\.(weight|bias)", r"ff.layer_1.\1"),
    (r"pos_ff\.CoreNet\.3\.(weight|bias)", r"ff.layer_2.\1"),
    (r"pos_ff\.layer_norm\.(weight|bias)", r"ff.layer_norm.\1"),
]


def hf_state_dict_to_txl(
    hf: dict[str, torch.Tensor], config: TransformerXLConfig, prefix: str, source: str
) -> dict[str, torch.Tensor]:
    """Rename HF keys; merge tied copies (checked equal) and per-layer biases. Unknown keys are kept (under
    their HF name) so that ``load_weights`` lists them with the missing and mis-shaped ones."""
    out: dict[str, torch.Tensor] = {}
    copies: dict[str, list[tuple[str, torch.Tensor]]] = {}
    per_layer_bias: dict[str, dict[int, torch.Tensor]] = {"r_w_bias": {}, "r_r_bias": {}}
    t = prefix  # "transformer." for the LM head, "" for a bare TransfoXLModel

    def put(name: str, value: torch.Tensor, hf_name: str) -> None:
        copies.setdefault(name, []).append((hf_name, value))

    for key, value in hf.items():
        if key.startswith("crit.") or not key.startswith(t):  # crit.* keeps its name; unknown keys too
            put(key, value, key)
            continue
        rest = key[len(t) :]
        if rest == "pos_emb.inv_freq":
            d = config.d_model
            expected = 1.0 / (10000 ** (torch.arange(0.0, d, 2.0) / d))
            if value.shape != expected.shape or not torch.allclose(value.float(), expected, rtol=1e-6):
                raise CheckpointError(f"{source}: {key} is not the standard sinusoid inverse frequency table")
            continue
        m = re.fullmatch(r"layers\.(\d+)\.dec_attn\.(r_w_bias|r_r_bias)", rest)
        if m:
            per_layer_bias[m.group(2)][int(m.group(1))] = value
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m:
            for pat, rep in _LAYER_RENAMES:
                if re.fullmatch(pat, m.group(2)):
                    put(f"transformer.layers.{m.group(1)}.{re.sub(pat, rep, m.group(2))}", value, key)
                    break
            else:
                put(key, value, key)
            continue
        put(f"transformer.{rest}", value, key)

    for name, biases in per_layer_bias.items():
        if not biases:
            continue
        if config.untie_r:
            if sorted(biases) != list(range(config.n_layer)):
                raise CheckpointError(f"{source}: per-layer {name} missing for some of {config.n_layer} layers")
            put(
                f"transformer.{name}",
                torch.stack([biases[i] for i in range(config.n_layer)]),
                f"layers.*.{name}",
            )
        else:  # HF stores the shared bias again under every layer: aliases of transformer.{name}
            for i, b in biases.items():
                put(f"transformer.{name}", b, f"{t}layers.{i}.dec_attn.{name}")

    for name, group in copies.items():
        first_name, first = group[0]
        for other_name, other in group[1:]:
            if other.shape != first.shape or not torch.equal(other, first):
                raise CheckpointError(
                    f"{source}: {first_name} and {other_name} are tied in the model but differ in the file"
                )
        out[name] = first
    return out


def _check_hf_ties(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Tensors we tie (by config) must be equal in the file wherever the file has both copies."""
    for alias, canonical in tied_aliases(model).items():
        if alias in tensors and canonical in tensors and not torch.equal(tensors[alias], tensors[canonical]):
            raise CheckpointError(
                f"{source}: {alias} must equal {canonical} (tied by tie_weight/tie_projs) but differs; "
                "set tie_word_embeddings/tie_projs in config.json to match the weights"
            )


def convert_hf_checkpoint(src: str | Path, out: str | Path | None = None, trust_pickle: bool = False):
    """Convert an HF TransfoXL folder (``config.json`` + weights) to a txl model; save it to ``out`` if given.

    The tokenizer's vocabulary (``vocab.txt``, or ``vocab.pkl`` with ``trust_pickle``: see ``txl.interop.hf_vocab``) is
    written to ``out/tokenizer.json`` with HF's ids; it must have one symbol per model token. Everything is read
    and checked before anything is written. Returns the model (``TransformerXLLM``, or ``TransformerXL`` for a
    bare ``TransfoXLModel`` checkpoint).
    """
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(
            f"{src}: not a directory (expected an HF folder with config.json and weights){hub_hint(src)}"
        )
    config = hf_config_to_txl(read_json(src / "config.json"), str(src / "config.json"))
    tokenizer = convert_hf_tokenizer(src, trust_pickle) if trust_pickle or (src / TEXT_VOCAB).is_file() else None
    if tokenizer is not None and tokenizer.vocab_size != config.n_token:
        raise CheckpointError(
            f"{src}: the tokenizer has {tokenizer.vocab_size:,} symbols but the model {config.n_token:,} tokens"
        )
    model, source = load_hf_weights(src, config, trust_pickle)
    return load_converted(model, {}, source, tokenizer, out)


def is_hf_layout(src: Path) -> bool:
    """Whether the folder ``src`` holds weights in Hugging Face 4.x's TransfoXL layout (``dec_attn``, ``pos_ff``
    names; a ``pytorch_model.bin`` without a safetensors file counts too), as opposed to txl's own names."""
    single, index = src / "model.safetensors", src / "model.safetensors.index.json"
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(single, "pt") as f:
                keys = list(f.keys())
        except Exception:  # (an unreadable file is reported by whoever reads it)
            return False
    elif index.is_file():
        keys = list(read_json(index).get("weight_map", {}))
    else:
        return (src / "pytorch_model.bin").is_file()
    return any(".dec_attn." in k or ".pos_ff." in k or k.endswith("pos_emb.inv_freq") for k in keys)


def load_hf_weights(
    src: str | Path, config: TransformerXLConfig, trust_pickle: bool = False
) -> tuple[TransformerXL | TransformerXLLM, str]:
    """The txl model (``TransformerXLLM``, or ``TransformerXL`` for a bare ``TransfoXLModel`` checkpoint) of ``config``
    with the weights of the Hugging Face TransfoXL folder ``src`` (renamed, tied copies checked equal, every key
    checked), in eval mode; and the file they came from."""
    hf, source = read_hf_weights(Path(src), trust_pickle)
    # the fields that size the model against the weights, before anything is built (round 6, hl12: n_layer 1e6 grew
    # to 7 GB; d_inner 1e9 failed as an allocation)
    config_path = str(Path(src) / "config.json") if Path(src).is_dir() else f"{src}'s config"
    check_config_fits_weights(config, {k: list(v.shape) for k, v in hf.items()}, config_path, source)
    is_lm = any(k.startswith("transformer.") or k.startswith("crit.") for k in hf)
    prefix = "transformer." if is_lm else ""
    tensors = hf_state_dict_to_txl(hf, config, prefix, source)
    if not is_lm:  # bare base model: drop our "transformer." prefix again
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    check_config_fits_weights(config, {k: list(v.shape) for k, v in tensors.items()}, config_path, source)
    model = (TransformerXLLM if is_lm else TransformerXL)(config, init=False)
    _check_hf_ties(model, tensors, source)
    load_weights(model, tensors, source)
    return model.eval(), source


def load_converted(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str, tokenizer, out) -> Any:
    """``model`` with ``tensors`` loaded (all checked together), in eval mode; saved with ``tokenizer`` (if any) to
    ``out`` if given."""
    if tensors:
        load_weights(model, tensors, source)
    model.eval()
    if out is not None:
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save(Path(out) / "tokenizer.json")
    return model
