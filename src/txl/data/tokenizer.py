"""Word, character and byte tokenizers with the original code's vocabulary rule, saved as ``tokenizer.json``.
Design notes: docs/internals.md#txldatatokenizer."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Literal

import numpy as np

from txl.data.decoding import BYTE_CHARS, BYTE_OF_CHAR, DOUBLE_EOS, EOS, StreamDecoder  # noqa: F401 (re-exported)
from txl.data.errors import DataError
from txl.data.music import MusicTokenizer, is_miditok_json
from txl.data.rawtext import Moses, RawText, Text8, raw_text_from_json, raw_text_to_json
from txl.data.text import BLOCK_BYTES, FileRange, iter_bytes, iter_text, line_of_offset, smallest_uint
from txl.util.fileio import write_bytes
from txl.util.folders import read_json, resolve_model_dir

Kind = Literal["word", "char", "byte"]
LineEnd = Literal["none", "eos", "double"]
UnknownPolicy = Literal["error", "replace"]
# str.split() splits on these four (FS, GS, RS, US); Rust's char::is_whitespace (tokenizers) does not.
PY_ONLY_WHITESPACE = "\x1c\x1d\x1e\x1f"
_ANY_CHAR = r"[\s\S]"


def _not_in_vocab(symbol: str) -> None:
    raise DataError(f"{symbol!r} is not in the vocabulary (and there is no unknown token)")


def _describe(kind: str, unit: int) -> str:
    return f"byte 0x{unit:02x}" if kind == "byte" else f"character {chr(unit)!r} (U+{unit:04X})"


class Encoding(dict):
    """What calling a :class:`Tokenizer` gives: ``input_ids`` and ``attention_mask``, as keys or attributes."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Tokenizer:
    """A vocabulary (``symbols[id]``) plus the rule that turns text into symbols."""

    kind: Kind
    symbols: list[str]
    unk_token: str | None = None
    line_end: LineEnd = "none"
    lower_case: bool = False
    drop_newlines: bool = False
    raw_text: RawText | None = None
    """How new raw text (prompts, documents) is brought into the vocabulary's form (see ``txl.data.rawtext``)."""
    raw_files: bool = False
    """Data files are raw text too (a model trained on a raw-text folder): they go through ``raw_text`` as well."""
    unknown: UnknownPolicy = "error"
    """Characters/bytes outside a vocabulary without an unknown token: an error, or ``replacement`` instead."""
    replacement: str | None = None
    """The symbol for ``unknown="replace"`` (default: a space, else ``?``)."""
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index = {}
        for i, s in enumerate(self.symbols):
            if s in self._index:
                raise DataError(f"duplicate symbol {s!r} in the vocabulary (ids {self._index[s]} and {i})")
            self._index[s] = i
        if self.unk_token is not None and self.unk_token not in self._index:
            raise DataError(f"unk_token {self.unk_token!r} is not in the vocabulary")
        if self.kind != "word" and self.line_end != "none":
            raise DataError(f"line_end={self.line_end!r} needs a word tokenizer, not {self.kind!r}")
        if self.drop_newlines and self.kind != "byte":
            raise DataError("drop_newlines is the enwik8 paper mode of the byte tokenizer")
        if self.kind == "byte" and not set(self.symbols) <= set(BYTE_CHARS):
            raise DataError("a byte tokenizer's symbols must be byte characters")
        if isinstance(self.raw_text, Moses) and self.kind != "word":
            raise DataError(f"the moses pre-tokenizer needs a word tokenizer, not {self.kind!r}")
        if isinstance(self.raw_text, Text8) and self.kind != "char":
            raise DataError(f"the text8 normaliser needs a char tokenizer, not {self.kind!r}")
        if self.raw_files and self.raw_text is None:
            raise DataError("raw_files needs a raw_text pipeline to read the files with")
        if self.unknown not in ("error", "replace"):
            raise DataError(f"unknown = {self.unknown!r}: must be 'error' or 'replace'")
        if self.replacement is not None and self.replacement not in self._index:
            raise DataError(f"replacement {self.replacement!r} is not in the vocabulary")

    # ----------------------------------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def eos_token(self) -> str | None:
        return {"eos": EOS, "double": DOUBLE_EOS}.get(self.line_end)

    @property
    def dtype(self) -> np.dtype:
        return smallest_uint(self.vocab_size)

    def token_to_id(self, symbol: str) -> int | None:
        return self._index.get(symbol)

    @property
    def unk_id(self) -> int | None:
        return None if self.unk_token is None else self._index[self.unk_token]

    def _replacement_id(self) -> int | None:
        """The id unknown characters/bytes become: ``<unk>``, else the replacement under ``unknown="replace"``."""
        if self.unk_id is not None:
            return self.unk_id
        if self.unknown != "replace":
            return None
        if self.replacement is not None:
            return self._index[self.replacement]
        for sym in (" ", "?") if self.kind == "char" else (BYTE_CHARS[32], BYTE_CHARS[63]):
            if sym in self._index:
                return self._index[sym]
        raise DataError("unknown='replace' needs a replacement symbol: the vocabulary has neither ' ' nor '?'")

    @cached_property
    def _lut(self) -> np.ndarray:
        """Code point (char) or byte value (byte) -> id, -1 where absent."""
        if self.kind == "byte":
            lut = np.full(256, -1, dtype=np.int64)
            for b, ch in enumerate(BYTE_CHARS):
                lut[b] = self._index.get(ch, -1)
        else:
            lut = np.full(0x110000, -1, dtype=np.int64)
            for s, i in self._index.items():
                if len(s) == 1:
                    lut[ord(s)] = i
        return lut

    @classmethod
    def bytes256(cls) -> Tokenizer:
        """All 256 byte values, id = byte value (the faithful byte-level tokenizer)."""
        return cls("byte", list(BYTE_CHARS))

    @classmethod
    def from_vocab_file(cls, path: Path, *, unk_token: str = "<UNK>", line_end: LineEnd = "double") -> Tokenizer:
        """One Billion Word's ``1b_word_vocab.txt``: the first column of each line, in file order."""
        symbols, seen = [], set()
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                parts = line.strip().split()
                if not parts:
                    raise DataError(f"{path}:{n}: empty line in the vocabulary file")
                if parts[0] not in seen:
                    seen.add(parts[0])
                    symbols.append(parts[0])
        if unk_token not in seen:
            raise DataError(f"{path}: the vocabulary file has no {unk_token!r} line")
        return cls("word", symbols, unk_token=unk_token, line_end=line_end)

    @classmethod
    def build(
        cls, kind: Kind, sources: Sequence[FileRange], *, specials: Sequence[str] | None = None, min_freq: int = 1,
        max_size: int | None = None, line_end: LineEnd = "none", lower_case: bool = False, drop_newlines: bool = False,
        unk_token: str | None = "<unk>", errors: str = "strict", raw_text: RawText | None = None,
    ) -> Tokenizer:  # fmt: skip
        """Count ``sources`` and order the vocabulary like the reference (see the module docstring).

        ``specials`` default to ``[<eos>]`` or ``[<S>]`` for word tokenizers with line ends. ``unk_token`` is used
        for unknown symbols when it ends up in the vocabulary (from the text, or listed in ``specials``).
        ``raw_text``: the sources are raw text, read through this pipeline (kept for new text).
        """
        if kind == "byte" and not drop_newlines and specials is None and max_size is None and min_freq <= 1:
            return cls.bytes256()
        raw = {"raw_text": raw_text, "raw_files": raw_text is not None}
        proto = cls(kind, [], line_end=line_end, lower_case=lower_case, drop_newlines=drop_newlines, **raw)
        counts = proto.count(sources, errors=errors)
        if specials is None:
            specials = [proto.eos_token] if proto.eos_token else []
        symbols = list(dict.fromkeys(specials))
        present = set(symbols)
        for sym, cnt in counts.most_common(max_size):
            if cnt < min_freq:
                break
            if sym not in present:
                present.add(sym)
                symbols.append(sym)
        if len(symbols) == len(dict.fromkeys(specials)):
            where = ", ".join(fr.describe() for fr in sources[:3]) + (", ..." if len(sources) > 3 else "")
            real = [sym for sym in counts if sym not in present]
            why = "min_freq/max_size left no symbol" if real else "the text is empty or only whitespace"
            raise DataError(
                f"{where}: no token to build a vocabulary from ({why}); a model over only the special symbols "
                f"{list(dict.fromkeys(specials))} would learn nothing. Check the data path and files."
            )
        unk = unk_token if unk_token in present else None
        return cls(kind, symbols, unk, line_end, lower_case, drop_newlines, **raw)

    def count(self, sources: Iterable[FileRange], errors: str = "strict") -> Counter:
        """Symbol counts in first-seen order (a ``Counter``'s insertion order), like ``Vocab.count_file``."""
        counter: Counter = Counter()
        if self.kind == "word":
            for fr in sources:
                for tokens, _ in self._word_blocks(fr, errors):
                    counter.update(tokens)
            return counter
        size = 256 if self.kind == "byte" else 0x110000
        totals = np.zeros(size, dtype=np.int64)
        first = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
        seen = 0
        for fr in sources:
            for units in self._units(fr, errors):
                new = totals[units] == 0
                if new.any():
                    vals, idx = np.unique(units[new], return_index=True)
                    first[vals] = seen + np.flatnonzero(new)[idx]
                totals += np.bincount(units, minlength=size)
                seen += len(units)
        used = np.flatnonzero(totals)
        for u in used[np.argsort(first[used], kind="stable")]:
            counter[BYTE_CHARS[u] if self.kind == "byte" else chr(u)] = int(totals[u])
        return counter

    # ------------------------------------------------------------------------------------------ encoding
    def _word_blocks(self, fr: FileRange, errors: str) -> Iterator[tuple[list[str], list[int] | None]]:
        """Symbols of a file range in blocks of whole lines (very long lines are cut at whitespace).

        Yields ``(symbols, sentence_lengths)``; the lengths are given only for ``line_end="double"``.
        The last line gets its line end even without a final newline, as the reference's line loop gives it.
        """
        carry = ""
        for text in iter_text(fr, errors):
            text = carry + text
            k = text.rfind("\n")
            if k < 0:
                carry = text
                if len(carry) > BLOCK_BYTES and self.line_end != "double":
                    j = len(carry) - 1
                    while j >= 0 and not carry[j].isspace():
                        j -= 1
                    if j > 0:
                        yield self._split(carry[: j + 1], complete=False)
                        carry = carry[j + 1 :]
                continue
            carry = text[k + 1 :]
            yield self._split(text[: k + 1], complete=True)
        if carry:
            yield self._split(carry + "\n", complete=True)

    def _split(self, text: str, complete: bool) -> tuple[list[str], list[int] | None]:
        if self.raw_files and isinstance(self.raw_text, Moses):  # raw text files: Moses, line by line
            lines = text.split("\n")
            last = lines.pop()  # '' after a complete block's final newline
            words_of = [self.raw_text.tokenize(line, self.lower_case) for line in lines]
            if self.line_end == "double":
                return [t for w in words_of for t in (DOUBLE_EOS, *w, DOUBLE_EOS)], [len(w) + 2 for w in words_of]
            eos = [EOS] if self.line_end == "eos" else []
            tail = self.raw_text.tokenize(last, self.lower_case) if last else []
            return [t for w in words_of for t in (*w, *eos)] + tail, None
        if self.lower_case:
            text = text.lower()
        if self.line_end == "double":
            tokens: list[str] = []
            lengths = []
            for line in text.split("\n")[:-1]:
                words = line.split()
                tokens += [DOUBLE_EOS, *words, DOUBLE_EOS]
                lengths.append(len(words) + 2)
            return tokens, lengths
        if self.line_end == "eos" and complete:
            return text.replace("\n", f" {EOS} ").split(), None
        return text.split(), None

    def _units(self, fr: FileRange, errors: str) -> Iterator[np.ndarray]:
        """Code points (char) or byte values (byte) of a file range, in blocks."""
        if self.kind == "byte":
            for _, data in iter_bytes(fr):
                units = np.frombuffer(data, dtype=np.uint8)
                yield units[units != 10] if self.drop_newlines else units
        else:
            text8 = self.raw_text if self.raw_files and isinstance(self.raw_text, Text8) else None
            after_space = False
            for text in iter_text(fr, errors):
                if text8 is not None:  # normalised per block; a run of spaces across two blocks stays one space
                    text = text8.normalize(text)
                    text = text[1:] if after_space and text.startswith(" ") else text
                    after_space = text.endswith(" ") if text else after_space
                if self.lower_case:
                    text = text.lower()
                yield np.frombuffer(text.encode("utf-32-le"), dtype="<u4")

    def encode_file(self, fr: FileRange, errors: str = "strict", raw: bool | None = None) -> Iterator[np.ndarray]:
        """Ids of a file range, in blocks (int64 arrays); bounded memory for any file or line length.

        ``raw`` (default: the tokenizer's ``raw_files``) reads the file as raw text through ``raw_text``, line by
        line; otherwise it is read as already tokenized (the paper's datasets: the exact whitespace path)."""
        tok = self if raw is None or self.raw_text is None or raw == self.raw_files else replace(self, raw_files=raw)
        for ids, _ in tok._encode_blocks(fr, errors):
            yield ids

    def encode_sentences(self, fr: FileRange, errors: str = "strict") -> Iterator[tuple[np.ndarray, list[int]]]:
        """``(ids, sentence lengths)`` blocks of a ``line_end="double"`` tokenizer (One Billion Word)."""
        if self.line_end != "double":
            raise DataError("encode_sentences needs a tokenizer with line_end='double'")
        yield from self._encode_blocks(fr, errors)

    def _encode_blocks(self, fr: FileRange, errors: str) -> Iterator[tuple[np.ndarray, list[int] | None]]:
        if self.kind == "word":
            get, default = self._index.get, self.unk_id if self.unk_id is not None else -1
            for tokens, lengths in self._word_blocks(fr, errors):
                ids = np.fromiter(map(get, tokens, repeat(default)), dtype=np.int64, count=len(tokens))
                if default < 0 and len(ids) and ids.min() < 0:
                    self._unknown(fr, tokens[int(np.argmax(ids < 0))], errors)
                yield ids, lengths
            return
        for units in self._units(fr, errors):
            yield self._lookup(units, lambda sym, fr=fr: self._unknown(fr, sym, errors)), None

    def _lookup(self, units: np.ndarray, unknown: Callable[[str], None]) -> np.ndarray:
        """Ids of code points / byte values; ``unknown(symbol)`` raises for the first one outside the vocabulary
        (unless there is an unknown token or the ``replace`` policy)."""
        ids = self._lut[units]
        if len(ids) and ids.min() < 0:
            instead = self._replacement_id()
            if instead is None:
                bad = int(units[int(np.argmax(ids < 0))])
                unknown(BYTE_CHARS[bad] if self.kind == "byte" else chr(bad))
            ids[ids < 0] = instead
        return ids

    def _unknown(self, fr: FileRange, symbol: str, errors: str) -> None:
        """Raise the out-of-vocabulary error, naming the symbol and the first line where it occurs."""
        if self.kind == "byte":
            byte = BYTE_CHARS.index(symbol)
            pos = next(p + data.index(bytes([byte])) for p, data in iter_bytes(fr) if bytes([byte]) in data)
            line, col = line_of_offset(fr.path, pos)
            what = f"byte 0x{byte:02x} (byte offset {pos}, column {col})"
        else:
            line = line_of_offset(fr.path, fr.start)[0]
            for text in iter_text(fr, errors):
                probe = text.lower() if self.lower_case else text
                hit = self._find(probe, symbol)
                if hit is not None:
                    line += probe.count("\n", 0, hit)
                    break
                line += text.count("\n")
            what = f"{'word' if self.kind == 'word' else 'character'} {symbol!r}"
        raise DataError(
            f"{fr.path}:{line}: {what} is not in the vocabulary and the tokenizer has no unknown token. "
            "Build the vocabulary from this text, or use a vocabulary that contains an unknown token (<unk>)."
        )

    def _find(self, text: str, symbol: str) -> int | None:
        if self.kind == "char":
            k = text.find(symbol)
            return None if k < 0 else k
        pos = 0
        for line in text.split("\n"):
            if symbol in line.split():
                return pos
            pos += len(line) + 1
        return None

    def document_start(self) -> tuple[str, list[int]]:
        """What a text is read after when it has no context of its own (lm-evaluation-harness's prefix, ``txl
        serve``'s end-of-text token): the line end (a text starts after one, as a line of a file does) if this
        tokenizer can encode it, else a space, else the id 0; as (text, ids)."""
        for text in ("\n", " "):
            try:
                ids = self.encode(text)
            except ValueError:
                continue
            if ids:
                return text, ids
        return self.symbol(0), [0]

    def encode(self, text: str, *, normalized: bool = False) -> list[int]:
        """Ids of raw text (a prompt, a document). It goes through the tokenizer's ``raw_text`` pipeline (Moses,
        text8) unless ``normalized``; in word mode each line ends with the line-end symbol, as in the files."""
        if self.kind == "byte":
            data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            units = data[data != 10] if self.drop_newlines else data  # paper mode: newlines dropped, as in training
        elif self.kind == "char":
            if self.raw_text is not None and not normalized:
                text = self.raw_text.normalize(text)
            units = np.frombuffer((text.lower() if self.lower_case else text).encode("utf-32-le"), dtype="<u4")
        else:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
            moses = self.raw_text if isinstance(self.raw_text, Moses) and not normalized else None
            if self.lower_case and moses is None:
                text = text.lower()
            lines = text.split("\n")
            tokens = []
            for i, line in enumerate(lines):
                words = moses.tokenize(line, self.lower_case) if moses else line.split()
                complete = i < len(lines) - 1
                if self.line_end == "double" and (words or complete):
                    words = [DOUBLE_EOS, *words] + ([DOUBLE_EOS] if complete else [])
                tokens += words
                if self.line_end == "eos" and complete:
                    tokens.append(EOS)
            ids = [self._index.get(t, -1 if self.unk_id is None else self.unk_id) for t in tokens]
            if -1 in ids:
                _not_in_vocab(tokens[ids.index(-1)])
            return ids
        return self._lookup(units, lambda sym: self._unknown_in_text(units, sym)).tolist()

    def __call__(
        self, text: str | Sequence[str], *, padding: bool = False, return_tensors: str | None = None, pad_id: int = 0
    ) -> Encoding:
        """Hugging Face's tokenizer call: ``input_ids`` and ``attention_mask`` of a text, or of a list of texts.

        ``return_tensors="pt"`` (torch) or ``"np"`` gives [B, T] arrays (one row for one text); texts of different
        lengths need ``padding=True``, which pads on the left (``pad_id``, mask 0), the side txl's relative positions,
        generation and classification read. ``model.generate(**tok(texts, padding=True, return_tensors="pt"))``."""
        single = isinstance(text, str)
        rows = [self.encode(t) for t in ([text] if single else text)]
        longest = max((len(r) for r in rows), default=0)
        if len({len(r) for r in rows}) > 1 and not padding:
            raise ValueError("the texts have different numbers of tokens: pass padding=True (left padding)")
        ids = [[pad_id] * (longest - len(r)) + r for r in rows]
        mask = [[0] * (longest - len(r)) + [1] * len(r) for r in rows]
        if return_tensors is None:
            return Encoding(input_ids=ids[0] if single else ids, attention_mask=mask[0] if single else mask)
        if return_tensors == "np":
            return Encoding(input_ids=np.array(ids, dtype=np.int64), attention_mask=np.array(mask, dtype=np.int64))
        if return_tensors == "pt":
            import torch

            return Encoding(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask))
        raise ValueError(f"return_tensors = {return_tensors!r}: expected 'pt', 'np' or None (lists)")

    def _unknown_in_text(self, units: np.ndarray, symbol: str) -> None:
        unit = BYTE_OF_CHAR[symbol] if self.kind == "byte" else ord(symbol)
        pos = int(np.argmax(units == unit))
        where = "byte offset" if self.kind == "byte" else "character"
        raise DataError(
            f"{_describe(self.kind, unit)} at {where} {pos} is not in the vocabulary and the tokenizer has no unknown "
            "token. Remove it, or read such text with unknown='replace' "
            f"(`txl tokenize --unknown replace`, Tokenizer.with_unknown('replace'))."
        )

    def with_unknown(self, policy: UnknownPolicy, replacement: str | None = None) -> Tokenizer:
        """A copy that treats characters/bytes outside the vocabulary by ``policy`` (error or replace)."""
        return replace(self, unknown=policy, replacement=replacement)

    def symbol(self, token_id: int) -> str:
        """The symbol of one id; ``ValueError`` for an id outside the vocabulary (a negative one too)."""
        i = int(token_id)
        n = len(self.symbols)
        if not 0 <= i < n:
            raise ValueError(f"token id {i} is outside this vocabulary of {n} symbols (ids 0..{n - 1})")
        return self.symbols[i]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids [T]: words joined by spaces with the line end as a newline; chars and bytes concatenated."""
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"decode takes one sequence of ids, got shape {tuple(ids.shape)}: batch_decode takes rows")
        syms = [self.symbol(i) for i in ids]
        if self.kind == "byte":
            return bytes(BYTE_OF_CHAR[s] for s in syms).decode("utf-8", errors="replace")
        if self.kind == "char":
            return "".join(syms)
        join = self.raw_text.detokenize if isinstance(self.raw_text, Moses) else " ".join
        if self.line_end != "eos":
            return join(syms)
        lines, line = [], []
        for s in syms:
            if s == EOS:
                lines.append(join(line))
                line = []
            else:
                line.append(s)
        return "\n".join([*lines, join(line)])

    def batch_decode(self, rows: Iterable[Iterable[int]]) -> list[str]:
        """The text of each row of ids (e.g. of ``model.generate``'s [B, T] output)."""
        return [self.decode(row) for row in rows]

    def stream_decoder(self) -> StreamDecoder:
        """An incremental decoder for text that appears token by token (``txl generate``)."""
        return StreamDecoder(self)

    # --------------------------------------------------------------------------------- tokenizer.json
    def to_hf(self):
        """The equivalent ``tokenizers.Tokenizer``: its ``encode(text)`` gives the ids :meth:`encode_file` gives for
        the text as a file (each line framed as in training: ``line <eos>``, or ``<S> line <S>``)."""
        from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import WordLevel

        tok = HFTokenizer(WordLevel(dict(self._index), unk_token=self.unk_token))
        norms = []
        if self.kind in ("word", "char"):
            norms += [normalizers.Replace("\r\n", "\n"), normalizers.Replace("\r", "\n")]
        if self.lower_case:
            norms.append(normalizers.Lowercase())
        if self.kind == "word":
            norms += [normalizers.Replace(ch, " ") for ch in PY_ONLY_WHITESPACE]
            if self.eos_token is not None:  # a text of several lines: each line as the template frames one
                between = f" {self.eos_token} " if self.line_end == "eos" else f" {self.eos_token} {self.eos_token} "
                norms += [normalizers.Replace(Regex(r"\n\z"), ""), normalizers.Replace("\n", between)]
        if self.drop_newlines:
            norms.append(normalizers.Replace("\n", ""))
        if norms:
            tok.normalizer = normalizers.Sequence(norms)
        each_char = pre_tokenizers.Split(Regex(_ANY_CHAR), "isolated")
        if self.kind == "word":
            tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        elif self.kind == "char":
            tok.pre_tokenizer = each_char
            tok.decoder = decoders.Fuse()
        else:
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tok.pre_tokenizer = pre_tokenizers.Sequence([byte_level, each_char])
            tok.decoder = decoders.ByteLevel()
        if self.eos_token is not None:
            eos = (self.eos_token, self._index[self.eos_token])
            single = "$A <eos>" if self.line_end == "eos" else "<S> $A <S>"
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[eos])
        return tok

    def to_json(self) -> str:
        """``tokenizers``' JSON, plus txl's raw-text settings under ``model.txl`` (which ``tokenizers`` ignores: it
        loads the file and reads already-tokenized text the same way; Moses and text8 are txl's)."""
        text = self.to_hf().to_str(pretty=True)
        extra = self._txl_json()
        if not extra:
            return text
        obj = json.loads(text)
        obj["model"]["txl"] = extra
        return json.dumps(obj, indent=2, ensure_ascii=False)

    def _txl_json(self) -> dict:
        out: dict = {}
        if self.raw_text is not None:
            out["raw_text"] = raw_text_to_json(self.raw_text)
        if self.raw_files:
            out["raw_files"] = True
        if self.unknown != "error":
            out["unknown"] = self.unknown
        if self.replacement is not None:
            out["replacement"] = self.replacement
        return out

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save(self, path: Path) -> Path:
        """Write ``tokenizer.json`` atomically (``path`` may be a folder)."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(path, self.to_json().encode())
        return path

    def for_model(self, n_token: int, where: str | Path) -> Tokenizer:
        """This tokenizer, checked to be the one of a model of ``n_token`` token ids (``where``: the tokenizer's
        file, for the message): a tokenizer of another size reads text as other ids, and its ids beyond the model's
        are errors part-way."""
        if self.vocab_size != n_token:
            raise DataError(
                f"{where}: a tokenizer of {self.vocab_size:,} symbols beside a model of {n_token:,} token ids: it is "
                "not this model's tokenizer (was the folder written over?); put the model's own tokenizer.json there"
            )
        return self

    @classmethod
    def load(cls, path: Path) -> Tokenizer | MusicTokenizer:
        """Read a ``tokenizer.json`` written by :meth:`save` (``path`` may be a folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            obj = read_json(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such tokenizer file") from None
        if is_miditok_json(obj):  # a music model's: MidiTok's REMI tokenizer (txl.data.music)
            return MusicTokenizer.load(path)
        return cls.from_json_obj(obj, str(path))

    @classmethod
    def from_json_obj(cls, obj: dict, source: str = "tokenizer.json") -> Tokenizer:
        try:
            model = obj["model"]
            if model.get("type") != "WordLevel":
                raise KeyError("model.type")
            vocab = model["vocab"]
            symbols = [s for s, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
            if [vocab[s] for s in symbols] != list(range(len(symbols))):
                raise KeyError("model.vocab ids")
            pre = obj.get("pre_tokenizer") or {}
            kind = {"WhitespaceSplit": "word", "Split": "char", "Sequence": "byte"}[pre.get("type")]
            norms = (obj.get("normalizer") or {}).get("normalizers", [obj.get("normalizer")])
            types = [(n or {}).get("type") for n in norms]
            drop_nl = any(  # (the byte-paper mode's; not the final line end a word tokenizer drops)
                n and n.get("type") == "Replace" and n.get("content") == "" and n.get("pattern") == {"String": "\n"}
                for n in norms
            )
            line_end = "none"
            post = obj.get("post_processor")
            if post:
                ids = [p["SpecialToken"]["id"] for p in post["single"] if "SpecialToken" in p]
                line_end = "double" if ids == [DOUBLE_EOS, DOUBLE_EOS] else "eos"
            unk = model.get("unk_token")
            extra = model.get("txl") or {}
            raw = raw_text_from_json(extra.get("raw_text"), source)
        except (KeyError, TypeError, AttributeError) as e:  # (probes tk4: `{}` named only its missing key)
            what = f"no {e.args[0]}" if isinstance(e, KeyError) and e.args else str(e)
            raise DataError(
                f"{source}: not a txl tokenizer file ({what}): txl reads the tokenizer.json (or vocab.json) that its "
                "tokenizers save, a word, char or byte vocabulary"
            ) from None
        return cls(
            kind,
            symbols,
            unk if unk in vocab else None,
            line_end,
            "Lowercase" in types,
            drop_nl,
            raw_text=raw,
            raw_files=bool(extra.get("raw_files", False)),
            unknown=extra.get("unknown", "error"),
            replacement=extra.get("replacement"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a model folder, run folder or checkpoint (its ``tokenizer.json``)."""
        path = Path(path)
        if path.is_file() or (path / "tokenizer.json").is_file():
            return cls.load(path)
        return cls.load(resolve_model_dir(path))  # a run folder: its latest checkpoint's
