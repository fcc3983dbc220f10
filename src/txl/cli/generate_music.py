"""``txl generate`` of a music model (MidiTok's REMI): a piece continued under its grammar, written as MIDI (and a
piano roll), its events on stdout. The model, its tokenizer and how it reads come from :func:`txl.infer.load.load`,
as for text."""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path


def is_music_tokenizer(tok) -> bool:
    """Whether ``tok`` is a music model's (MidiTok's REMI)."""
    return getattr(tok, "kind", None) == "remi"


def is_music_model(model: Path) -> bool:
    """Whether the folder's tokenizer.json is a music model's (MidiTok's), read without loading the model."""
    from txl.data.music import is_miditok_json
    from txl.util.folders import resolve_model_dir

    try:
        path = resolve_model_dir(Path(model)) / "tokenizer.json"
        return path.is_file() and is_miditok_json(_json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def check_music_files(midi: Path | None, prompt_midi: Path | None, piano_roll: Path | None):
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


def generate_music(loaded, args, prompt_score, max_new_tokens: int, generator, dev) -> None:
    """``txl generate`` of a music model: a piece as MIDI (and a piano roll), its events on stdout."""
    import torch

    from txl.infer.music import compose, piece_score, roll
    from txl.util.fileio import write_bytes
    from txl.util.plot import image_path, plot_piano_roll

    lm, folder, tok = loaded.model, loaded.folder, loaded.tokenizer
    if not is_music_tokenizer(tok):
        what = f"a {tok.kind}-level text model" if tok is not None else "a model without tokenizer.json"
        raise ValueError(
            f"{folder}: {what}; --midi, --prompt_midi, --bars and --piano_roll need a music model (one trained on "
            "MIDI files: data.dataset chorales, quartets or midi, with MidiTok's tokenizer.json)"
        )
    midi, prompt_midi, piano_roll = args.midi, args.prompt_midi, args.piano_roll
    if prompt_midi is not None:
        ids = [tok.bos_id, *tok.encode_score(prompt_score, f"--prompt_midi {prompt_midi}")]
    elif args.prompt_ids is not None:
        ids = list(args.prompt_ids)
        if any(not 0 <= i < tok.vocab_size for i in ids):
            raise ValueError(f"--prompt_ids must be token ids in [0, {tok.vocab_size})")
    else:
        ids = [tok.bos_id]
    mem_len = loaded.settings.mem_len
    zeros = [torch.zeros(1, mem_len, lm.config.d_model, device=dev)] * lm.config.n_layer if args.zero_memory else None
    piece = compose(
        lm, tok, ids, bars=args.bars, max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, grammar=args.grammar, generator=generator, reading=loaded.reading, mems=zeros,
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
    if args.json:
        print(_json.dumps({"prompt_ids": ids, "new_ids": piece.new_ids, **summary}))
    else:
        print(tok.decode(piece.new_ids))
    print(f"txl: {_json.dumps(summary)}", file=sys.stderr)
