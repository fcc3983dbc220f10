"""A music model trained with txl (issue 67) used by a MidiTok + transformers user: `TransfoXLLMHeadModel` reads the
run folder (txl's format), MidiTok reads its tokenizer.json as its own, and transformers' `generate` continues a
MIDI file's tokens; the log-probabilities are txl's."""

from __future__ import annotations

import random

import pytest
import torch

miditok = pytest.importorskip("miditok")
symusic = pytest.importorskip("symusic")
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

import txl.hf  # noqa: E402, F401
from txl.cli import main  # noqa: E402
from txl.hf import TransfoXLConfig, TransfoXLLMHeadModel  # noqa: E402
from txl.model.modeling import TransformerXLConfig, TransformerXLLM  # noqa: E402
from txl.train.checkpoint import resolve_model_dir  # noqa: E402


def midi(path, seed: int, bars: int = 6) -> None:
    rng = random.Random(seed)
    score = symusic.Score(480)
    score.time_signatures.append(symusic.TimeSignature(0, 4, 4))
    track = symusic.Track("piano", 0, False)
    for t in range(0, bars * 1920, 240):
        track.notes.append(symusic.Note(t, 240 * rng.choice([1, 2]), 60 + rng.randrange(12), 90))
    score.tracks.append(track)
    path.parent.mkdir(parents=True, exist_ok=True)
    score.dump_midi(str(path))


def test_a_music_run_loads_in_transformers_with_its_miditok_tokenizer(tmp_path):
    for i in range(12):
        midi(tmp_path / "songs" / ("test" if i == 0 else "valid" if i == 1 else "train") / f"s{i}.mid", i)
    main(["train", "--config", "configs/debug.yaml", "--data.dataset", "midi", "--data.path", str(tmp_path / "songs"),
          "--data.cache_dir", str(tmp_path / "cache"), "--run_dir", str(tmp_path / "run"), "--train.max_steps", "4",
          "--train.eval_interval", "0"])  # fmt: skip
    folder = resolve_model_dir(tmp_path / "run")
    model = TransfoXLLMHeadModel.from_pretrained(tmp_path / "run")  # (the run folder: its best checkpoint)
    assert model.config.mem_init == "empty" and model.config.vocab_size == 335
    assert model.name_or_path == str(folder)  # (the checkpoint's folder: its tokenizer.json)
    tokenizer = miditok.REMI.from_pretrained(model.name_or_path)  # MidiTok's own file
    ids = tokenizer.encode(symusic.Score(str(tmp_path / "songs" / "test" / "s0.mid")))[0].ids
    x = torch.tensor([[tokenizer["BOS_None"], *ids[:40]]])
    txl_model = TransformerXLLM.from_pretrained(folder).eval()
    with torch.no_grad():
        scores = model(x).prediction_scores
        ours = txl_model(x, return_log_probs=True).log_probs
        loss_hf, loss_txl = model(x, labels=x).loss, txl_model(x, labels=x).loss
    assert scores.shape == (1, x.shape[1], 335)
    torch.testing.assert_close(scores, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_hf, loss_txl, atol=1e-5, rtol=1e-5)
    out = model.generate(x, max_new_tokens=24, do_sample=True, top_k=10)
    assert out.shape == (1, x.shape[1] + 24) and torch.equal(out[:, : x.shape[1]], x)
    back = tokenizer.decode([miditok.TokSequence(ids=[int(i) for i in out[0, 1:]])])
    prompt = tokenizer.decode([miditok.TokSequence(ids=[int(i) for i in x[0, 1:]])])
    assert back.note_num() >= prompt.note_num() > 0  # (the prompt's notes at least)
    model.save_pretrained(tmp_path / "hf")  # then transformers' own Auto classes read it
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")) is TransfoXLLMHeadModel


def test_what_transformers_cannot_describe_is_refused():
    with pytest.raises(ValueError, match="gate"):
        TransfoXLConfig.from_txl(TransformerXLConfig(n_token=50, gate="gru"))
