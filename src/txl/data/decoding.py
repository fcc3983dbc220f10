"""Text of ids fed one at a time (:class:`StreamDecoder`, what ``Tokenizer.stream_decoder`` gives), and the symbols
both it and :class:`txl.data.tokenizer.Tokenizer` read: the line-end tokens and the byte tokens' characters."""

from __future__ import annotations

import codecs
from typing import Any

from txl.data.rawtext import JOINERS, Moses

EOS, DOUBLE_EOS = "<eos>", "<S>"


def _byte_chars() -> list[str]:
    """The printable stand-in character of each byte (GPT-2's table, which ``tokenizers``' ByteLevel uses)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_CHARS = _byte_chars()
BYTE_OF_CHAR = {ch: b for b, ch in enumerate(BYTE_CHARS)}


class StreamDecoder:
    """Text of ids fed one at a time: the pieces returned by :meth:`push` and :meth:`flush`, concatenated, equal
    :meth:`Tokenizer.decode` of all the ids. A word gets its separator (a space, or nothing after a line end); a
    UTF-8 sequence split over byte tokens appears once complete. With a Moses tokenizer, whole detokenised words
    are given once the next word shows they are whole (``1 @,@ 000`` appears as ``1,000``, never as ``1`` first)."""

    def __init__(self, tokenizer: Any):  # (a txl.data.tokenizer.Tokenizer)
        self.tok = tokenizer
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace") if tokenizer.kind == "byte" else None
        self._line_start = True
        self._moses = tokenizer.raw_text if isinstance(tokenizer.raw_text, Moses) else None
        self._line: list[str] = []  # Moses: the symbols of the current line
        self._given = 0  # Moses: characters of the current line's text already given

    def push(self, token_id: int) -> str:
        sym = self.tok.symbol(token_id)
        if self._bytes is not None:
            return self._bytes.decode(bytes([BYTE_OF_CHAR[sym]]))
        if self.tok.kind == "char":
            return sym
        if self._moses is not None:
            return self._push_moses(sym)
        if self.tok.line_end == "eos" and sym == EOS:
            self._line_start = True
            return "\n"
        piece = sym if self._line_start else " " + sym
        self._line_start = False
        return piece

    def peek(self, token_id: int) -> str:
        """What :meth:`push` would return for this token now, without taking it."""
        state = (self._bytes.getstate() if self._bytes is not None else None, self._line_start, list(self._line),
                 self._given)  # fmt: skip
        try:
            return self.push(token_id)
        finally:
            if self._bytes is not None:
                self._bytes.setstate(state[0])
            self._line_start, self._line, self._given = state[1:]

    def _push_moses(self, sym: str) -> str:
        if self.tok.line_end == "eos" and sym == EOS:
            return self._end_line() + "\n"
        self._line.append(sym)
        text = self._moses.detokenize(self._line)
        # a word is whole once a later word follows it that does not join onto it (@,@ @.@ @-@)
        last = len(self._line) - 1
        while last > 0 and self._line[last] in JOINERS or last > 0 and self._line[last - 1] in JOINERS:
            last -= 1
        if last <= 0:
            return ""
        done = self._moses.detokenize(self._line[:last])
        cut = min(len(done), text.rfind(" ") if text.rfind(" ") >= 0 else 0)
        if not text.startswith(done[:cut]) or cut <= self._given:
            return ""
        piece, self._given = text[self._given : cut], cut
        return piece

    def _end_line(self) -> str:
        text = self._moses.detokenize(self._line) if self._line else ""
        piece = text[self._given :]
        self._line, self._given = [], 0
        return piece

    def flush(self) -> str:
        """What is still held back (a Moses line's last words; an incomplete UTF-8 sequence at the very end, as
        U+FFFD)."""
        if self._moses is not None:
            return self._end_line()
        return self._bytes.decode(b"", final=True) if self._bytes is not None else ""
