"""Import checkpoints of the original PyTorch code (kimiyoung/transformer-xl) and of NVIDIA's port of it
(DeepLearningExamples ``TransformerXL/pytorch``), running none of their code.
Design notes: docs/internals.md#txlinteropconvert_original."""

from __future__ import annotations

import types
import warnings
from collections import defaultdict
from pathlib import Path
from pickle import UnpicklingError
from typing import Any

import numpy as np
import torch
import torch._utils
from numpy._core import multiarray as np_multiarray

from txl.data import Tokenizer
from txl.data.errors import DataError
from txl.data.rawtext import Moses
from txl.data.tokenizer import BYTE_CHARS
from txl.interop.convert import hf_state_dict_to_txl, load_converted
from txl.interop.hf_vocab import Inert, Refused, RestrictedUnpickler
from txl.model.modeling import TransformerXLConfig, TransformerXLLM
from txl.model.pretrained import CheckpointError

# Modules whose classes become stubs: the original code's, NVIDIA's (same names), torch.nn's and argparse's.
STUB_MODULES = (
    "mem_transformer", "proj_adaptive_softmax", "log_uniform_sampler", "vocabulary", "data_utils", "data_parallel",
    "utils.", "torch.nn.modules.", "torch.nn.backends.", "torch.nn.parallel.", "argparse",
)  # fmt: skip
# Functions that rebuild tensors (called with the file's storages only), and plain containers.
TENSOR_FUNCTIONS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): torch._utils._rebuild_tensor_v3,  # (newer torch, some dtypes)
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("collections", "defaultdict"): defaultdict,
    ("torch", "Size"): torch.Size,
    # numpy arrays (the TF code's corpus cache): rebuilt from their dtype, shape and bytes
    ("numpy.core.multiarray", "_reconstruct"): np_multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np_multiarray._reconstruct,
    ("numpy.core.multiarray", "scalar"): np_multiarray.scalar,
    ("numpy._core.multiarray", "scalar"): np_multiarray.scalar,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class Stub(Inert):
    """:class:`txl.interop.hf_vocab.Inert` for a class of the original code, torch.nn or argparse: its state (a module's
    ``_parameters``, ``_buffers``, ``_modules`` and attributes) as a dict, read with :meth:`get` and :meth:`child`."""

    origin = "?"
    state: dict[str, Any] = {}  # (until the pickle sets it)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict | None):  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {"state": state}

    def get(self, name: str, default: Any = None) -> Any:
        return self.state.get(name, default)

    def child(self, name: str) -> Stub | None:
        return (self.state.get("_modules") or {}).get(name)


_STUBS: dict[str, type[Stub]] = {}


def _stub_class(module: str, name: str) -> type[Stub]:
    origin = f"{module}.{name}"
    if origin not in _STUBS:
        attrs = {"__module__": __name__, "__qualname__": f"Stub[{origin}]", "origin": origin}
        _STUBS[origin] = type(name, (Stub,), attrs)
    return _STUBS[origin]


