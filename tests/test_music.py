"""Music (issue 67): MIDI in, REMI tokens (MidiTok), a Transformer-XL, MIDI out, through the user's commands.

Pieces are made here with symusic (several tracks, time signatures, notes on and off the grid); the corpus that
`txl data get chorales` renders from music21's wheel is checked whole in the slow test. What is checked:

* the round trip MIDI -> tokens -> MIDI keeps every note (pitch, onset and duration on the tokenizer's grid),
  against this file's own quantization, not MidiTok's;
* REMI's grammar (txl.data.remi_grammar): real pieces have no error, anything it allows MidiTok's own check
  (``tokens_errors``) allows too, and a piece sampled under it re-encodes to the same events (its notes are inside
  their bars);
* `txl data prepare` / `txl train` / `txl generate --midi --bars --piano_roll` on a folder of MIDI files;
  `--prompt_midi` keeps the prompt's notes unchanged;
* every bad input is one line: not MIDI, an empty MIDI, an unsupported time signature, a text model asked for MIDI.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("miditok", reason="the music extra (miditok, symusic) is not installed")
import symusic  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_cli_errors import fails  # noqa: E402
from train_helpers import DEBUG, run_inprocess  # noqa: E402
from txl.cli import main  # noqa: E402
from txl.data import DataError, prepare_corpus  # noqa: E402
from txl.data.music import MusicConfig, MusicTokenizer, merge_tracks, read_midi  # noqa: E402
from txl.data.remi_grammar import Grammar, State  # noqa: E402
from txl.infer.music import compose  # noqa: E402
from txl.model.modeling import TransformerXLConfig, TransformerXLLM  # noqa: E402

TPQ = 480


def piece(rng: random.Random, bars: int = 8, ts: tuple[int, int] = (4, 4), voices: int = 3, grid: bool = True):
    """A symusic Score: ``voices`` tracks of notes, onsets on the 1/8-beat grid (or anywhere), a time signature."""
    score = symusic.Score(TPQ)
    score.time_signatures.append(symusic.TimeSignature(0, *ts))
    score.tempos.append(symusic.Tempo(0, 96.0))
    beat = TPQ * 4 // ts[1]
    bar = ts[0] * beat
    for v in range(voices):
        track = symusic.Track(f"voice {v}", 0, False)
        t = rng.randrange(0, beat, beat // 2) if v else 0
        while t < bars * bar:
            dur = rng.choice([beat // 2, beat, beat + beat // 2, 2 * beat])
            pitch = 48 + 12 * v + rng.randrange(0, 12)
            onset = t if grid else t + rng.randrange(0, TPQ // 8)
            track.notes.append(symusic.Note(onset, dur, pitch, 90))
            t += dur
        score.tracks.append(track)
    return score


def write(score, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    score.dump_midi(str(path))
    return path


@pytest.fixture(scope="module")
def tok() -> MusicTokenizer:
    return MusicTokenizer.from_config(MusicConfig())


@pytest.fixture(scope="module")
def midi_folder(tmp_path_factory) -> Path:
    """A folder of 24 pieces in 4/4, 3/4 and 6/8, split by subfolders."""
    root = tmp_path_factory.mktemp("midi")
    rng = random.Random(0)
    for i in range(24):
        split = "test" if i % 8 == 0 else "valid" if i % 8 == 1 else "train"
        ts = [(4, 4), (3, 4), (6, 8)][i % 3]
        write(piece(rng, bars=6, ts=ts), root / split / f"piece{i:02d}.mid")
    return root


def midi_tok_errors(tok: MusicTokenizer, ids: list[int]) -> int:
    """MidiTok's own count of grammar errors (``tokens_errors``' rule) of the events of ``ids``."""
    return tok.remi._tokens_errors([e for e in tok.events(ids) if e not in ("BOS_None", "EOS_None")])


def quarters(score) -> set[tuple[int, float, float]]:
    tpq = score.ticks_per_quarter
    return {(n.pitch, n.time / tpq, n.duration / tpq) for t in score.tracks for n in t.notes}


# ------------------------------------------------------------------------------------------------ round trip
def grid_notes(score, tok: MusicTokenizer) -> dict[tuple[int, float], float]:
    """This file's own reading of ``score`` on the tokenizer's grid: {(pitch, onset): duration} in quarter notes.

    MidiTok's beat is the time signature's denominator's note, with ``max_num_pos_per_beat`` positions; onsets go to
    the nearest position, durations to the nearest duration the tokenizer writes (in beats), capped at its longest.
    A pitch struck twice at one onset (two voices in unison) is one note there: MidiTok keeps the shorter."""
    cfg = tok.remi.config
    per_beat = cfg.max_num_pos_per_beat
    durations = sorted({b + p / r for b, p, r in tok.remi.durations})  # (beats, positions, resolution)
    tpq = score.ticks_per_quarter
    sigs = sorted((ts.time, ts.denominator) for ts in score.time_signatures) or [(0, 4)]
    out: dict[tuple[int, float], float] = {}
    for note in merge_tracks(score).tracks[0].notes:
        den = [d for t, d in sigs if t <= note.time][-1] if sigs[0][0] <= note.time else sigs[0][1]
        quarter_per_beat = 4 / den
        onset_beats = math.floor(note.time / tpq / quarter_per_beat * per_beat + 0.5) / per_beat  # (halves up)
        dur_beats = min(durations, key=lambda d: abs(d - note.duration / tpq / quarter_per_beat))
        key = (note.pitch, onset_beats * quarter_per_beat)
        out[key] = min(out.get(key, math.inf), dur_beats * quarter_per_beat)
    return out


def assert_round_trip(tok: MusicTokenizer, score, where: str) -> None:
    ids = tok.encode_score(score, where)
    back = tok.decode_score(ids)
    want = grid_notes(score, tok)
    got = {(p, o): d for p, o, d in quarters(back)}
    assert set(got) == set(want), f"{where}: notes differ: {sorted(set(got) ^ set(want))[:5]}"
    wrong = [(k, want[k], got[k]) for k in want if abs(want[k] - got[k]) > 1e-6]
    assert not wrong, f"{where}: durations differ: {wrong[:5]}"


@pytest.mark.parametrize("ts", [(4, 4), (3, 4), (2, 2), (6, 8), (12, 8)])
@pytest.mark.parametrize("grid", [True, False])
def test_round_trip_keeps_every_note_on_the_grid(tok, ts, grid):
    rng = random.Random(hash((ts, grid)) & 0xFFFF)
    for k in range(3):
        assert_round_trip(tok, piece(rng, bars=5, ts=ts, voices=4, grid=grid), f"piece {ts} {grid} {k}")


@pytest.mark.slow
def test_round_trip_of_every_chorale(tmp_path, tok):
    """`txl data get chorales` (music21's wheel rendered to MIDI) and the round trip of all 410 files."""
    pytest.importorskip("music21")
    main(["data", "get", "chorales", "--out", str(tmp_path / "chorales")])
    files = sorted((tmp_path / "chorales").rglob("*.mid"))
    assert len(files) == 410
    import music21

    from txl.data.music_sources import MUSIC21_VERSION, MUSIC_SHA256, listing_sha256

    if music21.__version__ == MUSIC21_VERSION:  # (the pinned version renders the recorded bytes)
        written = json.loads((tmp_path / "chorales" / ".txl-data.json").read_text())["files"]
        assert listing_sha256({k: v["sha256"] for k, v in written.items()}) == MUSIC_SHA256["chorales"]
    for f in files:
        assert_round_trip(tok, read_midi(f), str(f))
    grammar = Grammar(tok, allow_end=True)
    for f in files:
        assert grammar.errors([tok.bos_id, *tok.encode_midi(f), tok.eos_id])[0] == 0, f


def test_a_saved_tokenizer_is_midi_toks_own_file(tmp_path, tok):
    import miditok

    path = tok.save(tmp_path / "tokenizer.json")
    again = miditok.REMI(params=path)  # (a MidiTok user reads the same file)
    assert again.vocab == tok.remi.vocab
    from txl.data import Tokenizer

    loaded = Tokenizer.load(path)
    assert isinstance(loaded, MusicTokenizer) and loaded.vocab_size == tok.vocab_size
    assert b"pickle" not in path.read_bytes().lower()


# ------------------------------------------------------------------------------------------------ grammar
def test_real_pieces_have_no_grammar_error(tok, midi_folder):
    grammar = Grammar(tok, allow_end=True)
    for f in sorted(midi_folder.rglob("*.mid")):
        ids = [tok.bos_id, *tok.encode_midi(f), tok.eos_id]
        assert grammar.errors(ids) == (0, len(ids)), f


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_what_the_grammar_allows_midi_tok_allows(tok, data):
    """A sequence with no error by our rules has none by MidiTok's ``tokens_errors`` (ours are stricter)."""
    grammar = Grammar(tok)
    state, ids = State(), [tok.bos_id]
    state, _ = grammar.advance(state, tok.bos_id)
    for _ in range(data.draw(st.integers(1, 120))):
        allowed = grammar.mask(state).nonzero()[0]
        i = int(data.draw(st.sampled_from(list(allowed))))
        state, bad = grammar.advance(state, i)
        assert bad == 0
        ids.append(i)
    assert midi_tok_errors(tok, ids) == 0


def test_random_sequences_are_counted_as_midi_tok_counts_at_least(tok):
    """Random events (almost never valid): our count is never below MidiTok's, event for event."""
    rng = random.Random(1)
    grammar = Grammar(tok)
    theirs_seen = 0
    for _ in range(200):
        ids = [rng.randrange(4, tok.vocab_size) for _ in range(rng.randint(2, 60))]
        ours, _ = grammar.errors([tok.bos_id, tok.remi["Bar_None"], *ids])
        theirs = midi_tok_errors(tok, [tok.remi["Bar_None"], *ids])
        theirs_seen += theirs > 0
        assert ours >= theirs
        if ours == 0:
            assert theirs == 0
    assert theirs_seen > 100  # (the comparison was made on sequences MidiTok finds wrong)


@pytest.fixture(scope="module")
def music_model(tmp_path_factory, tok) -> Path:
    """A music model folder (random weights, MidiTok's tokenizer.json): what generation reads."""
    folder = tmp_path_factory.mktemp("music_model")
    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=tok.vocab_size, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64)
    cfg = TransformerXLConfig.from_dict({**cfg.to_dict(), "mem_len": 32})
    TransformerXLLM(cfg).save_pretrained(folder)
    tok.save(folder / "tokenizer.json")
    return folder


