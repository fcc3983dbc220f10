"""How new raw text becomes the symbols a model was trained on: the part of ``tokenizer.json`` that reads text.
Design notes: docs/internals.md#txldatarawtext."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, ClassVar

from txl.data.errors import DataError

# HF's tokenize_numbers / detokenize_numbers (transformers' TransfoXL tokenizer)
_NUMBER_SPLIT = re.compile(r"(?<=\d)[,.](?=\d)")
_NUMBER_JOINS = ((" @,@ ", ","), (" @.@ ", "."))
# tokens after which the next word joins the previous one when detokenised: a word before them is not yet whole
JOINERS = frozenset({"@,@", "@.@", "@-@"})


@dataclass(frozen=True)
class Moses:
    """Moses pre-tokenisation as Hugging Face's ``TransfoXLTokenizer`` does it (sacremoses)."""

    lang: str = "en"
    """Language of sacremoses' normaliser, tokeniser and detokeniser."""
    aggressive_dash_splits: bool = True
    """Split hyphens inside words (``1,000-year-old`` → ``1 @,@ 000 @-@ year @-@ old``)."""
    number_splits: bool = True
    """Split ``,`` and ``.`` between digits into ``@,@`` / ``@.@`` tokens (and join them back on decode)."""
    never_split: tuple[str, ...] = ()
    """Patterns Moses keeps whole (HF's ``never_split``: its special tokens)."""
    specials: tuple[str, ...] = ()
    """Symbols taken out of the text before Moses sees it (HF's added special tokens), e.g. ``<unk>``."""
    type: ClassVar[str] = "moses"

    @cached_property
    def _tools(self):
        try:
            import sacremoses
        except ImportError as e:  # a core dependency; only a broken install lands here
            raise DataError(f"this tokenizer reads raw text with Moses and needs sacremoses ({e})") from None
        return (
            sacremoses.MosesPunctNormalizer(self.lang),
            sacremoses.MosesTokenizer(self.lang),
            sacremoses.MosesDetokenizer(self.lang),
        )

    @cached_property
    def _special_re(self) -> re.Pattern | None:
        if not self.specials:
            return None
        return re.compile("(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")")

    def tokenize(self, line: str, lower_case: bool = False) -> list[str]:
        """Symbols of one line of raw text (HF's ``tokenize``: specials split out, then Moses on each piece)."""
        if self._special_re is None:
            pieces = [line.lower() if lower_case else line]
        else:  # lower-cased around exact special tokens first (so <UNK> becomes the special <unk>), as HF does
            if lower_case:
                line = "".join(p if k % 2 else p.lower() for k, p in enumerate(self._special_re.split(line)))
            pieces = self._special_re.split(line)
        out: list[str] = []
        for k, piece in enumerate(pieces):
            if k % 2:  # a special token, kept as written
                out.append(piece)
            elif piece:
                out += self._moses(piece)
        return out

    def _moses(self, text: str) -> list[str]:
        norm, tok, _ = self._tools
        text = text.strip()
        if not text:
            return []
        words = tok.tokenize(
            norm.normalize(text),
            aggressive_dash_splits=self.aggressive_dash_splits,
            return_str=False,
            escape=False,
            protected_patterns=list(self.never_split) or None,
        )
        if self.number_splits:
            words = [w for word in words for w in _NUMBER_SPLIT.sub(r" @\g<0>@ ", word).split()]
        return words

    def detokenize(self, symbols: Sequence[str]) -> str:
        """Text of one line's symbols (HF's ``convert_tokens_to_string``)."""
        text = self._tools[2].detokenize(list(symbols))
        if self.number_splits:
            for joined, by in _NUMBER_JOINS:
                text = text.replace(joined, by)
        return text.strip()


_DIGITS = dict(zip("0123456789", "zero one two three four five six seven eight nine".split(), strict=True))
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_NOT_LETTER = re.compile(r"[^a-z]+")


@dataclass(frozen=True)
class Text8:
    """The text8 normalisation (``wikifil.pl``'s last steps): what a text8 model can read."""

    type: ClassVar[str] = "text8"

    def normalize(self, text: str) -> str:
        text = text.translate(_ASCII_LOWER)  # tr/A-Z/a-z/: ASCII only, as the Perl script
        for digit, word in _DIGITS.items():
            text = text.replace(digit, f" {word} ")
        return _NOT_LETTER.sub(" ", text)  # tr/a-z/ /cs: everything else a space, runs squeezed


RawText = Moses | Text8


def raw_text_to_json(raw: RawText | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    return {"type": raw.type} | {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(raw).items()}


def raw_text_from_json(obj: dict[str, Any] | None, source: str) -> RawText | None:
    if obj is None:
        return None
    kinds = {"moses": Moses, "text8": Text8}
    kind = kinds.get(obj.get("type"))
    if kind is None:
        raise DataError(f"{source}: unknown raw-text pipeline {obj.get('type')!r} (known: {', '.join(kinds)})")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in obj.items() if k != "type"}
    try:
        return kind(**fields)
    except TypeError as e:
        raise DataError(f"{source}: bad {obj['type']} settings ({e})") from None
