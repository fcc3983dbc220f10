"""``txl generate``: its arguments (:class:`GenerateArgs`) and the text path; a music model's piece is
:mod:`txl.cli.generate_music`'s."""

from __future__ import annotations

import json as _json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from txl.cli.common import (
    DEFAULT_GENERATE_THREADS,
    _check_generate_memory,
    _reading_dict,
    _set_threads,
    logged_after,
)
from txl.cli.generate_music import (
    check_music_files,
    generate_music,
    is_music_model,
    is_music_tokenizer,
)
from txl.config import Quantization


@dataclass
class GenerateArgs:
    """The arguments of ``txl generate`` (each an option; these docstrings are its ``--help``)."""

    model: Path | None = None
    """A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder."""
    prompt: str | None = None
    """Prompt text (encoded with the model's tokenizer.json)."""
    prompt_ids: list[int] | None = None
    """Prompt token ids instead, e.g. 1,2,3 (prints ids as JSON when there is no tokenizer)."""
    max_new_tokens: int | None = None
    """Number of tokens to generate (>= 0; default 100; a music model with --bars: at most 512 per bar)."""
    temperature: float = 1.0
    """Sampling temperature (>= 0; 0 = greedy)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = all)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1] (1 = off); the most likely token is always kept."""
    mem_len: int | None = None
    """Memory length at generation. The defaults of mem_len, clamp_len and same_length are the model's reading
    settings, as every command's: the run's eval section, else the model's config (printed on stderr after the
    text; in the JSON output with --json)."""
    clamp_len: int | None = None
    """Relative distances above this share one position embedding (-1: none)."""
    same_length: bool | None = None
    """Every query attends to the same number of keys."""
    seed: int = 0
    """Random seed for sampling (64 bits: -2**63 to 2**63 - 1)."""
    stop: str | list[str] | None = None
    """Stop after this token, or any of a list of them (each must be one token of the model's tokenizer, e.g. a
    newline)."""
    stop_ids: int | list[int] | None = None
    """Stop after this token id, or any of a list of them."""
    stream: bool = True
    """Print each token as it is made (false: print the text at the end)."""
    threads: int | None = None
    """torch CPU threads (default: 1, the fastest for token-by-token decoding on a shared machine)."""
    json: bool = False
    """Print a JSON object with the prompt and the new ids (and text) at the end instead of streaming."""
    zero_memory: bool = False
    """Start from mem_len zero vectors, as Hugging Face's TransfoXL (and the TF code) did: a converted HF model
    then continues as HF's generate() did (default: an empty memory, as the original PyTorch code)."""
    repetition_penalty: float = 1.0
    """Hugging Face's (CTRL's) penalty on every token already in the prompt or the text: its log-probability is
    multiplied by this (> 1 makes repeats less likely; 1 = none)."""
    no_repeat_ngram_size: int = 0
    """Never repeat an n-gram of this many tokens of the prompt and the text (0 = off)."""
    num_beams: int = 1
    """Beam search with this many beams, as Hugging Face's generate() (1 = greedy or sampling; with beams the
    text is printed at the end, and --temperature must be 0)."""
    length_penalty: float = 1.0
    """Beam search: a finished text's score is its log-probability over its length to this power."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto (the GPU if there is one). On a GPU each new token is one CUDA graph replay
    (txl.infer.static_decode); a seed samples differently there than on the CPU (another generator)."""
    quantize: Quantization = "none"
    """Generate with the model's Linear layers in int8 (CPU): int8 (PyTorch's dynamic quantization) or
    int8-weight-only (torchao's, needs the extra 'quant'); none: as saved."""
    unknown: Literal["error", "replace"] | None = None
    """Characters outside the vocabulary in the prompt or a stop: error (one line naming the first) or replace
    (the tokenizer's replacement symbol); default: the tokenizer's."""
    midi: Path | None = None
    """Music models: write the piece (the prompt's notes, then the new ones) to this MIDI file."""
    prompt_midi: Path | None = None
    """Music models: continue this MIDI file (its notes as the tokenizer reads them: all tracks merged, on its
    grid); without it (and --prompt_ids) a piece starts from nothing."""
    bars: int | None = None
    """Music models: stop after this many new bars (else after --max_new_tokens events)."""
    grammar: bool = True
    """Music models: keep the piece valid REMI (event order, time forward in the bar, notes inside their bars),
    masking what the grammar rules out; false: sample freely and count the invalid events."""
    piano_roll: Path | None = None
    """Music models: also draw the piece as a piano roll with its bar lines (a PNG)."""


