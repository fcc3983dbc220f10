"""Import the original TensorFlow code's checkpoints (``tf/``, and the paper's published models of
``tf/sota/download.sh``: ``pretrained_xl/tf_{wt103,enwik8,text8,lm1b}/model/model.ckpt-*``) without TensorFlow.
Design notes: docs/internals.md#txlinteropconvert_tf."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from txl.data import Tokenizer
from txl.interop.convert_original import build_converted, corpus_vocabulary, vocab_tokenizer
from txl.interop.tf_checkpoint import checkpoint_prefix, read_tf_checkpoint
from txl.model.modeling import TransformerXLConfig, TransformerXLLM
from txl.model.pretrained import CheckpointError

T = "transformer/"
# tf/sota/*.sh: the published models' evaluation settings (mem_len, clamp_len, same_length), by vocabulary size
SOTA = {
    267_735: ("wt103", 1600, 1000, True),
    204: ("enwik8", 3800, 1000, True),
    27: ("text8", 3800, 1000, True),
    793_471: ("lm1b", 128, -1, True),
}
TF_LAYER_NORM_EPSILON = 1e-12


class _Read(dict):
    """The checkpoint's variables, remembering which were read (the rest would be dropped without a word)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key in self:
            self.read.add(key)
        return super().get(key, default)


RANKS = (
    (re.compile(r"layer_\d+/(rel_attn/(qkv|r|o)|ff/layer_[12])/kernel"), 2, "a kernel [in, out]"),
    (re.compile(r"layer_\d+/(rel_attn|ff)/LayerNorm/(gamma|beta)|layer_\d+/ff/layer_[12]/bias"), 1, "a vector"),
    (re.compile(r"r_[wr]_bias"), (2, 3), "[n_head, d_head], or [n_layer, n_head, d_head] with untie_r"),
    (re.compile(r"adaptive_embed/(cutoff_\d+/)?(lookup_table|proj_W)"), 2, "a matrix"),
    (re.compile(r"adaptive_softmax/(cutoff_\d+/)?(proj|cluster_W)"), 2, "a matrix"),
    (re.compile(r"adaptive_softmax/(cutoff_\d+/(b|cluster_b)|bias)"), 1, "a vector"),
)
"""Each variable of the TF code's model (after ``transformer/``): the rank its tensor has, and what it is."""


def _check_ranks(tf: dict[str, torch.Tensor], source: str) -> None:
    """Every variable's rank, before any is used (probes tf12-tf19: a 0-D or 1-D lookup table and a 3-D kernel were
    IndexErrors or t() errors deep in the conversion, a 1-D qkv kernel blamed the embedding's projection)."""
    for name, value in tf.items():
        for pattern, rank, what in RANKS:
            if pattern.fullmatch(name[len(T) :]):
                ranks = rank if isinstance(rank, tuple) else (rank,)
                if value.dim() not in ranks:
                    raise CheckpointError(
                        f"{source}: {name} has shape {list(value.shape)} ({value.dim()}-D); the TF code's is {what} "
                        f"({' or '.join(map(str, ranks))}-D): not a Transformer-XL checkpoint of the TF code"
                    )
                break


