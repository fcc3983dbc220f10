"""``txl generate``."""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path
from typing import Literal

from txl.cli.common import (
    DEFAULT_GENERATE_THREADS,
    _check_generate_memory,
    _reading_dict,
    _set_threads,
    logged_after,
)
from txl.config import Quantization


def generate(
    model: Path | None = None,
    prompt: str | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int | None = None,
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
    quantize: Quantization = "none",
    unknown: Literal["error", "replace"] | None = None,
    midi: Path | None = None,
    prompt_midi: Path | None = None,
    bars: int | None = None,
    grammar: bool = True,
    piano_roll: Path | None = None,
) -> None:
    """Continue a prompt with a model, keeping the memory as cached keys and values; the text appears as it is made.

    Args:
        model: A run folder (its best checkpoint), a checkpoint step-N folder, or a model folder.
        prompt: Prompt text (encoded with the model's tokenizer.json).
        prompt_ids: Prompt token ids instead, e.g. 1,2,3 (prints ids as JSON when there is no tokenizer).
        max_new_tokens: Number of tokens to generate (>= 0; default 100; a music model with --bars: at most 512 per
            bar).
        temperature: Sampling temperature (>= 0; 0 = greedy).
        top_k: Keep only the k most likely tokens (0 = all).
        top_p: Nucleus sampling threshold in (0, 1] (1 = off); the most likely token is always kept.
        mem_len: Memory length at generation. The defaults of mem_len, clamp_len and same_length are the model's
            reading settings, as every command's: the run's eval section, else the model's config (printed on
            stderr after the text; in the JSON output with --json).
        clamp_len: Relative distances above this share one position embedding (-1: none).
        same_length: Every query attends to the same number of keys.
        seed: Random seed for sampling (64 bits: -2**63 to 2**63 - 1).
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
            replay (txl.infer.static_decode); a seed samples differently there than on the CPU (another generator).
        quantize: Generate with the model's Linear layers in int8 (CPU): int8 (PyTorch's dynamic quantization) or
            int8-weight-only (torchao's, needs the extra 'quant'); none: as saved.
        unknown: Characters outside the vocabulary in the prompt or a stop: error (one line naming the
            first) or replace (the tokenizer's replacement symbol); default: the tokenizer's.
        midi: Music models: write the piece (the prompt's notes, then the new ones) to this MIDI file.
        prompt_midi: Music models: continue this MIDI file (its notes as the tokenizer reads them: all tracks
            merged, on its grid); without it (and --prompt_ids) a piece starts from nothing.
        bars: Music models: stop after this many new bars (else after --max_new_tokens events).
        grammar: Music models: keep the piece valid REMI (event order, time forward in the bar, notes inside their
            bars), masking what the grammar rules out; false: sample freely and count the invalid events.
        piano_roll: Music models: also draw the piece as a piano roll with its bar lines (a PNG).
    """
    import torch

    from txl.config import MAX_SEED, MIN_SEED, SEED_RANGE
    from txl.infer.evaluate import describe_reading
    from txl.infer.generation import Penalties, check_sampling
    from txl.infer.generation import stream as stream_tokens
    from txl.infer.load import load
    from txl.kernels import native
    from txl.kernels.runtime import configure_allocator
    from txl.util.distributed import resolve_device

    music = midi is not None or prompt_midi is not None or bars is not None or piano_roll is not None
    if model is None:
        raise ValueError("txl generate needs --model DIR and one of --prompt TEXT or --prompt_ids '[id, ...]'")
    if sum(x is not None for x in (prompt, prompt_ids, prompt_midi)) > 1:
        raise ValueError("give one of --prompt TEXT, --prompt_ids '[id, ...]' or --prompt_midi FILE.mid")
    if not music and prompt is None and prompt_ids is None and not _is_music_model(model):
        raise ValueError("txl generate needs --model DIR and one of --prompt TEXT or --prompt_ids '[id, ...]'")
    if max_new_tokens is None:
        max_new_tokens = 512 * bars if bars is not None else 100
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if num_beams < 1:
        raise ValueError(f"--num_beams = {num_beams}: must be >= 1 (1: no beam search)")
    if bars is not None and bars < 1:
        raise ValueError(f"--bars = {bars}: must be >= 1")
    prompt_score = None
    if music:  # (the files are checked before the model is read: one line, nothing written)
        prompt_score = _check_music_files(midi, prompt_midi, piano_roll)
    if prompt_ids is not None and not prompt_ids:
        raise ValueError("--prompt_ids is empty: give at least one token id, e.g. '[1, 2, 3]'")
    if not MIN_SEED <= seed <= MAX_SEED:
        raise ValueError(f"--seed = {seed}: {SEED_RANGE}")
    penalties = Penalties(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size)
    if mem_len is not None and mem_len < 1:
        raise ValueError(f"--mem_len = {mem_len}: must be >= 1 (generation carries a memory)")
    _set_threads(DEFAULT_GENERATE_THREADS if threads is None else threads)
    dev = resolve_device(device, option="--device")
    if dev.type == "cpu":
        configure_allocator()
    loaded = load(model, dev, quantize, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length)
    lm, folder, reading, tok = loaded.model, loaded.folder, loaded.settings, loaded.tokenizer
    if reading.mem_len < 1:
        raise ValueError(f"{folder}: the model reads with no memory; give --mem_len >= 1 (generation carries one)")
    mem_len = reading.mem_len
    if tok is not None and unknown is not None:  # (probes.md d16: the error advised an option generate lacked)
        tok = tok.with_unknown(unknown)
    if music or _is_music_tokenizer(tok):
        if prompt is not None and tok is not None:
            tok.encode(prompt)  # (a music model: one line saying it reads MIDI)
        if num_beams > 1:
            raise ValueError("--num_beams: music is sampled (or greedy) event by event under its grammar; use 1")
        return _generate_music(
            loaded, prompt_ids, prompt_midi, prompt_score, midi, bars, grammar, piano_roll, max_new_tokens,
            temperature, top_k, top_p, torch.Generator(device=dev).manual_seed(seed), json, zero_memory, dev,
        )  # fmt: skip
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
    if any(not 0 <= i < lm.config.n_token for i in stops):
        raise ValueError(f"--stop_ids must be token ids in [0, {lm.config.n_token})")
    if dev.type == "cpu" and lm.config.attn_type == 0 and native.missing():  # (2-3x slower without it)
        print(f"txl: note: {native.status()}", file=sys.stderr)
    _check_generate_memory(
        lm.config, mem_len, num_beams, len(prompt_ids), max_new_tokens, zero_memory, dev, reading.same_length
    )  # (u31; how this run reads: --same_length false on a model trained with it reads the whole prompt)
    g = torch.Generator(device=dev).manual_seed(seed)
    zeros = [torch.zeros(1, mem_len, lm.config.d_model, device=dev)] * lm.config.n_layer if zero_memory else None
    prompt_tensor = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    if num_beams > 1:
        if temperature != 0:
            raise ValueError("--num_beams > 1 searches for the likeliest text: give --temperature 0 (no sampling)")
        from txl.infer.generation import beam_search

        found = beam_search(
            lm, prompt_tensor, max_new_tokens, num_beams=num_beams,
            length_penalty=length_penalty, eos_token_ids=stops, mem_len=mem_len, mems=zeros,
            penalties=penalties, reading=loaded.reading,
        )  # fmt: skip
        tokens = iter(found[0, len(prompt_ids) :, None])
        stream = False
    else:
        tokens = stream_tokens(
            lm, prompt_tensor, max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, mem_len=mem_len, generator=g, stop_tokens=stops, mems=zeros,
            penalties=penalties, reading=loaded.reading,
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
    with logged_after():  # (a fast path's first-use line waits for the end of the text, never splits it)
        out.write("".join(decoder.push(i) for i in prompt_ids))
        out.flush()
        for t in tokens:
            out.write(decoder.push(int(t)))
            out.flush()
        out.write(decoder.flush() + "\n")
        out.flush()
    print(f"txl: read with {describe_reading(reading)}", file=sys.stderr)  # (after the text: errors stay one line)


def _is_music_tokenizer(tok) -> bool:
    return getattr(tok, "kind", None) == "remi"


def _is_music_model(model: Path) -> bool:
    """Whether the folder's tokenizer.json is a music model's (MidiTok's), read without loading the model."""
    from txl.data.music import is_miditok_json
    from txl.util.folders import resolve_model_dir

    try:
        path = resolve_model_dir(Path(model)) / "tokenizer.json"
        return path.is_file() and is_miditok_json(_json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def _check_music_files(midi: Path | None, prompt_midi: Path | None, piano_roll: Path | None):
    """The output paths checked, and the prompt's ``symusic.Score`` read (None without --prompt_midi)."""
    from txl.data.music import read_midi

    if midi is not None:
        midi = Path(midi)
        if midi.is_dir():
            raise ValueError(f"--midi {midi}: a folder; give the MIDI file to write, e.g. {midi}/piece.mid")
        if not midi.parent.is_dir():
            raise ValueError(f"--midi {midi}: no folder {midi.parent} to write it in")
    if piano_roll is not None:
        from txl.util.plot import image_path

        image_path(piano_roll, "--piano_roll", "piano_roll.png")
    return read_midi(Path(prompt_midi), f"--prompt_midi {prompt_midi}") if prompt_midi is not None else None


def _generate_music(
    loaded, prompt_ids, prompt_midi, prompt_score, midi, bars, grammar, piano_roll, max_new_tokens, temperature,
    top_k, top_p, generator, as_json, zero_memory, dev,
) -> None:  # fmt: skip
    """``txl generate`` of a music model: a piece as MIDI (and a piano roll), its events on stdout."""
    import torch

    from txl.infer.music import compose, piece_score, roll
    from txl.util.fileio import write_bytes
    from txl.util.plot import image_path, plot_piano_roll

    lm, folder, tok = loaded.model, loaded.folder, loaded.tokenizer
    if not _is_music_tokenizer(tok):
        what = f"a {tok.kind}-level text model" if tok is not None else "a model without tokenizer.json"
        raise ValueError(
            f"{folder}: {what}; --midi, --prompt_midi, --bars and --piano_roll need a music model (one trained on "
            "MIDI files: data.dataset chorales, quartets or midi, with MidiTok's tokenizer.json)"
        )
    if prompt_midi is not None:
        ids = [tok.bos_id, *tok.encode_score(prompt_score, f"--prompt_midi {prompt_midi}")]
    elif prompt_ids is not None:
        ids = list(prompt_ids)
        if any(not 0 <= i < tok.vocab_size for i in ids):
            raise ValueError(f"--prompt_ids must be token ids in [0, {tok.vocab_size})")
    else:
        ids = [tok.bos_id]
    mem_len = loaded.settings.mem_len
    zeros = [torch.zeros(1, mem_len, lm.config.d_model, device=dev)] * lm.config.n_layer if zero_memory else None
    piece = compose(
        lm, tok, ids, bars=bars, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        grammar=grammar, generator=generator, reading=loaded.reading, mems=zeros,
    )  # fmt: skip
    summary = piece.summary()
    if prompt_midi is not None:  # (round 6: the prompt as read, said, not silently changed)
        summary["prompt_changes"] = tok.read_changes(prompt_score, ids[1:])
        if summary["prompt_changes"]:
            print(f"txl: note: --prompt_midi {prompt_midi} as the model reads it (and as the MIDI written holds it): "
                  + "; ".join(summary["prompt_changes"]), file=sys.stderr)  # fmt: skip
    score = piece_score(tok, piece.ids, prompt_score)
    if midi is not None:
        write_bytes(Path(midi), bytes(score.dumps_midi()))
        summary["midi"] = str(midi)
        summary["notes"] = int(score.note_num())
    if piano_roll is not None:
        data = roll(score)
        prompt_end = roll(tok.decode_score(piece.ids[: piece.prompt_len]))["end"] if piece.prompt_len > 1 else None
        out = plot_piano_roll(
            data["notes"], data["bars"], image_path(piano_roll, "--piano_roll", "piano_roll.png"),
            f"{folder.name}: {summary['bars']} new bars, {summary['new_events']} events", prompt_end,
        )  # fmt: skip
        summary["piano_roll"] = str(out)
    if as_json:
        print(_json.dumps({"prompt_ids": ids, "new_ids": piece.new_ids, **summary}))
    else:
        print(tok.decode(piece.new_ids))
    print(f"txl: {_json.dumps(summary)}", file=sys.stderr)