def generate(args: GenerateArgs) -> None:
    """Continue a prompt with a model, keeping the memory as cached keys and values; the text appears as it is made."""
    import torch

    from txl.infer.load import load
    from txl.kernels.runtime import configure_allocator
    from txl.util.distributed import resolve_device

    music, prompt_score, max_new_tokens = _checked(args)
    _set_threads(DEFAULT_GENERATE_THREADS if args.threads is None else args.threads)
    dev = resolve_device(args.device, option="--device")
    if dev.type == "cpu":
        configure_allocator()
    loaded = load(args.model, dev, args.quantize, mem_len=args.mem_len, clamp_len=args.clamp_len,
                  same_length=args.same_length)  # fmt: skip
    if loaded.settings.mem_len < 1:
        raise ValueError(
            f"{loaded.folder}: the model reads with no memory; give --mem_len >= 1 (generation carries one)"
        )
    tok = loaded.tokenizer
    if tok is not None and args.unknown is not None:  # (probes.md d16: the error advised an option generate lacked)
        tok = tok.with_unknown(args.unknown)
    generator = torch.Generator(device=dev).manual_seed(args.seed)
    if music or is_music_tokenizer(tok):
        if args.prompt is not None and tok is not None:
            tok.encode(args.prompt)  # (a music model: one line saying it reads MIDI)
        if args.num_beams > 1:
            raise ValueError("--num_beams: music is sampled (or greedy) event by event under its grammar; use 1")
        return generate_music(loaded, args, prompt_score, max_new_tokens, generator, dev)
    prompt_ids, stops = _encoded(args, loaded, tok)
    tokens, streamed = _continuation(args, loaded, prompt_ids, stops, max_new_tokens, generator, dev)
    _emit(args, loaded, tok, prompt_ids, tokens, streamed)


def _checked(args: GenerateArgs) -> tuple[bool, object, int]:
    """The options checked before the model is read (one line, nothing written): whether it is a music run, the
    prompt's MIDI score (or None), and the number of new tokens."""
    from txl.config import MAX_SEED, MIN_SEED, SEED_RANGE
    from txl.infer.generation import check_sampling

    music = args.midi is not None or args.prompt_midi is not None or args.bars is not None
    music = music or args.piano_roll is not None
    if args.model is None:
        raise ValueError("txl generate needs --model DIR and one of --prompt TEXT or --prompt_ids '[id, ...]'")
    if sum(x is not None for x in (args.prompt, args.prompt_ids, args.prompt_midi)) > 1:
        raise ValueError("give one of --prompt TEXT, --prompt_ids '[id, ...]' or --prompt_midi FILE.mid")
    if not music and args.prompt is None and args.prompt_ids is None and not is_music_model(args.model):
        raise ValueError("txl generate needs --model DIR and one of --prompt TEXT or --prompt_ids '[id, ...]'")
    max_new_tokens = args.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = 512 * args.bars if args.bars is not None else 100
    check_sampling(max_new_tokens, args.temperature, args.top_k, args.top_p)
    if args.num_beams < 1:
        raise ValueError(f"--num_beams = {args.num_beams}: must be >= 1 (1: no beam search)")
    if args.bars is not None and args.bars < 1:
        raise ValueError(f"--bars = {args.bars}: must be >= 1")
    prompt_score = check_music_files(args.midi, args.prompt_midi, args.piano_roll) if music else None
    if args.prompt_ids is not None and not args.prompt_ids:
        raise ValueError("--prompt_ids is empty: give at least one token id, e.g. '[1, 2, 3]'")
    if not MIN_SEED <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed = {args.seed}: {SEED_RANGE}")
    if args.mem_len is not None and args.mem_len < 1:
        raise ValueError(f"--mem_len = {args.mem_len}: must be >= 1 (generation carries a memory)")
    return music, prompt_score, max_new_tokens


