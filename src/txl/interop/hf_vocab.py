"""Import the vocabulary of a Hugging Face ``TransfoXLTokenizer`` as a txl ``tokenizer.json``, running no code.
Design notes: docs/internals.md#txlinterophf_vocab."""

from __future__ import annotations

import codecs
import io
import json
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections import Counter, OrderedDict
from pathlib import Path
from pickle import Unpickler, UnpicklingError
from typing import Any

from txl.data import Tokenizer
from txl.data.errors import DataError
from txl.data.rawtext import Moses
from txl.model.pretrained import CheckpointError

PICKLE_VOCAB, TEXT_VOCAB = "vocab.pkl", "vocab.txt"


class Inert:
    """Stands in for an object of a class txl does not import: keeps constructor arguments and state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _reconstructor(cls: type, base: type, state: Any = None) -> Any:
    """``copyreg._reconstructor`` (protocol 0/1 objects), for the classes this unpickler admits only."""
    if not (isinstance(cls, type) and issubclass(cls, Inert | dict | list | set)):
        raise Refused(f"copyreg._reconstructor of {cls!r} is not admitted")
    return cls()


SAFE: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "Counter"): Counter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "object"): object,
    ("_codecs", "encode"): codecs.encode,  # how protocols 0-2 write bytes
    ("copyreg", "_reconstructor"): _reconstructor,
}
# What HF's TransfoXLTokenizer.__dict__ holds besides plain data (transformers 4.x, sacremoses, tokenizers).
INERT = {
    ("re", "_compile"),
    ("sacremoses.normalize", "MosesPunctNormalizer"),
    ("sacremoses.tokenize", "MosesTokenizer"),
    ("sacremoses.tokenize", "MosesDetokenizer"),
    ("transformers.tokenization_utils", "Trie"),
    ("tokenizers", "AddedToken"),
    ("transformers.tokenization_utils_base", "AddedToken"),
}


class Refused(UnpicklingError):
    """The pickle names a global that :class:`RestrictedUnpickler` does not admit."""


class RestrictedUnpickler(Unpickler):
    """Reads plain data and :data:`INERT` stand-ins; refuses every other global (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (protocols 0-2 write them), as pickle's own find_class maps them; none exists in Python 3
        module, name = NAME_MAPPING.get((module, name), (IMPORT_MAPPING.get(module, module), name))
        if (module, name) in SAFE:
            return SAFE[(module, name)]
        if (module, name) in INERT:
            return type(name, (Inert,), {"__module__": __name__, "__qualname__": f"Inert[{module}.{name}]"})
        raise Refused(f"refused to load {module}.{name} (only plain data and known HF tokenizer state)")


def read_restricted_pickle(path: Path) -> Any:
    try:
        return RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()
    except Refused as e:
        raise CheckpointError(f"{path}: {e}; the file was not loaded and nothing in it was run") from None
    except (UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(f"{path}: not a readable vocabulary pickle ({type(e).__name__}: {e})") from None


def _special_tokens(src: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # the second wins, as in HF
        p = src / name
        if p.is_file():
            try:
                data = json.loads(p.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{p}: not valid JSON ({e})") from None
            out.update({k: v for k, v in data.items() if isinstance(v, str | bool) or v is None})
    return out


def _symbols_from_pickle(path: Path) -> tuple[list[str], dict[str, Any]]:
    state = read_restricted_pickle(path)
    if not isinstance(state, dict) or not isinstance(state.get("idx2sym"), list):
        raise CheckpointError(f"{path}: no idx2sym list (not a TransfoXLTokenizer vocabulary)")
    symbols = state["idx2sym"]
    if not all(isinstance(s, str) for s in symbols):
        raise CheckpointError(f"{path}: idx2sym holds non-string symbols")
    sym2idx = state.get("sym2idx")
    if isinstance(sym2idx, dict) and any(sym2idx.get(s) != i for i, s in enumerate(symbols)):
        raise CheckpointError(f"{path}: idx2sym and sym2idx disagree; the vocabulary is inconsistent")
    return symbols, state


def _symbols_from_text(path: Path) -> list[str]:
    symbols = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                raise CheckpointError(f"{path}:{n}: empty line in the vocabulary file")
            symbols.append(parts[0])
    return symbols


def convert_hf_tokenizer(
    src: str | Path, trust_pickle: bool = False, files: tuple[Path | None, Path | None] | None = None
) -> Tokenizer | None:
    """The txl tokenizer of an HF TransfoXL folder (``vocab.txt``, or ``vocab.pkl`` with ``trust_pickle``; ``files``:
    (text, pickle) vocabulary files of other names or places, either None).

    Returns None when the folder has no vocabulary file. A ``vocab.pkl`` without ``trust_pickle`` is an error
    that says how to proceed.
    """
    src = Path(src)
    text, pkl = files if files is not None else (src / TEXT_VOCAB, src / PICKLE_VOCAB)
    text, pkl = text or src / TEXT_VOCAB, pkl or src / PICKLE_VOCAB
    state: dict[str, Any] = {}
    if text.is_file():
        symbols = _symbols_from_text(text)
        if not symbols:  # (probes tk8: an empty vocab.txt loaded, then every text was "not in the vocabulary")
            raise CheckpointError(f"{text}: an empty vocabulary (HF's vocab.txt holds one symbol per line)")
    elif pkl.is_file():
        if not trust_pickle:
            raise CheckpointError(
                f"{pkl} is a pickle (HF's TransfoXL vocabulary); pickles can run code when loaded. If you trust its "
                "origin pass --trust-pickle: it is then read with a restricted unpickler that runs nothing"
            )
        symbols, state = _symbols_from_pickle(pkl)
    else:
        return None
    specials = _special_tokens(src)
    unk = specials.get("unk_token", state.get("unk_token", "<unk>"))
    eos = specials.get("eos_token", state.get("eos_token", "<eos>"))
    lower = specials.get("lower_case", state.get("lower_case", False))
    if isinstance(unk, Inert) or not isinstance(unk, str):  # an AddedToken stand-in: its content is args[0]
        unk = unk.args[0] if isinstance(unk, Inert) and unk.args else "<unk>"
    present = set(symbols)
    never_split = state.get("never_split")
    extra = state.get("additional_special_tokens") or ["<formula>"]  # (HF's default)
    all_specials = [t for t in (unk, eos, *extra) if isinstance(t, str)]
    if not (isinstance(never_split, list | tuple) and all(isinstance(t, str) for t in never_split)):
        never_split = all_specials  # HF's default: its special tokens
    moses = None
    if state.get("delimiter") != "":  # HF reads raw text with Moses unless the delimiter is '' (characters)
        moses = Moses(
            lang=str(state.get("language") or "en"),
            never_split=tuple(never_split),
            # split out before Moses, as HF's added tokens; one missing from the vocabulary (HF's <formula>) is not
            # given an id of its own here (HF's can collide with a real symbol's after a reload)
            specials=tuple(t for t in dict.fromkeys(all_specials) if t in present),
        )
    try:
        return Tokenizer(
            "word",
            list(symbols),
            unk_token=unk if unk in present else None,
            line_end="eos" if eos in present else "none",
            lower_case=bool(lower),
            raw_text=moses,
        )
    except DataError as e:
        raise CheckpointError(f"{src}: {e}") from None