def _need(tf: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in tf:
        raise CheckpointError(f"{source}: no variable {name} (not a Transformer-XL checkpoint of the TF code)")
    return tf[name]


def _layers(tf: dict[str, torch.Tensor], n_layer: int, untie_r: bool, source: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = {
        "rel_attn/qkv/kernel": "dec_attn.qkv_net.weight",
        "rel_attn/r/kernel": "dec_attn.r_net.weight",
        "rel_attn/o/kernel": "dec_attn.o_net.weight",
        "rel_attn/LayerNorm/gamma": "dec_attn.layer_norm.weight",
        "rel_attn/LayerNorm/beta": "dec_attn.layer_norm.bias",
        "ff/layer_1/kernel": "pos_ff.CoreNet.0.weight",
        "ff/layer_1/bias": "pos_ff.CoreNet.0.bias",
        "ff/layer_2/kernel": "pos_ff.CoreNet.3.weight",
        "ff/layer_2/bias": "pos_ff.CoreNet.3.bias",
        "ff/LayerNorm/gamma": "pos_ff.layer_norm.weight",
        "ff/LayerNorm/beta": "pos_ff.layer_norm.bias",
    }
    for layer in range(n_layer):
        for tf_name, ours in names.items():
            value = _need(tf, f"{T}layer_{layer}/{tf_name}", source)
            out[f"transformer.layers.{layer}.{ours}"] = value.t() if tf_name.endswith("kernel") else value
    for bias in ("r_w_bias", "r_r_bias"):
        value = _need(tf, T + bias, source)
        if untie_r and value.shape[0] != n_layer:
            raise CheckpointError(
                f"{source}: {T}{bias} has {value.shape[0]} rows (one per layer, untied) but the checkpoint has "
                f"{n_layer} layers: not a consistent Transformer-XL checkpoint"
            )
        if untie_r:
            for layer in range(n_layer):
                out[f"transformer.layers.{layer}.dec_attn.{bias}"] = value[layer]
        else:
            out[f"transformer.{bias}"] = value
    return out


def _adaptive(tf: dict[str, torch.Tensor], d_model: int, source: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The embedding and softmax: their configuration and tensors (the original PyTorch names)."""
    out: dict[str, torch.Tensor] = {}
    emb, soft = T + "adaptive_embed/", T + "adaptive_softmax/"
    if emb + "lookup_table" in tf:  # div_val 1: one table (its rows sliced per cluster in the softmax)
        table = tf[emb + "lookup_table"]
        n_token, d_embed = table.shape
        sizes = [tf[f"{soft}cutoff_{i}/b"].numel() for i in range(len(tf)) if f"{soft}cutoff_{i}/b" in tf]
        cutoffs = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        out["transformer.word_emb.emb_layers.0.weight"] = out["crit.out_layers.0.weight"] = table
        has_proj = emb + "proj_W" in tf
        if has_proj:
            out["transformer.word_emb.emb_projs.0"] = tf[emb + "proj_W"].t()
        if sizes:
            out["crit.out_layers.0.bias"] = torch.cat([tf[f"{soft}cutoff_{i}/b"] for i in range(len(sizes))])
        else:
            out["crit.out_layers.0.bias"] = _need(tf, soft + "bias", source)
        tie_projs = []
        for i in range(len(cutoffs) + 1):
            own = tf.get(f"{soft}cutoff_{i}/proj")
            tie_projs.append(has_proj and own is None)
            if has_proj:
                out[f"crit.out_projs.{i}"] = own.t() if own is not None else out["transformer.word_emb.emb_projs.0"]
        fields = {"n_token": int(n_token), "d_embed": int(d_embed), "div_val": 1, "cutoffs": cutoffs}
    else:  # div_val > 1: a table and a projection per cluster
        tables = []
        while f"{emb}cutoff_{len(tables)}/lookup_table" in tf:
            tables.append(tf[f"{emb}cutoff_{len(tables)}/lookup_table"])
        if len(tables) < 2:
            raise CheckpointError(f"{source}: no {emb}lookup_table or cutoff_0/1 tables (not a Transformer-XL)")
        d_embed, div_val = tables[0].shape[1], tables[0].shape[1] // tables[1].shape[1]
        if any(t.shape[1] != d_embed // div_val**i for i, t in enumerate(tables)):
            raise CheckpointError(f"{source}: embedding widths {[t.shape[1] for t in tables]} are not d_embed / div^i")
        sizes = [t.shape[0] for t in tables]
        cutoffs = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        tie_projs = []
        for i, table in enumerate(tables):
            eye = torch.eye(d_model, dtype=table.dtype)  # (proj_same_dim=False: a d_model-wide cluster has none)
            proj = tf.get(f"{emb}cutoff_{i}/proj_W")
            emb_proj = proj.t() if proj is not None else eye
            if emb_proj.shape != (d_model, table.shape[1]):
                raise CheckpointError(f"{source}: {emb}cutoff_{i} has no projection to d_model = {d_model}")
            own = tf.get(f"{soft}cutoff_{i}/proj")
            tied = own is None and proj is not None
            tie_projs.append(tied)
            out[f"transformer.word_emb.emb_layers.{i}.weight"] = out[f"crit.out_layers.{i}.weight"] = table
            out[f"transformer.word_emb.emb_projs.{i}"] = emb_proj
            out[f"crit.out_projs.{i}"] = emb_proj if tied else (own.t() if own is not None else eye)
            out[f"crit.out_layers.{i}.bias"] = _need(tf, f"{soft}cutoff_{i}/b", source)
        fields = {"n_token": int(sum(sizes)), "d_embed": int(d_embed), "div_val": int(div_val), "cutoffs": cutoffs}
    if cutoffs:
        out["crit.cluster_weight"] = _need(tf, soft + "cutoff_0/cluster_W", source)
        out["crit.cluster_bias"] = _need(tf, soft + "cutoff_0/cluster_b", source)
    fields["tie_projs"] = tie_projs
    return fields, out


def _data_folder(src: Path) -> Path | None:
    """``pretrained_xl/tf_X/data`` beside ``.../model`` (the published layout), if there."""
    for base in (src, src.parent, src.parent.parent):
        if (base / "data" / "cache.pkl").is_file():
            return base / "data"
    return None


def convert_tf_checkpoint(
    src: str | Path,
    out: str | Path | None = None,
    corpus: str | Path | None = None,
    trust_pickle: bool = False,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
) -> tuple[TransformerXLLM, Tokenizer | None, str]:
    """Convert a TF Transformer-XL checkpoint (a prefix, its ``.index`` or its folder) to a txl model.

    ``corpus``: the data folder's ``cache.pkl`` for the vocabulary (default: ``data/cache.pkl`` of the published
    layout), read only with ``trust_pickle`` (else the weights alone are converted, and the note says why). Returns
    the model, the tokenizer (or None) and a note: where the memory settings came from, and why the vocabulary was not
    read if it was not. Everything is read and checked before anything is written to ``out``.
    """
    prefix = checkpoint_prefix(src)
    source = str(prefix)
    tf = _Read(
        {k: v for k, v in read_tf_checkpoint(prefix).items() if k.startswith(T) and not k.endswith(("Adam", "Adam_1"))}
    )
    whole = [k for k, v in tf.items() if not v.is_floating_point()]
    if whole:  # (probes.md tf11: an integer r_w_bias was converted, its values truncated)
        raise CheckpointError(
            f"{source}: {whole[0]} holds {tf[whole[0]].dtype} values; the model's variables are floating-point"
        )
    _check_ranks(tf, source)
    qkv = _need(tf, T + "layer_0/rel_attn/qkv/kernel", source)
    d_model = int(qkv.shape[0])
    n_layer = 1 + max(int(k[len(T) :].split("/")[0].split("_")[1]) for k in tf if k.startswith(T + "layer_"))
    r_w_bias = _need(tf, T + "r_w_bias", source)  # (its rank checked above: probes.md tf5/tf6)
    untie_r = r_w_bias.dim() == 3
    r_r_bias = _need(tf, T + "r_r_bias", source)
    if r_r_bias.shape != r_w_bias.shape:  # (probes tf19: a 1-D r_r_bias was blamed on its row count)
        raise CheckpointError(
            f"{source}: {T}r_w_bias has shape {list(r_w_bias.shape)} and {T}r_r_bias {list(r_r_bias.shape)}; the TF "
            "code's two biases have one shape"
        )
    if qkv.shape[1] != 3 * r_w_bias.shape[-2] * r_w_bias.shape[-1]:  # (probes tf17: blamed on the embedding)
        raise CheckpointError(
            f"{source}: {T}layer_0/rel_attn/qkv/kernel has shape {list(qkv.shape)}; the TF code's is [d_model, 3 x "
            f"n_head x d_head = {3 * r_w_bias.shape[-2] * r_w_bias.shape[-1]}] for r_w_bias {list(r_w_bias.shape)}"
        )
    fields, tensors = _adaptive(tf, d_model, source)
    tensors |= _layers(tf, n_layer, untie_r, source)
    dataset, *sota = SOTA.get(fields["n_token"], (None, None, -1, True))  # (no model of the paper: defaults)
    if mem_len is None and sota[0] is None:
        raise CheckpointError(f"{source}: a TF checkpoint holds no memory length; give --mem_len (and --clamp_len)")
    given = {"mem_len": mem_len, "clamp_len": clamp_len, "same_length": same_length}
    settings = {k: sota[i] if v is None else v for i, (k, v) in enumerate(given.items())}
    fallback = f"tf/sota/{dataset}.sh" if dataset else "default"
    note = ", ".join(f"{k} {v} ({'option' if given[k] is not None else fallback})" for k, v in settings.items())
    if settings["same_length"]:
        note += " with the TF code's window of mem_len + 1 keys (tf_same_length)"
    note += "; the TF code read every text from mem_len zero vectors: txl eval --zero_memory true reads as it did"
    try:
        config = TransformerXLConfig(
            n_layer=n_layer, d_model=d_model, n_head=int(r_w_bias.shape[-2]), d_head=int(r_w_bias.shape[-1]),
            d_inner=int(_need(tf, T + "layer_0/ff/layer_1/kernel", source).shape[1]), tie_weight=True,
            untie_r=untie_r, dropout=0.0, dropatt=0.0, layer_norm_epsilon=TF_LAYER_NORM_EPSILON, tf_same_length=True,
            **fields, **settings,
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None
    unused = sorted(set(tf) - tf.read)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise CheckpointError(
            f"{source}: variables that this conversion does not know ({shown}): a variant of the TF code's model it "
            "would convert without them"
        )
    tokenizer = None
    cache = Path(corpus) if corpus is not None else (_data_folder(prefix.parent) or Path()) / "cache.pkl"
    if corpus is not None and not cache.is_file():
        raise CheckpointError(f"{cache}: not found")
    if not cache.is_file():
        note += "; no vocabulary: no data/cache.pkl beside the model (give it with --corpus, else txl generate needs "
        note += "--prompt_ids)"
    elif not trust_pickle:  # the weights alone, as txl convert hf does without trust
        note += (
            f"; vocabulary not read: {cache} is a pickle (pickles can run code when loaded); if you trust its origin "
            "pass --trust-pickle (it is read with a restricted unpickler that runs nothing)"
        )
    else:
        vocab, cache_dataset = corpus_vocabulary(cache, "the TF code")
        tokenizer = vocab_tokenizer(vocab, cache_dataset or dataset, str(cache))
    return build_converted(config, tensors, source, tokenizer, str(cache), out), tokenizer, note