def _encoded(args: GenerateArgs, loaded, tok) -> tuple[list[int], list[int]]:
    """The prompt's ids and the stop ids, each stop one token of the model's tokenizer."""
    folder, n_token = loaded.folder, loaded.model.config.n_token
    prompt_ids = args.prompt_ids
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer.json to encode --prompt; use --prompt_ids")
        prompt_ids = tok.encode(args.prompt)
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
    stops = [args.stop_ids] if isinstance(args.stop_ids, int) else list(args.stop_ids or [])
    for text in [args.stop] if isinstance(args.stop, str) else args.stop or []:
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer.json to encode --stop; use --stop_ids")
        hint = " (a line break is --stop $'\\n' in bash, or its id with --stop_ids)" if "\\n" in text else ""
        if text.lstrip().startswith("[") and len(text.strip()) > 1:  # (probes.md u36: a malformed list, as one text)
            raise ValueError(f'--stop {text!r}: not a list (a list is JSON, e.g. \'["a", "b"]\')')
        try:
            ids = tok.encode(text)
        except ValueError as e:
            raise ValueError(f"--stop {text!r}: {e}{hint}") from None
        if len(ids) != 1:
            raise ValueError(f"--stop {text!r} is {len(ids)} tokens for this tokenizer; a stop is one token{hint}")
        if ids[0] == tok.unk_id and text.strip() != tok.unk_token:  # (it would stop at any unknown word)
            raise ValueError(f"--stop {text!r} is not in the model's vocabulary (it reads as {tok.unk_token})")
        stops += ids
    if any(not 0 <= i < n_token for i in stops):
        raise ValueError(f"--stop_ids must be token ids in [0, {n_token})")
    return prompt_ids, stops


def _continuation(args: GenerateArgs, loaded, prompt_ids, stops, max_new_tokens, generator, dev):
    """The new tokens (an iterator: streamed as they are made, or a beam search's at the end) and whether they
    stream."""
    import torch

    from txl.infer.generation import Penalties
    from txl.infer.generation import stream as stream_tokens
    from txl.kernels import native

    lm, reading = loaded.model, loaded.settings
    if dev.type == "cpu" and lm.config.attn_type == 0 and native.missing():  # (2-3x slower without it)
        print(f"txl: note: {native.status()}", file=sys.stderr)
    _check_generate_memory(
        lm.config,
        reading.mem_len,
        args.num_beams,
        len(prompt_ids),
        max_new_tokens,
        args.zero_memory,
        dev,
        reading.same_length,
    )  # fmt: skip  (u31; how this run reads: --same_length false on a model trained with it reads the whole prompt)
    zeros = None
    if args.zero_memory:
        zeros = [torch.zeros(1, reading.mem_len, lm.config.d_model, device=dev)] * lm.config.n_layer
    penalties = Penalties(repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size)
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    if args.num_beams == 1:
        return stream_tokens(
            lm, prompt, max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            generator=generator, stop_tokens=stops, mems=zeros, penalties=penalties, reading=loaded.reading,
        ), args.stream  # fmt: skip
    if args.temperature != 0:
        raise ValueError("--num_beams > 1 searches for the likeliest text: give --temperature 0 (no sampling)")
    from txl.infer.generation import beam_search

    found = beam_search(
        lm, prompt, max_new_tokens, num_beams=args.num_beams, length_penalty=args.length_penalty,
        eos_token_ids=stops, mems=zeros, penalties=penalties, reading=loaded.reading,
    )  # fmt: skip
    return iter(found[0, len(prompt_ids) :, None]), False


def _emit(args: GenerateArgs, loaded, tok, prompt_ids, tokens, streamed: bool) -> None:
    """The text on stdout as it is made (or at the end, or as JSON), then how the model read on stderr."""
    from txl.infer.evaluate import describe_reading

    reading = loaded.settings
    if args.json or tok is None or not streamed:
        new = [int(t) for t in tokens]
        if not (args.json or tok is None):
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
    with logged_after():  # (a fast path's first-use line waits for the end of the text, never splits it)
        out.write("".join(decoder.push(i) for i in prompt_ids))
        out.flush()
        for t in tokens:
            out.write(decoder.push(int(t)))
            out.flush()
        out.write(decoder.flush() + "\n")
        out.flush()
    print(f"txl: read with {describe_reading(reading)}", file=sys.stderr)  # (after the text: errors stay one line)
