"""``txl eval``: score a text with a model (with a memory, or a sliding window)."""

from __future__ import annotations

import json as _json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from txl.cli.common import _check_eval_memory, _set_threads
from txl.config import Precision, Quantization, Split


@dataclass
class EvalArgs:
    """The arguments of ``txl eval`` (each an option; these docstrings are its ``--help``)."""

    model: Path | None = None
    """A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder with tokenizer.json."""
    data: str | None = None
    """A text file (scored whole) or a folder of text ({split}.txt, {split}/*.txt, or documents); default: the
    run's dataset."""
    dataset: str | None = None
    """Layout of a --data folder when it is one of the paper's datasets (wt103, enwik8, ...); default: a folder
    of .txt files. How the text is tokenized always comes from the model."""
    split: Split | None = None
    """train, valid or test (default: the run's eval.split, else test)."""
    tgt_len: int | None = None
    """Segment length."""
    mem_len: int | list[int] | None = None
    """Memory length (the paper evaluates with a longer memory than in training), or a list of lengths (a memory
    sweep: '[0, 64, 128, 256]' or 0,64,128,256), one line each and a plot of the metric against it."""
    clamp_len: int | None = None
    """Relative distances above this share one position embedding (-1: none)."""
    cmem_len: int | None = None
    """A Compressive Transformer's compressed memory slots per layer (default: the model's; longer reaches further
    back, as --mem_len does for the memory; 0: read as Transformer-XL)."""
    same_length: bool | None = None
    """Every query attends to the same number (mem_len) of keys."""
    batch_size: int | None = None
    """Columns evaluated in parallel."""
    max_batches: int | None = None
    """Stop after this many batches (default: the whole text)."""
    precision: Precision = "fp32"
    """fp32, bf16, fp16 (CUDA) or auto (bf16 where the device computes it natively, else fp32)."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    threads: int | None = None
    """torch CPU threads (default: torch's, one per core)."""
    encoding_errors: Literal["strict", "replace"] | None = None
    """strict (a non-UTF-8 byte is an error naming file and line) or replace (read as U+FFFD); default: the
    run's data.encoding_errors, else strict."""
    raw_text: bool | None = None
    """The --data file is raw text (a new document): read it through the tokenizer's raw-text pipeline (Moses
    for a WikiText-103 model, text8's normalisation); default: as the model's training files were read (the
    paper's datasets are already tokenized)."""
    sliding_window: int | None = None
    """Score like a vanilla Transformer (Al-Rfou et al.): every prediction sees only this many previous tokens,
    recomputed from scratch for each window, no memory (the paper's Table 9 baseline)."""
    stride: int = 1
    """With --sliding_window: slide the window by this many tokens, scoring its last `stride` positions (1: one
    prediction per window, as the paper does; larger is faster and gives more context-poor scores)."""
    plot: Path | None = None
    """With a list of --mem_len: the PNG of the metric against the memory length (default: mem_len_sweep.png)."""
    json: bool = False
    """Print one JSON object instead of a line of text (one per memory length; with the scoring's seconds and
    tokens_per_s, as the line of text has its tokens/s)."""
    zero_memory: bool = False
    """Start every column from mem_len zero vectors, as Hugging Face's TransfoXL (and the TF code) evaluated: a
    converted HF model then gives HF's numbers (default: an empty memory, as the original PyTorch code)."""
    quantize: Quantization = "none"
    """Score with the model's Linear layers in int8 (CPU): int8 (PyTorch's dynamic quantization) or int8-weight-
    only (torchao's, needs the extra 'quant'); none: as saved."""


def eval(args: EvalArgs) -> None:
    """Score a text with a model: mean loss and ppl (words) or bpc (characters/bytes), with the settings used.

    The text is read with the model's own tokenizer.json. Settings not given come from the run's `eval` section
    (saved in every checkpoint), else from the model."""
    from txl.infer.evaluate import eval_settings, eval_text, metric_name
    from txl.infer.quantize import quantize as quantize_model
    from txl.kernels.backends import backends
    from txl.kernels.runtime import configure_allocator, effective_precision
    from txl.model.modeling import TransformerXLLM
    from txl.train.checkpoint import read_run_config, resolve_model_dir
    from txl.util.distributed import resolve_device

    if args.model is None:
        raise ValueError("txl eval needs --model RUN_OR_DIR (a run folder, a step-N checkpoint or a model folder)")
    if args.max_batches is not None and args.max_batches < 1:
        raise ValueError(f"--max_batches = {args.max_batches}: must be >= 1 (leave it out to score the whole text)")
    _set_threads(args.threads)
    dev = resolve_device(args.device, option="--device")
    asked = args.precision
    precision, note = effective_precision(dev, args.precision)
    if note:
        print(f"txl: note: --precision {asked}: {note}" if asked == "auto" else
              f"txl: note: --precision bf16, but {note}", file=sys.stderr)  # fmt: skip
    if dev.type == "cpu":
        configure_allocator()  # (not the oneDNN route: slower for evaluation's products, see txl.kernels.runtime)
    else:  # (on a GPU the policy chooses among several paths: say which, as txl train does)
        print(f"txl: runtime: {backends().inference_paths(dev.type, precision)}", file=sys.stderr)
    folder = resolve_model_dir(args.model)
    run = read_run_config(folder)
    if args.quantize != "none" and precision != "fp32":
        raise ValueError(
            f"--quantize {args.quantize} scores with int8 Linear layers in fp32 around them: no --precision"
        )
    lm = quantize_model(TransformerXLLM.from_pretrained(folder).eval(), args.quantize, dev)
    sweep = args.mem_len if isinstance(args.mem_len, list) else None
    if sweep is not None and (not sweep or args.sliding_window is not None):
        raise ValueError("--mem_len as a list needs at least one length, and no --sliding_window")
    if sweep is None and args.plot is not None:
        raise ValueError("--plot needs a list of memory lengths: --mem_len '[0, 64, 128]'")
    if sweep:  # (where the plot goes, checked before the sweep's evaluations)
        from txl.util.plot import image_path

        plot = image_path(args.plot or Path("mem_len_sweep.png"), "--plot", "mem_len_sweep.png")
    given = dict(split=args.split, batch_size=args.batch_size, tgt_len=args.tgt_len, clamp_len=args.clamp_len,
                 same_length=args.same_length, cmem_len=args.cmem_len)  # fmt: skip
    settings_list = [eval_settings(run, lm.config, mem_len=m, **given) for m in sweep or [args.mem_len]]
    s = settings_list[0]
    if args.sliding_window is not None and args.sliding_window < 1:
        raise ValueError(f"--sliding_window = {args.sliding_window}: must be >= 1")
    if args.sliding_window is not None and not 1 <= args.stride <= args.sliding_window:
        raise ValueError(f"--stride = {args.stride}: must be in [1, --sliding_window = {args.sliding_window}]")
    if args.sliding_window is None and args.stride != 1:
        raise ValueError("--stride needs --sliding_window")
    if args.raw_text and (args.data is None or not Path(args.data).is_file()):
        raise ValueError("--raw_text applies to a --data file (a document to score)")
    text = eval_text(folder, run, s.split, args.data, args.dataset, args.encoding_errors, args.raw_text)
    n_tokens = None if isinstance(text.ids, list) else len(text.ids)  # (lm1b's sentence streams fill tgt_len)
    for es in settings_list:
        _check_eval_memory(lm.config, es, args.sliding_window, n_tokens, args.zero_memory, dev, precision != "fp32")
    if args.sliding_window is not None:
        if args.zero_memory:
            raise ValueError("--zero_memory gives the memory a start; --sliding_window reads without a memory")
        _sliding_eval(
            lm.to(dev), text, s, folder, args.sliding_window, args.stride, args.max_batches, precision, dev, args.json
        )
        return
    name = metric_name(text.tokenizer.kind)
    points = [
        _score(lm.to(dev), text, es, args, precision, dev, folder, es is settings_list[0]) for es in settings_list
    ]
    if sweep:
        from txl.util.plot import plot_memory_sweep

        where = plot_memory_sweep(points, name, plot, title=f"{folder} ({s.split})")
        print(f"plot: {where}", file=sys.stderr if args.json else sys.stdout)


def _score(lm, text, s, args: EvalArgs, precision: str, dev, folder: Path, first: bool) -> tuple[int, float]:  # noqa: ANN001
    """One evaluation with settings ``s``, printed (a line, or JSON); its (mem_len, metric) for a sweep's plot."""
    from txl.infer.evaluate import NonFiniteError, evaluate, metric_name, metric_value
    from txl.util.distributed import World

    name = metric_name(text.tokenizer.kind)
    start = time.perf_counter()
    res = evaluate(
        lm, text.ids, batch_size=s.batch_size, tgt_len=s.tgt_len, mem_len=s.mem_len, clamp_len=s.clamp_len,
        same_length=s.same_length, cmem_len=s.cmem_len, max_batches=args.max_batches, precision=precision,
        world=World(device=dev),
        zero_memory=args.zero_memory,
    )  # fmt: skip
    speed = _speed(res.tokens, time.perf_counter() - start)
    if not math.isfinite(res.loss):
        raise NonFiniteError(
            f"the loss on {text.description} is {res.loss}: the model gives a non-finite probability somewhere "
            f"in it (precision {precision}{'; try --precision fp32' if precision != 'fp32' else ''})"
        )
    value = metric_value(res.loss, name)
    left = len(text.ids) - 1 - res.tokens if not isinstance(text.ids, list) and args.max_batches is None else 0
    if left > 0 and first:  # (the reference's batchify: each column holds len // batch tokens)
        print(
            f"txl: note: the last {left:,} tokens of the text were not scored: it is cut into {s.batch_size} "
            "columns of equal length, as the paper's evaluation does (--batch_size 1 scores every token)",
            file=sys.stderr,
        )
    settings = {"split": s.split, "tgt_len": s.tgt_len, "mem_len": s.mem_len, "clamp_len": s.clamp_len}
    settings |= {"same_length": s.same_length, "batch_size": s.batch_size}
    if lm.config.cmem_len:
        settings["cmem_len"] = lm.config.cmem_len if s.cmem_len is None else s.cmem_len
    if args.zero_memory:
        settings["zero_memory"] = True
    if args.json:
        record = {"model": str(folder), "data": text.description, "loss": res.loss, name: value}
        print(_json.dumps(record | {"tokens": res.tokens} | settings | speed, ensure_ascii=False), flush=True)
    else:
        label = text.description if args.data is not None and Path(args.data).is_file() else s.split
        print(
            f"{label}: loss {res.loss:.4f} | {name} {value:.4f} | tgt_len {s.tgt_len}, mem_len {s.mem_len}, "
            f"{'cmem_len ' + str(settings['cmem_len']) + ', ' if 'cmem_len' in settings else ''}"
            f"clamp_len {s.clamp_len}, same_length {s.same_length}, batch {s.batch_size}"
            f"{', zero memory' if args.zero_memory else ''} | "
            f"{res.tokens:,} tokens, {speed['tokens_per_s']:,.0f} tokens/s | {folder}",
            flush=True,
        )
    return s.mem_len, value


def _speed(tokens: int, seconds: float) -> dict:
    """The scoring's wall time and throughput (the model's steps and the host's reads of their losses; not the
    loading of the model and the text)."""
    return {"seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}


def _sliding_eval(lm, text, s, folder: Path, window: int, stride: int, max_batches, precision, dev, json) -> None:
    """`txl eval --sliding_window`: the vanilla model's evaluation, printed with its settings."""
    from txl.infer.evaluate import evaluate_sliding, metric_name, metric_value
    from txl.util.distributed import World

    start = time.perf_counter()
    res = evaluate_sliding(
        lm,
        text.ids,
        window=window,
        stride=stride,
        batch_size=s.batch_size,
        clamp_len=s.clamp_len,
        max_batches=max_batches,
        precision=precision,
        world=World(device=dev),
    )
    speed = _speed(res.tokens, time.perf_counter() - start)
    name = metric_name(text.tokenizer.kind)
    value = metric_value(res.loss, name)
    settings = {"split": s.split, "sliding_window": window, "stride": stride, "mem_len": 0}
    settings |= {"clamp_len": s.clamp_len, "batch_size": s.batch_size}
    if json:
        record = {"model": str(folder), "data": text.description, "loss": res.loss, name: value, "tokens": res.tokens}
        print(_json.dumps(record | settings | speed, ensure_ascii=False))
        return
    print(
        f"{s.split}: loss {res.loss:.4f} | {name} {value:.4f} | sliding window {window}, stride {stride}, no memory, "
        f"clamp_len {s.clamp_len}, batch {s.batch_size} windows | {res.tokens:,} tokens, "
        f"{speed['tokens_per_s']:,.0f} tokens/s | {folder}"
    )