class Unpickler(RestrictedUnpickler):
    """:class:`txl.interop.hf_vocab.RestrictedUnpickler` plus the tensor rebuilders and stubs (module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in TENSOR_FUNCTIONS:
            return TENSOR_FUNCTIONS[(module, name)]
        if module.startswith(STUB_MODULES):
            return _stub_class(module, name)
        try:
            return super().find_class(module, name)
        except Refused:
            what = "tensors, plain data, and the original code's, torch.nn's and argparse's classes as inert data"
            raise Refused(f"refused to load {module}.{name} (only {what})") from None


def _load(f: Any, **kwargs: Any) -> Any:
    return Unpickler(f, **kwargs).load()


# What torch.load calls on its pickle module: Unpickler (for the model) and load (the legacy format's header).
PICKLE_MODULE = types.SimpleNamespace(__name__="txl.interop.convert_original", Unpickler=Unpickler, load=_load)


TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first object of PyTorch's pre-1.6 format


def read_trusted_pickle(path: Path) -> Any:
    """``path`` through :class:`Unpickler`: a ``torch.save`` file (the zip format or PyTorch 0.4's legacy one, with
    ``torch.load``) or a plain pickle (the TF code's ``cache.pkl``)."""
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
            f.seek(0)
            first = None if zipped else Unpickler(f).load()
        if not zipped and first != TORCH_LEGACY_MAGIC:
            return first
        with warnings.catch_warnings():  # (the legacy format's "couldn't retrieve source code" of the stubs)
            warnings.simplefilter("ignore")
            # weights_only=False is what lets torch.load take a pickle_module: ours, whose find_class admits only
            # tensor rebuilders, plain data and inert stubs (the caller has asked for --trust-pickle)
            return torch.load(path, map_location="cpu", pickle_module=PICKLE_MODULE, weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except Refused as e:
        raise CheckpointError(f"{path}: {e}; the file was not loaded and nothing in it was run") from None
    except UnpicklingError as e:  # (not a pickle: garbage, or a file of another kind)
        raise CheckpointError(f"{path}: not a pickle or a PyTorch checkpoint ({e}); nothing in it was run") from None
    except (EOFError, RuntimeError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {e})") from None


def module_state_dict(root: Stub) -> dict[str, torch.Tensor]:
    """The state dict of a pickled module tree (parameters and persistent buffers, in the module's order)."""
    out: dict[str, torch.Tensor] = {}

    def walk(node: Stub, prefix: str) -> None:
        transient = node.get("_non_persistent_buffers_set") or set()
        for name, p in (node.get("_parameters") or {}).items():
            if isinstance(p, torch.Tensor):
                out[prefix + name] = p
        for name, b in (node.get("_buffers") or {}).items():
            if isinstance(b, torch.Tensor) and name not in transient:
                out[prefix + name] = b
        for name, m in (node.get("_modules") or {}).items():
            if isinstance(m, Stub):
                walk(m, f"{prefix}{name}.")

    walk(root, "")
    return out


def _unwrap(root: Stub) -> Stub:
    """A model saved inside DataParallel (or the original's BalancedDataParallel): the module it wraps."""
    while set(root.get("_modules") or {}) == {"module"}:
        root = root.child("module")
    return root


def _ties(state: dict[str, torch.Tensor], div_val: int, n_out: int, n_proj: int) -> tuple[bool, list[bool]]:
    """tie_weight and tie_projs from the state dict: tied tensors are one object in the pickle (or equal copies)."""

    def same(a: str, b: str) -> bool:
        x, y = state.get(a), state.get(b)
        return x is not None and y is not None and (x is y or (x.shape == y.shape and torch.equal(x, y)))

    tie_weight = n_out > 0 and all(
        same(f"crit.out_layers.{i}.weight", f"word_emb.emb_layers.{i}.weight") for i in range(n_out)
    )
    tie_projs = [same(f"crit.out_projs.{i}", f"word_emb.emb_projs.{0 if div_val == 1 else i}") for i in range(n_proj)]
    return tie_weight, tie_projs


def _config(fields: dict[str, Any], state: dict[str, torch.Tensor], source: str) -> TransformerXLConfig:
    """The txl configuration: the constructor's arguments where the file has them, shapes for the rest."""
    if fields.get("attn_type", 0) != 0:
        raise CheckpointError(
            f"{source}: attn_type {fields['attn_type']} (only the paper's attention, attn_type 0, is imported)"
        )
    if "r_w_bias" not in state or "layers.0.dec_attn.qkv_net.weight" not in state:
        raise CheckpointError(f"{source}: no r_w_bias or layers.0.dec_attn.qkv_net.weight (not a Transformer-XL)")
    n_head, d_head = state["r_w_bias"].shape
    n_layer = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers."))
    n_token = int(fields["n_token"])
    cutoffs = [int(c) for c in fields.get("cutoffs") or []]
    cutoffs = cutoffs[:-1] if cutoffs and cutoffs[-1] == n_token else cutoffs  # (the modules append n_token)
    div_val = int(fields.get("div_val", 1))
    n_out = sum(1 for k in state if k.startswith("crit.out_layers.") and k.endswith(".weight"))
    n_proj = len(cutoffs) + 1
    tie_weight, tie_projs = _ties(state, div_val, n_out, n_proj)
    d_model = int(state["layers.0.dec_attn.qkv_net.weight"].shape[1])
    try:
        return TransformerXLConfig(
            n_token=n_token, n_layer=n_layer, d_model=d_model, n_head=int(n_head), d_head=int(d_head),
            d_inner=int(state["layers.0.pos_ff.CoreNet.0.weight"].shape[0]),
            d_embed=int(fields.get("d_embed") or d_model), div_val=div_val, cutoffs=cutoffs, tie_weight=tie_weight,
            tie_projs=tie_projs, dropout=float(fields.get("dropout", 0.0)), dropatt=float(fields.get("dropatt", 0.0)),
            pre_lnorm=bool(fields.get("pre_lnorm", False)), untie_r=False,
            same_length=bool(fields.get("same_length", False)), clamp_len=int(fields.get("clamp_len", -1)),
            mem_len=int(fields.get("mem_len") or 0),
        )  # fmt: skip
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def _module_fields(root: Stub) -> dict[str, Any]:
    """The original ``MemTransformerLM``'s constructor arguments, from the attributes it keeps."""
    fields = {k: root.get(k) for k in ("n_token", "d_embed", "mem_len", "same_length", "clamp_len", "attn_type")}
    emb = root.child("word_emb")
    if emb is not None:
        fields |= {"cutoffs": emb.get("cutoffs") or [], "div_val": emb.get("div_val", 1)}
    drop = root.child("drop")
    fields["dropout"] = drop.get("p", 0.0) if drop is not None else 0.0
    layers = root.child("layers")
    first = (layers.get("_modules") or {}).get("0") if layers is not None else None
    attn = first.child("dec_attn") if isinstance(first, Stub) else None
    if attn is not None:
        dropatt = attn.child("dropatt")
        fields |= {"pre_lnorm": attn.get("pre_lnorm", False), "dropatt": dropatt.get("p", 0.0) if dropatt else 0.0}
    return {k: v for k, v in fields.items() if v is not None}


def vocab_tokenizer(vocab: Any, dataset: str | None, source: str) -> Tokenizer:
    """A txl tokenizer with the original ``Vocab``'s ids, read the way the original read the dataset's files."""
    symbols = vocab.get("idx2sym") if isinstance(vocab, Stub) else None
    if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
        raise CheckpointError(f"{source}: no vocabulary (a Vocab with an idx2sym list of strings)")
    try:
        if dataset == "enwik8":  # bytes written as decimal numbers; newline bytes were line breaks, not tokens
            if not all(s.isdigit() and int(s) < 256 for s in symbols):
                raise CheckpointError(f"{source}: an enwik8 vocabulary of symbols that are not byte values")
            chars = [BYTE_CHARS[int(s)] for s in symbols]
            return Tokenizer("byte", chars, drop_newlines=BYTE_CHARS[10] not in chars)
        if dataset == "text8":  # prep_text8.py wrote each space as '_'
            return Tokenizer("char", [" " if s == "_" else s for s in symbols])
        present = set(symbols)
        lm1b = dataset == "lm1b"
        specials = tuple(t for t in ("<unk>", "<eos>") if t in present)  # (kept whole in raw text, as HF's)
        unk = next((u for u in (("<UNK>",) if lm1b else ("<unk>", "<UNK>")) if u in present), None)
        return Tokenizer(
            "word",
            list(symbols),
            unk_token=unk,
            line_end="double" if lm1b else ("eos" if "<eos>" in present else "none"),
            lower_case=bool(vocab.get("lower_case", False)),
            raw_text=None if lm1b else Moses(never_split=specials, specials=specials),
        )
    except DataError as e:
        raise CheckpointError(f"{source}: {e}") from None


def corpus_vocabulary(path: Path, code: str) -> tuple[Any, str | None]:
    """The ``Vocab`` and the dataset name of a pickled corpus cache (``code``: whose, for the error); a folder: its
    cache.pt (the PyTorch code's) or cache.pkl (the TF code's)."""
    path = Path(path)
    if path.is_dir():
        folder, path = path, _file_in(path, ("cache.pt", "cache.pkl"))
        if path is None:
            raise CheckpointError(f"{folder}: a folder without cache.pt or cache.pkl (the corpus cache); give the file")
    cache = read_trusted_pickle(path)
    vocab = cache.get("vocab") if isinstance(cache, Stub) else None
    if vocab is None:
        raise CheckpointError(f"{path}: not {code}'s corpus cache (a Corpus with a vocab)")
    return vocab, cache.get("dataset")


def build_converted(
    config: TransformerXLConfig,
    named: dict[str, torch.Tensor],
    source: str,
    tokenizer: Tokenizer | None,
    vocab_source: str,
    out: str | Path | None,
) -> TransformerXLLM:
    """The txl model of ``named`` (the original PyTorch names, as ``txl convert hf`` maps them), checked against the
    tokenizer's vocabulary; saved with it to ``out`` if given."""
    if tokenizer is not None and tokenizer.vocab_size != config.n_token:
        raise CheckpointError(
            f"{vocab_source}: the vocabulary has {tokenizer.vocab_size:,} symbols but the model {config.n_token:,}"
        )
    tensors = hf_state_dict_to_txl(named, config, "transformer.", source)
    tensors = {k: v.float().contiguous() for k, v in tensors.items()}
    return load_converted(TransformerXLLM(config, init=False), tensors, source, tokenizer, out)


def _namespace(obj: Any) -> dict[str, Any]:
    return obj.state if isinstance(obj, Stub) else obj if isinstance(obj, dict) else {}


def _file_in(folder: Path, names: tuple[str, ...]) -> Path | None:
    """The first of ``names`` that is a file in ``folder``."""
    return next((folder / name for name in names if (folder / name).is_file()), None)


CHECKPOINT_FILES = ("model.pt", "checkpoint_best.pt", "checkpoint_last.pt")  # the original's, then NVIDIA's


def original_checkpoint_file(src: str | Path) -> Path:
    """``src``, or the checkpoint in the folder ``src`` (the original's work dir: model.pt; NVIDIA's:
    checkpoint_best.pt, else checkpoint_last.pt); checked before anything is read."""
    src = Path(src)
    if src.is_dir():
        if (found := _file_in(src, CHECKPOINT_FILES)) is not None:
            return found
        txl_model = (src / "config.json").is_file() and (src / "model.safetensors").is_file()
        raise CheckpointError(
            f"{src}: a txl model folder already (txl reads it as it is: nothing to convert)"
            if txl_model
            else f"{src}: a folder without {', '.join(CHECKPOINT_FILES)}; give the checkpoint file"
        )
    if not src.exists():
        raise CheckpointError(f"{src}: not found")
    return src


def convert_original_checkpoint(
    src: str | Path, out: str | Path | None = None, corpus: str | Path | None = None, trust_pickle: bool = False
) -> tuple[TransformerXLLM, Tokenizer | None]:
    """Convert the original code's ``model.pt`` or NVIDIA's ``checkpoint_*.pt`` to a txl model (and tokenizer).

    ``corpus``: the original's corpus cache (``cache.pt``) for the vocabulary (NVIDIA's checkpoint holds its own).
    Everything is read and checked before anything is written to ``out``.
    """
    src = original_checkpoint_file(src)
    if not trust_pickle:
        raise CheckpointError(
            f"{src} is a pickle (the original code saves whole objects); pickles can run code when loaded. If you "
            "trust its origin pass --trust-pickle: it is then read with a restricted unpickler that runs nothing"
        )
    obj = read_trusted_pickle(src)
    try:
        return _convert(obj, src, out, corpus)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, RuntimeError) as e:  # (a malformed dict)
        raise CheckpointError(f"{src}: not a checkpoint of the layout expected ({type(e).__name__}: {e})") from None


def _convert(
    obj: Any, src: Path, out: str | Path | None, corpus: str | Path | None
) -> tuple[TransformerXLLM, Tokenizer | None]:
    vocab, dataset = None, None
    if isinstance(obj, dict) and "model_state" in obj:  # NVIDIA: the state dict and the constructor's arguments
        state = {k.removeprefix("module."): v for k, v in obj["model_state"].items()}
        fields = dict(obj.get("model_config") or {})
        if "n_token" not in fields:
            raise CheckpointError(f"{src}: a checkpoint dict without model_config.n_token")
        vocab, dataset = obj.get("vocab"), _namespace(obj.get("args")).get("dataset")
    elif isinstance(obj, Stub) and "_modules" in obj.state:  # the original: the pickled MemTransformerLM
        root = _unwrap(obj)
        state, fields = module_state_dict(root), _module_fields(root)
        if "n_token" not in fields:
            raise CheckpointError(f"{src}: a pickled {root.origin} without n_token (not a MemTransformerLM)")
    else:
        what = obj.origin if isinstance(obj, Stub) else type(obj).__name__
        raise CheckpointError(f"{src}: holds a {what}, not a pickled MemTransformerLM or a checkpoint dict")
    if corpus is not None:
        vocab, dataset = corpus_vocabulary(Path(corpus), "the original code")
    config = _config(fields, state, str(src))
    vocab_source = str(corpus or src)
    tokenizer = vocab_tokenizer(vocab, dataset, vocab_source) if vocab is not None else None
    # The original (and NVIDIA's) head reads tail cluster i's logit at column -i; txl (as HF and TF) at shortlist + i-1.
    state = {k: v.flip(0) if k in ("crit.cluster_weight", "crit.cluster_bias") else v for k, v in state.items()}
    named = {(k if k.startswith("crit.") else f"transformer.{k}"): v.detach() for k, v in state.items()}
    return build_converted(config, named, str(src), tokenizer, vocab_source, out), tokenizer
