"""``txl tokenize``."""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path
from typing import Literal

from txl.cli.common import _utf8_text
from txl.data.text import universal_newlines


def tokenize(
    model: Path | None = None,
    text: str | None = None,
    ids: bool = False,
    decode: bool = False,
    unknown: Literal["error", "replace"] | None = None,
) -> None:
    """Show what a model sees: the tokens (a JSON list) or ids of a text, read with the model's tokenizer.json
    (its raw-text pipeline included: Moses for a WikiText-103 model, text8's normalisation, ...).

    Args:
        model: A model folder, run folder or checkpoint.
        text: The text (default: standard input).
        ids: Print the ids (space-separated) instead of the tokens.
        decode: The text is ids (space-separated); print the detokenised text.
        unknown: Characters/bytes outside a vocabulary without <unk>: error, or replace (default: the tokenizer's).
    """
    from txl.data import Tokenizer

    if model is None:
        raise ValueError("txl tokenize needs --model (a model folder, run folder or checkpoint)")
    if ids and decode:  # (probes.md k05: --ids was ignored)
        raise ValueError("--ids prints a text's ids, --decode reads ids: give one of them")
    tok = Tokenizer.from_pretrained(model)
    if unknown is not None:
        tok = tok.with_unknown(unknown)
    raw = _utf8_text(sys.stdin.buffer.read() if text is None else text, "standard input" if text is None else "--text")
    raw = universal_newlines(raw.removeprefix("\ufeff"))  # (read as a training file is: no byte order mark, LF)
    if decode:
        try:
            numbers = [int(x) for x in raw.split()]
        except ValueError:
            raise ValueError("--decode reads ids: whole numbers separated by spaces") from None
        if any(not 0 <= i < tok.vocab_size for i in numbers):
            raise ValueError(f"--decode: ids must be in [0, {tok.vocab_size})")
        print(tok.decode(numbers))
        return
    out = tok.encode(raw)
    print(" ".join(map(str, out)) if ids else _json.dumps([tok.symbols[i] for i in out], ensure_ascii=False))
