"""``txl recl``, ``txl attention`` and ``txl plot``: the paper's analyses of trained models."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from pathlib import Path

from txl.cli.common import _set_threads
from txl.config import Split


@dataclass
class ReclArgs:
    """The arguments of ``txl recl`` (each an option; these docstrings are its ``--help``)."""

    models: list[Path] | None = None
    """Run folders or model folders (the same tokenizer), e.g. --models runs/a runs/b."""
    contexts: list[int] | None = None
    """Evenly spaced context lengths, e.g. '[32, 64, 96, 128]'."""
    sliding: list[Path] | None = None
    """Those of --models scored with a sliding window (vanilla models) instead of a memory."""
    r: list[float] | None = None
    """Fractions of the hardest tokens to average over (default: the paper's 0.1, 0.5 and 1.0)."""
    tokens: int = 5000
    """Score the first this many tokens of the text."""
    data: str | None = None
    """A text file or folder, as for txl eval (default: the first model's run data)."""
    split: Split | None = None
    """train, valid or test (default: the first model's eval.split, else test)."""
    tgt_len: int | None = None
    """Segment length of the memory models (default: each model's evaluation tgt_len)."""
    batch_size: int = 16
    """Windows scored at once (sliding)."""
    threshold: float = 0.01
    """Gain below which more context stops counting (the paper: 0.01)."""
    cap_windows: bool = True
    """A --sliding model with a learned position table (attn_type 3) reads at most that many tokens (max_klen,
    its training span): longer contexts score its longest window, as the paper scores its vanilla Transformer at
    its training length. false: longer windows (their oldest keys share position 0)."""
    out: Path | None = None
    """Folder for recl.json and recl.png (default: the current folder)."""
    threads: int | None = None
    """torch CPU threads."""


def recl(args: ReclArgs) -> None:
    """Relative effective context length (RECL, the paper's Appendix C) of a group of models on one text.

    Every model scores the same tokens at every context length (Transformer-XL: memory length; a vanilla model
    given in --sliding: window length); RECL is the first length whose relative gain to the next falls below the
    threshold, against the group's best loss per token. Prints the table and writes recl.json and recl.png."""
    import numpy as np

    from txl.infer.evaluate import eval_settings, eval_text
    from txl.infer.recl import check_contexts, check_ratio, context_losses, plot_gains
    from txl.infer.recl import recl as compute_recl
    from txl.model.modeling import TransformerXLLM
    from txl.train.checkpoint import read_run_config, resolve_model_dir

    if not args.models or len(args.models) < 2:
        raise ValueError("--models needs at least two models: RECL compares a group")
    if not args.contexts:
        raise ValueError("--contexts needs evenly spaced lengths, e.g. '[32, 64, 96]'")
    if args.tokens < 2:
        raise ValueError(f"--tokens = {args.tokens}: must be >= 2")
    args.contexts = check_contexts(args.contexts)  # (before any model is scored)
    if args.r is not None and not args.r:
        raise ValueError("--r []: give at least one fraction, or leave --r out (the paper's 0.1, 0.5 and 1.0)")
    for ratio in args.r or []:
        check_ratio(ratio)
    if args.batch_size < 1:
        raise ValueError(f"--batch_size = {args.batch_size}: must be >= 1")
    if not 0 <= args.threshold < 1:
        raise ValueError(f"--threshold = {args.threshold}: must be in [0, 1) (a relative gain; the paper's is 0.01)")
    args.out = Path(args.out or ".")
    if (
        args.out.exists() and not args.out.is_dir()
    ):  # (before the models are scored: the results are written at the end)
        raise ValueError(f"--out {args.out}: a file, not a folder (recl.json and recl.png go in it)")
    sliding_set = {str(p) for p in args.sliding or []}
    unknown = sliding_set - {str(p) for p in args.models}
    if unknown:
        raise ValueError(f"--sliding {sorted(unknown)}: not among --models")
    _set_threads(args.threads)
    ratios = args.r or [0.1, 0.5, 1.0]
    losses, ids_seen = {}, None
    for path in args.models:
        folder = resolve_model_dir(path)
        run = read_run_config(folder)
        lm = TransformerXLLM.from_pretrained(folder)
        s = eval_settings(run, lm.config, split=args.split, tgt_len=args.tgt_len)
        text = eval_text(folder, run, s.split, args.data, None, None)
        if isinstance(text.ids, list):
            raise ValueError(f"{path}: RECL scores one token stream; sentence shards (lm1b) are not one")
        ids = np.asarray(text.ids[: args.tokens + 1], dtype=np.int64)
        if args.contexts[0] >= len(ids) - 1:  # (probes.md r8: every context past the text gave RECL = the largest)
            raise ValueError(
                f"--contexts {args.contexts}: the shortest is {args.contexts[0]:,} tokens, but {len(ids) - 1:,} are "
                "scored (--tokens, or the text's length): give shorter contexts or more tokens"
            )
        if ids_seen is not None and not np.array_equal(ids, ids_seen):
            raise ValueError(
                f"{path}: reads the text into other tokens than {args.models[0]}: RECL needs one tokenizer"
            )
        ids_seen = ids
        name = str(path)
        how = "window" if name in sliding_set else "memory"
        cap = lm.config.max_klen if args.cap_windows and name in sliding_set and lm.config.attn_type == 3 else None
        if cap is not None and cap < args.contexts[-1]:
            how += f"; at most {cap} tokens, its learned positions"
        print(f"scoring {name} at {len(args.contexts)} context lengths ({how})")
        losses[name] = context_losses(
            lm, ids, args.contexts, sliding=name in sliding_set, tgt_len=s.tgt_len, clamp_len=s.clamp_len,
            same_length=s.same_length, batch_size=args.batch_size, max_window=cap,
        )  # fmt: skip
    results = [compute_recl(losses, args.contexts, ratio, args.threshold) for ratio in ratios]
    args.out.mkdir(parents=True, exist_ok=True)
    from txl.util.fileio import write_bytes

    record = {
        "contexts": list(args.contexts),
        "tokens": int(len(ids_seen) - 1),
        "threshold": args.threshold,
        "results": [{"r": x.r, "recl": x.recl, "reached": x.reached, "gains": x.gains} for x in results],
    }
    write_bytes(args.out / "recl.json", (_json.dumps(record, indent=1) + "\n").encode())
    plot_gains(results, args.out / "recl.png", args.threshold)
    print("| model | " + " | ".join(f"RECL r={x.r}" for x in results) + " |")
    print("|---|" + "---|" * len(results))
    for name in losses:
        cells = [f"{x.recl[name]}{'' if x.reached[name] else '+'}" for x in results]
        print(f"| {name} | " + " | ".join(cells) + " |")
    unreached = any(not ok for x in results for ok in x.reached.values())
    print(
        (f"(+: the gain never fell below {args.threshold} up to the longest length)  " if unreached else "")
        + f"{args.out / 'recl.json'}, {args.out / 'recl.png'}"
    )


def attention(
    model: Path | None = None, data: str | None = None, text: str | None = None, out: Path = Path("attention"),
    tokens: int = 2000, tgt_len: int | None = None, mem_len: int | None = None, same_length: bool | None = None,
    layer: int = -1, head: int = 0, threads: int | None = None,
) -> None:  # fmt: skip
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
        layer: Layer of the full map (-1: the last; negative numbers count from the last).
        head: Head of the full map (negative numbers count from the last).
        threads: torch CPU threads.
    """
    import numpy as np

    from txl.cli.common import attention_pass_bytes
    from txl.infer.attention_maps import attention_maps, plot_attention
    from txl.infer.evaluate import eval_settings, eval_text
    from txl.kernels.runtime import check_fits
    from txl.model.modeling import TransformerXLLM
    from txl.train.checkpoint import read_run_config, resolve_model_dir
    from txl.util.fileio import write_bytes

    if model is None:
        raise ValueError("txl attention needs --model RUN_OR_DIR")
    if tokens < 2:
        raise ValueError(f"--tokens = {tokens}: must be >= 2")
    if data is not None and text is not None:
        raise ValueError("txl attention: give the text once, with --data (--text is its former name)")
    if text is not None and not text.strip():  # (probes.md u38: '' was read as '.', the current folder)
        raise ValueError("--text is empty: give a text file or a folder of text (--data)")
    if Path(out).exists() and not Path(out).is_dir():  # (before the maps are computed: they are written at the end)
        raise ValueError(f"--out {out}: a file, not a folder (the images and attention.json go in it)")
    _set_threads(threads)
    folder = resolve_model_dir(model)
    run = read_run_config(folder)
    lm = TransformerXLLM.from_pretrained(folder)
    cfg = lm.config
    if not -cfg.n_layer <= layer < cfg.n_layer:
        raise ValueError(
            f"--layer = {layer}: the model has {cfg.n_layer} layers (0..{cfg.n_layer - 1}, or -{cfg.n_layer}..-1 "
            "counted from the last)"
        )
    if not -cfg.n_head <= head < cfg.n_head:
        raise ValueError(
            f"--head = {head}: the model has {cfg.n_head} heads (0..{cfg.n_head - 1}, or -{cfg.n_head}..-1 "
            "counted from the last)"
        )
    s = eval_settings(run, cfg, tgt_len=tgt_len, mem_len=mem_len, same_length=same_length)
    source = eval_text(folder, run, s.split, data if data is not None else text, None, None)
    if isinstance(source.ids, list):
        raise ValueError("txl attention reads one token stream; sentence shards (lm1b) are not one")
    ids = np.asarray(source.ids[:tokens], dtype=np.int64)
    T = min(s.tgt_len, len(ids))
    K = min(s.mem_len, len(ids) - T) + T  # (the longest window: a memory holds no more than the text before)
    check_fits(  # (every layer's probabilities kept, fp32 twice and the last segment's in float64; the distances
        # and the full map's image, ~34 bytes an entry of [T, K]; measured: 4.0 GB at T = K = 6,000, L = H = 2)
        16 * cfg.n_layer * cfg.n_head * T * K + 34 * T * K + attention_pass_bytes(cfg, 1, T, K, half=True),
        f"txl attention over segments of {T:,} tokens with a memory of {K - T:,}",
        "give a smaller --tgt_len, --mem_len or --tokens",
    )
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


def plot(run: Path, out: Path | None = None) -> None:
    """Plot the training and validation curves of a run (RUN/metrics.jsonl) to a PNG.

    Args:
        run: The run folder.
        out: Output PNG (default: RUN/loss.png).
    """
    from txl.util.plot import plot_run

    print(plot_run(run, out))