def test_an_unconstrained_sampler_is_counted_and_a_constrained_one_is_valid(tok, music_model):
    lm = TransformerXLLM.from_pretrained(music_model)
    free = compose(lm, tok, [tok.bos_id], max_new_tokens=200, grammar=False, generator=torch.Generator().manual_seed(0))
    bad, _ = Grammar(tok, allow_end=True).errors(free.ids)
    assert free.invalid_events == bad > 0  # (random weights break the grammar often)
    kept = compose(lm, tok, [tok.bos_id], bars=3, max_new_tokens=2000, generator=torch.Generator().manual_seed(0))
    assert kept.invalid_events == 0 and kept.bars == 3
    assert Grammar(tok).errors(kept.ids) == (0, len(kept.ids))
    assert midi_tok_errors(tok, kept.ids) == 0
    assert 0 < sum(kept.invalid_mass) / len(kept.invalid_mass) < 1


# ------------------------------------------------------------------------------------------------ the commands
def events_without_trailing_bars(tok: MusicTokenizer, ids: list[int]) -> list[str]:
    """The events of ``ids`` but BOS / EOS, without the empty bars at the end (a MIDI file does not keep them)."""
    ev = [e for e in tok.events(ids) if e not in ("BOS_None", "EOS_None")]
    while ev and ev[-1].split("_")[0] in ("Bar", "TimeSig"):
        ev.pop()
    return ev


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_generate_writes_valid_midi_whose_notes_are_inside_their_bars(tmp_path, tok, music_model, capsys, seed):
    out, png = tmp_path / "piece.mid", tmp_path / "roll.png"
    main(["generate", "--model", str(music_model), "--midi", str(out), "--bars", "4", "--piano_roll", str(png),
          "--json", "true", "--seed", str(seed)])  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert record["bars"] == 4 and record["invalid_events"] == 0
    score = symusic.Score.from_midi(out.read_bytes())  # (symusic parses it)
    assert score.note_num() == record["notes"] > 0
    # the file says what was sampled: read back, it is the same events (a note past its bar would move to the next,
    # a pitch struck while it sounds would shorten the note before it)
    again = tok.encode_score(score, str(out))
    assert events_without_trailing_bars(tok, again) == events_without_trailing_bars(tok, record["new_ids"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_midi_notes_stay_unchanged(tmp_path, tok, music_model, capsys):
    prompt = write(piece(random.Random(5), bars=3, ts=(3, 4), voices=2), tmp_path / "mine.mid")
    out = tmp_path / "continued.mid"
    main(["generate", "--model", str(music_model), "--prompt_midi", str(prompt), "--midi", str(out),
          "--bars", "2", "--json", "true"])  # fmt: skip
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["prompt_ids"] == [tok.bos_id, *tok.encode_midi(prompt)]
    # round 6: how the prompt was read is said (2 voices merged, velocity 90 set to a level), on stderr and in JSON
    assert record["prompt_changes"][0] == "its 2 tracks merged into one piano track"
    assert f"txl: note: --prompt_midi {prompt} as the model reads it" in captured.err
    given = quarters(read_midi(prompt))  # (on the grid already: the tokenizer reads it exactly)
    written = quarters(read_midi(out))
    assert given <= written and len(written) > len(given)
    first = min(o for _, o, _ in written - given)
    assert first >= max(o for _, o, _ in given)  # (new notes come after the prompt's)
    score = read_midi(out)
    assert score.tempos[0].qpm == pytest.approx(96.0, abs=0.01)


def test_train_and_generate_on_a_folder_of_midi(tmp_path, midi_folder, capsys):
    run = tmp_path / "run"
    main(["train", "--config", str(DEBUG), "--data.dataset", "midi", "--data.path", str(midi_folder),
          "--data.cache_dir", str(tmp_path / "cache"), "--run_dir", str(run), "--train.max_steps", "6",
          "--train.eval_interval", "0"])  # fmt: skip
    tok = MusicTokenizer.load(next(run.rglob("tokenizer.json")))
    out = tmp_path / "new.mid"
    capsys.readouterr()
    main(["generate", "--model", str(run), "--midi", str(out), "--max_new_tokens", "60"])
    assert read_midi(out).note_num() > 0
    assert capsys.readouterr().out.split()[0] in tok.remi.vocab
    main(["eval", "--model", str(run), "--json", "true"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tokens"] > 0
    # a MIDI folder (its test split) or one file read as the training corpus reads them: the same numbers
    main(["eval", "--model", str(run), "--json", "true", "--data", str(midi_folder)])
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["loss"] == pytest.approx(record["loss"], abs=1e-6) and again["tokens"] == record["tokens"]
    one = sorted((midi_folder / "test").glob("*.mid"))[0]
    main(["eval", "--model", str(run), "--json", "true", "--data", str(one), "--batch_size", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == len(tok.encode_midi(one)) + 1


def test_bpe_is_learned_on_the_train_split_and_read_back(tmp_path, midi_folder):
    corpus = prepare_corpus(
        dataset="midi", path=str(midi_folder), cache_dir=str(tmp_path / "c"), music=MusicConfig(bpe_vocab_size=400)
    )
    tok = corpus.tokenizer
    assert tok.vocab_size == 400 and tok.remi.is_trained
    ids = [int(i) for i in corpus.splits["test"]]
    assert len(ids) < sum(len(tok.base_tokens(i)) for i in ids)  # (merged events)
    assert Grammar(tok, allow_end=True).errors(ids)[0] == 0
    f = sorted((midi_folder / "test").glob("*.mid"))[0]
    assert_round_trip(tok, read_midi(f), str(f))


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_midi_files_are_one_line(tmp_path, tok, music_model, capsys):
    text = tmp_path / "notes.mid"
    text.write_text("not music\n")
    empty = tmp_path / "empty.mid"
    empty.write_bytes(b"")
    silent = write(symusic.Score(TPQ), tmp_path / "silent.mid")
    odd = piece(random.Random(0), bars=2, ts=(5, 8))
    odd_path = write(odd, tmp_path / "five_eight.mid")
    base = ["generate", "--model", str(music_model), "--midi", str(tmp_path / "o.mid")]
    assert "not a MIDI file" in fails(capsys, [*base, "--prompt_midi", str(text)])
    assert "not a MIDI file (empty" in fails(capsys, [*base, "--prompt_midi", str(empty)])
    assert "has no notes" in fails(capsys, [*base, "--prompt_midi", str(silent)])
    line = fails(capsys, [*base, "--prompt_midi", str(odd_path)])
    assert "time signature 5/8" in line and "data.music.time_signatures" in line
    assert "reads MIDI, not text" in fails(capsys, ["generate", "--model", str(music_model), "--prompt", "hello"])
    # round 6 (mu-dir, mu-devzero): a folder or a device is not "no such file"
    assert f"{tmp_path}: a folder; give a MIDI file" in fails(capsys, [*base, "--prompt_midi", str(tmp_path)])
    assert "/dev/zero: not a regular file" in fails(capsys, [*base, "--prompt_midi", "/dev/zero"])
    assert not (tmp_path / "o.mid").exists()


def test_a_text_model_asked_for_midi_is_one_line(tmp_path, capsys):
    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    line = fails(capsys, ["generate", "--model", str(run), "--midi", str(tmp_path / "x.mid")])
    assert "text model" in line and "need a music model" in line
    assert not (tmp_path / "x.mid").exists()


def test_a_bad_file_in_a_midi_folder_is_named(tmp_path, midi_folder, capsys):
    import shutil

    folder = tmp_path / "songs"
    shutil.copytree(midi_folder, folder)
    (folder / "train" / "broken.mid").write_bytes(b"MThd\x00\x00\x00\x06garbage")
    (folder / "train" / "words.mid").write_text("not music")  # (round 6: every bad file is named, not the first)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["data", "prepare", "--data.dataset", "midi", "--data.path", str(folder),
              "--data.cache_dir", str(tmp_path / "c")])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and [x[:9] for x in lines] == ["preparing", "checking ", "txl: erro"], lines
    assert "broken.mid: not a readable MIDI file" in lines[-1] and "words.mid: not a MIDI file" in lines[-1]
    assert "2 of " in lines[-1] and "MIDI files cannot be used" in lines[-1]
    assert not (tmp_path / "c").exists()  # (checked before anything was written)
    with pytest.raises(DataError, match="no MIDI files"):
        (tmp_path / "none").mkdir()
        prepare_corpus(dataset="midi", path=str(tmp_path / "none"), cache_dir=str(tmp_path / "d"))


# ------------------------------------------------------------------------------------------------ txl serve
def test_serve_continues_a_midi_prompt_and_returns_midi(tmp_path, tok, music_model):
    import base64

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from serve_helpers import error_of
    from txl.serve.app import ServeLimits, create_app

    prompt = write(piece(random.Random(7), bars=2, ts=(4, 4), voices=2), tmp_path / "p.mid")
    body = {"midi": base64.b64encode(prompt.read_bytes()).decode(), "bars": 2, "seed": 4}
    with TestClient(create_app(music_model, ServeLimits(max_new_tokens=1500, max_prompt_tokens=400))) as client:
        res = client.post("/v1/music", json=body)
        assert res.status_code == 200, res.text
        out = res.json()
        assert out["bars"] == 2 and out["invalid_events"] == 0 and out["seed"] == 4
        changes = out["prompt_changes"]  # (round 6: a continuation says how it read the prompt: 2 voices, velocity 90)
        assert changes[0] == "its 2 tracks merged into one piano track" and "velocities set to its" in changes[-1]
        score = symusic.Score.from_midi(base64.b64decode(out["midi"]))
        assert quarters(read_midi(prompt)) <= quarters(score)  # (the prompt's notes unchanged)
        assert len(out["notes"]) == score.note_num() and len(out["prompt_notes"]) == read_midi(prompt).note_num()
        assert client.post("/v1/music", json=body).json()["new_ids"] == out["new_ids"]  # (the seed decides)
        fresh = client.post("/v1/music", json={"bars": 1, "seed": 1}).json()
        assert fresh["bars"] == 1 and fresh["prompt_tokens"] == 1
        bad = {"midi": base64.b64encode(b"hello").decode()}
        assert "not a MIDI file" in error_of(client.post("/v1/music", json=bad))
        assert "not base64" in error_of(client.post("/v1/music", json={"midi": "@@@"}))
        assert "limit" in error_of(client.post("/v1/music", json={"max_new_tokens": 5000}))
        # round 6, vm15/vm16: text to a music model is a 400 naming what to send, not a 500 with a traceback
        for path, text in (("/v1/generate", {"prompt": "ROMEO", "max_new_tokens": 5}),
                           ("/v1/completions", {"prompt": "ROMEO", "max_tokens": 5})):  # fmt: skip
            res = client.post(path, json=text)
            assert res.status_code == 400 and "reads music (REMI events), not text" in error_of(res), res.text
        # round 6: a time signature the tokenizer does not write: what an API client can do, not "prepare the data"
        odd = write(piece(random.Random(7), bars=2, ts=(7, 8), voices=1), tmp_path / "odd.mid")
        res = client.post("/v1/music", json={"midi": base64.b64encode(odd.read_bytes()).decode()})
        assert res.status_code == 400 and "time signature 7/8" in error_of(res), res.text
        assert "send a piece in one of those" in error_of(res) and "prepare the data" not in error_of(res)
        assert client.get("/health").json()["status"] == "ok"


def test_serve_refuses_music_from_a_text_model(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from serve_helpers import error_of
    from txl.serve.app import ServeLimits, create_app

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    with TestClient(create_app(run, ServeLimits())) as client:
        assert "reads text, not music" in error_of(client.post("/v1/music", json={"bars": 1}))


@pytest.mark.slow
def test_the_page_composes_and_plays_music_in_a_real_browser(tmp_path, music_model):
    """Headless Chromium: a music model's page shows Compose (not the text panels), continues an uploaded MIDI file,
    draws it, and Play schedules every note with Web Audio; no console errors."""
    pytest.importorskip("fastapi")
    pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from serve_helpers import page_in_chromium

    prompt = write(piece(random.Random(9), bars=2, voices=2), tmp_path / "mine.mid")
    autoplay = ("--autoplay-policy=no-user-gesture-required",)
    with page_in_chromium(music_model, "--max_new_tokens", "2000", browser_args=autoplay) as (browser, url):
        browser.get(url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: b.find_element(By.ID, "music").is_displayed(), "the Compose panel")
        assert not browser.find_element(By.ID, "generate").is_displayed()  # (a music model: no text panels)
        browser.find_element(By.ID, "midi-file").send_keys(str(prompt))
        browser.execute_script("document.getElementById('bars').value = '2';")
        browser.find_element(By.ID, "compose").click()
        wait.until(lambda b: "new bars" in b.find_element(By.ID, "music-stats").text, "the piece")
        assert "2 new bars" in browser.find_element(By.ID, "music-stats").text
        composed = browser.execute_script("return window.txlMusic.composed")
        assert composed > read_midi(prompt).note_num()
        browser.find_element(By.ID, "play").click()
        wait.until(lambda b: b.execute_script("return window.txlMusic.scheduled") == composed, "every note played")
        drawn = browser.execute_script(
            "const c = document.getElementById('roll'); const d = c.getContext('2d').getImageData(0, 0, c.width, "
            "c.height).data; let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n;"
        )
        assert drawn > 500  # (the piano roll has its notes)
        assert browser.find_element(By.ID, "download").get_attribute("href").startswith("blob:")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors


@pytest.mark.slow
def test_the_music_experiment_quick_mode_writes_its_tables(tmp_path):
    """experiments/music.py end to end on small folders of pieces (as chorales/ and quartets/)."""
    import re
    import subprocess
    import sys

    from train_helpers import ROOT

    rng = random.Random(3)
    for corpus, n, bars in (("chorales", 30, 4), ("quartets", 12, 12)):
        for i in range(n):
            split = "test" if i % 6 == 0 else "valid" if i % 6 == 1 else "train"
            write(piece(rng, bars=bars, ts=[(4, 4), (3, 4)][i % 2]), tmp_path / "data" / corpus / split / f"{i}.mid")
    out = tmp_path / "music.md"
    cmd = [sys.executable, str(ROOT / "experiments" / "music.py"), "--budget", "quick"]
    cmd += ["--data", str(tmp_path / "data"), "--runs", str(tmp_path / "runs"), "--write", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    for row in ("xl", "xl-norec", "vanilla", "lstm"):
        assert re.search(rf"^\| {row} \(\d seeds?\) \| [\d,]+ \| \d+\.\d{{4}}", text, re.M), row
    assert re.search(r"^\| xl \| \d+\.\d{4} \| \d+\.\d{4} \| \d+\.\d{4} \|$", text, re.M)  # the sweep
    assert re.search(r"^\| generated \| ", text, re.M) and re.search(r"^\| real \(test\) \| ", text, re.M)
    assert "Reading: on the chorales the test NLL orders" in text
