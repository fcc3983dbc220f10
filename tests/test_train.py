"""The trainer: exact resume (in-process, SIGTERM, SIGKILL, killed while writing a checkpoint), the NaN guard,
gradient accumulation, checkpoints and retention, precision, the train/eval/generate/plot commands."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from train_helpers import (
    DEBUG,
    ROOT,
    assert_same_weights,
    final_weights,
    losses,
    run_inprocess,
    tiny_corpus,
    train_args,
    txl_process,
)
from txl.cli import main
from txl.config import TrainConfig, load_recipe
from txl.train.checkpoint import MARKER, list_checkpoints, load_states, read_metadata
from txl.train.optim import lr_at
from txl.train.trainer import Trainer, TrainingError

# Dropout and attention dropout on (the debug preset), memory on, an evaluation and checkpoints in between.
EXACT = dict(train__log_interval=1, train__eval_interval=4, train__checkpoint_interval=3, train__max_steps=12)
TOKENS_PER_STEP = 4 * 16  # debug preset: batch 4 x tgt_len 16


# -- exact resume --------------------------------------------------------------------------------------------


def test_exact_resume_in_process_and_memory_sensitivity(tmp_path, monkeypatch):
    ref = run_inprocess(tmp_path, "ref", **EXACT)
    assert [s for s, _ in losses(ref)] == list(range(1, 13))

    part = run_inprocess(tmp_path, "part", **EXACT, train__max_tokens=5 * TOKENS_PER_STEP)
    assert list_checkpoints(part)[-1][0] == 5  # stopped by max_tokens after step 5, and saved
    run_inprocess(tmp_path, "part", **EXACT)  # --resume auto
    assert losses(part) == losses(ref)  # bit-identical, every step
    periodic = [r for r in losses(part, "valid") if r[0] % 4 == 0]  # (plus one when it stopped at step 5)
    assert periodic == losses(ref, "valid") and [s for s, _ in losses(part, "valid")] == [4, 5, 8, 12]
    assert_same_weights(final_weights(part), final_weights(ref))

    # The same interruption with the memories left out of the checkpoint must be caught by the comparison above.
    original = Trainer._state

    def without_mems(self):
        state = original(self)
        state["mems"] = [None] * len(state["mems"])
        return state

    monkeypatch.setattr(Trainer, "_state", without_mems)
    broken = run_inprocess(tmp_path, "broken", **EXACT, train__max_tokens=5 * TOKENS_PER_STEP)
    monkeypatch.setattr(Trainer, "_state", original)
    run_inprocess(tmp_path, "broken", **EXACT)
    assert losses(broken)[:5] == losses(ref)[:5]
    assert losses(broken)[5] != losses(ref)[5]  # step 6 sees an empty memory instead of steps 5's


def test_a_run_alone_resumes_with_its_recorded_settings(tmp_path, capsys, monkeypatch):
    """`txl train --resume RUN` (or a step-N folder of it), or `txl train --run_dir RUN`, without the recipe: the
    run goes on with the settings its checkpoint recorded (data, model, schedule, seed), in its own folder, with the
    options given on top; bit-identical to an uninterrupted run."""
    monkeypatch.chdir(tmp_path)  # where the default run folder would land if the record were not used
    threads = torch.get_num_threads()
    ref = run_inprocess(tmp_path, "ref", **EXACT)
    cases = {
        "a": ["--resume", str(tmp_path / "a")],
        "b": ["--run_dir", str(tmp_path / "b")],
        "c": ["--resume", str(tmp_path / "c" / "checkpoints" / "step-5")],
    }
    try:
        for run, args in cases.items():
            part = run_inprocess(tmp_path, run, **EXACT, train__max_tokens=5 * TOKENS_PER_STEP)
            capsys.readouterr()
            main(["train", *args, "--train.max_tokens", "null"])  # the recorded max_tokens would stop it again
            out = capsys.readouterr().out
            assert f"continuing from {part / 'checkpoints' / 'step-5'} with the settings recorded" in out
            assert "learning-rate schedule changed" not in out  # (max_tokens is not part of it)
            assert losses(part) == losses(ref), run
            assert_same_weights(final_weights(part), final_weights(ref))
        assert not (tmp_path / "runs").exists()
        steps, last = list_checkpoints(tmp_path / "a")[-1]
        recorded = TrainConfig(**json.loads((last / "run.json").read_text())["train"])
        longer = dataclasses.replace(recorded, max_steps=2 * steps)  # more steps: the cosine is planned anew
        main(["train", "--resume", str(tmp_path / "a"), "--train.max_steps", str(2 * steps)])
        now, then = lr_at(steps + 1, longer), lr_at(steps + 1, recorded)
        changed = f"(max_steps {steps} -> {2 * steps}): step {steps + 1} gets lr {now:.3g}"
        note = f"schedule changed {changed} where the checkpoint's run would have used {then:.3g}"
        assert now != then and note in capsys.readouterr().out
        main(["train", "--resume", str(tmp_path / "a"), "--print_config"])  # the recorded settings, as YAML alone
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["run_dir"] == str(tmp_path / "a") and printed["data"]["path"] == str(tmp_path / "corpus")
        loose = tmp_path / "loose"
        shutil.copytree(list_checkpoints(tmp_path / "a")[-1][1], loose)
        with pytest.raises(SystemExit) as e:
            main(["train", "--resume", str(loose)])
        assert e.value.code == 2 and "not inside a run folder" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_a_damaged_latest_checkpoint_names_the_one_before_and_going_back_supersedes_it(tmp_path, capsys, monkeypatch):
    """A latest checkpoint with a damaged file: the error names it and the complete checkpoint before it; resuming
    from that one (as the hint says) moves the later checkpoints aside, kept, to RUN/superseded/ (--resume auto,
    retention and the best choice no longer see them) and goes on bit-identical to an uninterrupted run."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    ref = run_inprocess(tmp_path, "ref", **EXACT)
    run = run_inprocess(tmp_path, "run", **EXACT)
    (before, latest) = (path for _, path in list_checkpoints(run)[-2:])
    (latest / "model.safetensors").write_bytes(b"\0" * 100)
    try:
        with pytest.raises(SystemExit) as e:
            main(["train", "--run_dir", str(run)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{latest / 'model.safetensors'}: not a readable safetensors file" in err
        assert err.rstrip().endswith(f"to continue from the checkpoint before it: --resume {before}")
        main(["train", "--resume", str(before)])  # the hint, as given
        out = capsys.readouterr().out
        assert f"the later checkpoints of this run ({latest.name}) were moved to {run / 'superseded'}" in out
        assert (run / "superseded" / latest.name / "model.safetensors").read_bytes() == b"\0" * 100  # kept
        assert list_checkpoints(run)[-1][1] == latest and losses(run) == losses(ref)
        assert_same_weights(final_weights(run), final_weights(ref))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def process_reference(tmp_path_factory):
    """An uninterrupted 300-step run in its own process (the comparison for the interrupted ones)."""
    tmp = tmp_path_factory.mktemp("proc")
    args = train_args(tmp, "ref", **PROC)
    assert txl_process(args, stdout=subprocess.DEVNULL).wait(timeout=300) == 0
    return tmp


PROC = dict(
    train__log_interval=1,
    train__eval_interval=50,
    train__checkpoint_interval=10,
    train__max_steps=300,
    train__keep_last=3,
)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.time() < end, f"{path} did not appear"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_exact_resume_after_signal(process_reference, sig):
    tmp = process_reference
    run = tmp / f"sig{int(sig)}"
    proc = txl_process(train_args(tmp, run.name, **PROC), stdout=subprocess.DEVNULL)
    _wait_for(run / "checkpoints" / "step-20" / MARKER, proc)
    while losses(run)[-1][0] % 10 not in (3, 4, 5, 6):  # mid-way between two checkpoints
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.002)
    proc.send_signal(sig)
    code = proc.wait(timeout=120)
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        assert losses(run)[-1][0] > list_checkpoints(run)[-1][0]  # rows the resumed run must drop
    else:  # SIGTERM: finishes the step, saves, exits cleanly
        assert code == 0
        assert list_checkpoints(run)[-1][0] == losses(run)[-1][0] < 300
    stopped_at = list_checkpoints(run)[-1][0]
    assert stopped_at < 300
    assert txl_process(train_args(tmp, run.name, **PROC), stdout=subprocess.DEVNULL).wait(timeout=300) == 0
    ref = tmp / "ref"
    assert losses(run) == losses(ref)
    assert [r for r in losses(run, "valid") if r[0] % 50 == 0] == losses(ref, "valid")
    assert_same_weights(final_weights(run), final_weights(ref))


KILL_DURING_SAVE = """
import os, signal, sys
import txl.train.checkpoint as ck
original = ck._write_marker
def write_marker(folder, step):
    if step == 40:  # everything of step-40 is written except the marker: die here
        os.kill(os.getpid(), signal.SIGKILL)
    original(folder, step)
ck._write_marker = write_marker
from txl.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_exact_resume_after_kill_while_writing_a_checkpoint(process_reference):
    tmp = process_reference
    run = tmp / "torn"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = train_args(tmp, run.name, **PROC)
    code = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, *args], env=env, stdout=subprocess.DEVNULL
    ).returncode
    assert code == -signal.SIGKILL
    partial = run / "checkpoints" / ".step-40.partial"
    assert (partial / "model.safetensors").exists() and not (partial / MARKER).exists()
    assert [s for s, _ in list_checkpoints(run)] == [10, 20, 30]  # the torn one does not count
    assert txl_process(args, stdout=subprocess.DEVNULL).wait(timeout=300) == 0
    assert not partial.exists()  # cleaned up by the next save
    ref = tmp / "ref"
    assert losses(run) == losses(ref)
    assert_same_weights(final_weights(run), final_weights(ref))


# -- guards ---------------------------------------------------------------------------------------------------


def _trainer(tmp_path, **train) -> Trainer:
    corpus = tiny_corpus(tmp_path / "corpus")
    overrides = {
        "data": {"path": str(corpus), "cache_dir": str(tmp_path / "cache")},
        "train": {"log_interval": 1, "eval_interval": 0, "checkpoint_interval": 1, **train},
        "run_dir": str(tmp_path / "run"),
    }
    return Trainer(load_recipe(DEBUG, overrides), resume="none")


@pytest.mark.parametrize("where", ["gradient", "loss"])
def test_nan_guard_stops_before_the_update(tmp_path, where):
    trainer = _trainer(tmp_path, max_steps=10)
    calls = {"n": 0}
    if where == "gradient":
        weight = trainer.model.transformer.layers[0].ff.layer_1.weight

        def poison(grad):
            calls["n"] += 1
            return grad * math.nan if calls["n"] == 3 else grad

        weight.register_hook(poison)
    else:

        def poison(module, args, out):
            calls["n"] += 1
            return (out[0] * math.nan, out[1]) if calls["n"] == 3 else out

        trainer.model.crit.register_forward_hook(poison)
    what = "gradient norm" if where == "gradient" else "training loss"
    with pytest.raises(TrainingError, match=rf"non-finite {what} \(nan\) at step 3 .*weights were not updated"):
        trainer.fit()
    after_two = load_file(str(tmp_path / "run" / "checkpoints" / "step-2" / "model.safetensors"))
    now = {k: v for k, v in trainer.model.state_dict().items() if k in after_two}
    assert_same_weights(now, after_two)
    for state in trainer.optimizer.state.values():
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_cli_reports_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEBUG.read_text().replace("  mem_len: 16\n", "  mem_len: 16\n  memory_length: 3\n"))
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(bad)])
    assert e.value.code == 2 and "memory_length" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(train_args(tmp_path, train__precision="fp16", train__device="cpu"))
    assert e.value.code == 2 and "'fp16' needs CUDA" in capsys.readouterr().err


def test_a_recipe_fits_a_smaller_vocabulary(tmp_path, capsys):
    """The recipe's adaptive softmax on a text with fewer tokens: n_token becomes the vocabulary's size and the
    cutoffs past its end go (with their tie_projs entries), said once; the run resumes with the same model."""
    run = run_inprocess(tmp_path, model__cutoffs="20,60,100", model__div_val=2, train__max_steps=3)
    out = capsys.readouterr().out
    cfg = json.loads((list_checkpoints(run)[-1][1] / "config.json").read_text())
    assert 20 < cfg["n_token"] < 60  # the tiny corpus's characters
    assert cfg["cutoffs"] == [20] and cfg["tie_projs"] == [False, True] and cfg["div_val"] == 2
    assert "model.cutoffs = [20] (the clusters from 60, 100 on lie past the vocabulary's end" in out
    # one's own text (here the folder "corpus", read with the debug preset's Shakespeare rules) is named as such
    assert "preparing corpus from" in out and "corpus: vocabulary" in out and "(the vocabulary of corpus;" in out
    assert "shakespeare" not in out
    run_inprocess(tmp_path, model__cutoffs="20,60,100", model__div_val=2, train__max_steps=5)
    assert "resumed from" in capsys.readouterr().out and list_checkpoints(run)[-1][0] == 5


def test_resume_guards(tmp_path, capsys):
    run_inprocess(tmp_path, train__max_steps=3)
    with pytest.raises(SystemExit) as e:  # starting fresh over a run with checkpoints would lose it
        main(train_args(tmp_path, resume="none", train__max_steps=3))
    assert e.value.code == 2 and "already has checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(train_args(tmp_path, model__d_model=48, train__max_steps=6))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "d_model: checkpoint 32, config 48" in err


# -- gradient accumulation and precision ----------------------------------------------------------------------

NO_DROPOUT = dict(model__dropout=0.0, model__dropatt=0.0, train__log_interval=1, train__eval_interval=0)


def test_grad_accumulation_two_chunks_equals_one(tmp_path):
    one = run_inprocess(tmp_path, "one", **NO_DROPOUT, train__max_steps=6)
    two = run_inprocess(tmp_path, "two", **NO_DROPOUT, train__max_steps=6, train__batch_chunk=2)
    for (s1, l1), (s2, l2) in zip(losses(one), losses(two), strict=True):
        assert s1 == s2 and abs(l1 - l2) < 1e-6
    w1, w2 = final_weights(one), final_weights(two)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=2e-6, rtol=1e-5)
    state = load_states(list_checkpoints(two)[-1][1])[0]
    assert len(state["mems"]) == 2 and state["mems"][0][0].shape == (2, 16, 32)  # own memory per chunk
    assert not torch.equal(state["mems"][0][0], state["mems"][1][0])


def test_bf16_autocast_trains_close_to_fp32_or_falls_back(tmp_path):
    from txl.kernels.runtime import native_bf16

    fp32 = run_inprocess(tmp_path, "fp32", **NO_DROPOUT, train__max_steps=4)
    bf16 = run_inprocess(tmp_path, "bf16", **NO_DROPOUT, train__max_steps=4, train__precision="bf16")
    a, b = [x for _, x in losses(fp32)], [x for _, x in losses(bf16)]
    log = (bf16 / "train.log").read_text()
    if native_bf16(torch.device("cpu")):
        assert a != b  # autocast really ran in bf16
        assert all(math.isfinite(x) for x in b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.05
    else:  # emulated bf16 is 20x slower than fp32: the run says so and trains in fp32
        assert "no native bf16" in log and "so fp32 runs" in log and "(cpu, fp32)" in log
        assert a == b


# -- checkpoints, logging, schedules -------------------------------------------------------------------------


def test_checkpoint_layout_retention_and_metrics(tmp_path):
    run = run_inprocess(
        tmp_path,
        train__max_steps=12,
        train__checkpoint_interval=2,
        train__eval_interval=3,
        train__keep_last=2,
        train__log_interval=2,
    )
    ckpts = list_checkpoints(run)
    meta = read_metadata(ckpts[-1][1])
    expected = {10, 12} | {meta["best_step"]}
    assert {s for s, _ in ckpts} == expected
    for _, folder in ckpts:
        names = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json", "run.json", MARKER} <= names
        assert "train_state-rank0.pt" in names
    state = torch.load(ckpts[-1][1] / "train_state-rank0.pt", weights_only=True)  # no pickle needed
    assert {"optimizer", "scaler", "rng", "iterator", "mems"} <= state.keys()
    assert "scheduler" not in state  # the learning rate is a pure function of the step: nothing to save
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8, 10, 12]
    assert {"step", "tokens", "loss", "bpc", "lr", "grad_norm", "tokens_per_s"} <= train_rows[0].keys()
    assert train_rows[-1]["tokens"] == 12 * TOKENS_PER_STEP
    assert train_rows[0]["bpc"] == pytest.approx(train_rows[0]["loss"] / math.log(2))
    assert [r["step"] for r in rows if r["split"] == "valid"] == [3, 6, 9, 12]
    assert (run / "config.yaml").exists() and "mem_len: 16" in (run / "config.yaml").read_text()


def test_learning_rate_schedules():
    cos = TrainConfig(lr=1.0, warmup_steps=10, max_steps=110, eta_min=0.1)
    assert lr_at(5, cos) == pytest.approx(0.5)  # linear warm-up
    assert lr_at(110, cos) == pytest.approx(0.1)  # eta_min at the end
    assert lr_at(55, cos) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 0.5)) / 2)
    inv = TrainConfig(lr=1.0, scheduler="inv_sqrt", warmup_steps=100)
    assert lr_at(100, inv) == pytest.approx(0.1) and lr_at(400, inv) == pytest.approx(0.05)
    assert lr_at(50, inv) == pytest.approx(50 / 100**1.5)
    const = TrainConfig(lr=0.3, scheduler="constant", warmup_steps=4)
    assert lr_at(2, const) == pytest.approx(0.15) and lr_at(1000, const) == 0.3


# -- eval, generate, plot ------------------------------------------------------------------------------------


def _reference_eval(run: Path, tgt_len: int, mem_len: int, batch: int, same_length: bool) -> float:
    """The evaluation protocol written out: batchify the test ids, read segments, carry the memory."""
    from txl.data import DataConfig, prepare_corpus
    from txl.model.modeling import TransformerXLLM

    cfg = json.loads((list_checkpoints(run)[-1][1] / "run.json").read_text())
    ids = torch.from_numpy(prepare_corpus(DataConfig(**cfg["data"])).splits["test"].astype("int64"))
    model = TransformerXLLM.from_pretrained(read_best(run))
    n = len(ids) // batch
    cols = ids[: n * batch].view(batch, n)
    total, count, mems = 0.0, 0, None
    with torch.no_grad():
        for i in range(0, n - 1, tgt_len):
            j = min(i + tgt_len, n - 1)
            out = model(cols[:, i:j], cols[:, i + 1 : j + 1], mems=mems, mem_len=mem_len, same_length=same_length)
            mems = out.mems
            total += out.losses.double().sum().item()
            count += out.losses.numel()
    return total / count


def read_best(run: Path) -> Path:
    from txl.train.checkpoint import best_checkpoint

    return best_checkpoint(run)


def test_eval_cli_prints_settings_and_matches_the_protocol(tmp_path, capsys):
    run = run_inprocess(tmp_path, train__max_steps=60, train__lr=0.01)  # learns enough for the memory to matter
    capsys.readouterr()
    main(["eval", "--model", str(run), "--mem_len", "32", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["tgt_len"] == 16 and got["mem_len"] == 32 and got["same_length"] is True  # eval section + flag
    assert got["batch_size"] == 2 and got["split"] == "test" and got["clamp_len"] == -1
    assert got["loss"] == pytest.approx(_reference_eval(run, 16, 32, 2, True), rel=1e-6)
    assert got["bpc"] == pytest.approx(got["loss"] / math.log(2))
    main(["eval", "--model", str(run), "--mem_len", "0", "--same_length", "false", "--tgt_len", "8"])
    line = capsys.readouterr().out
    assert "tgt_len 8, mem_len 0, clamp_len -1, same_length False, batch 2" in line
    no_mem = float(line.split("loss ")[1].split()[0])
    assert no_mem == pytest.approx(_reference_eval(run, 8, 0, 2, False), abs=1e-4)
    assert abs(no_mem - got["loss"]) > 1e-3  # the settings really reach the model
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(tmp_path / "nope")])
    assert "not found" in capsys.readouterr().err


def test_generate_text_and_plot(tmp_path, capsys):
    run = run_inprocess(tmp_path, train__max_steps=4)
    capsys.readouterr()
    records = []
    for seed in (1, 1, 2):
        args = ["generate", "--model", str(run), "--prompt", "Ab", "--max_new_tokens", "30", "--seed", str(seed)]
        main([*args, "--json"])
        records.append(json.loads(capsys.readouterr().out))
        main(args)
        assert capsys.readouterr().out == "Ab" + records[-1]["text"] + "\n"  # prompt + continuation
    assert all(len(r["new_ids"]) == 30 and len(r["text"]) == 30 for r in records)
    assert records[0] == records[1] != records[2]  # the seed decides the sample
    from txl import Tokenizer, TransformerXLLM
    from txl.infer.generation import generate
    from txl.train.checkpoint import resolve_model_dir

    lm, tok = TransformerXLLM.from_pretrained(run), Tokenizer.from_pretrained(run)  # the library takes a run folder
    prompt = torch.tensor([tok.encode("Ab")])
    greedy = generate(lm, prompt, 12, temperature=0)
    best = TransformerXLLM.from_pretrained(resolve_model_dir(run))  # (its best checkpoint, as txl generate)
    assert torch.equal(greedy, generate(best, prompt, 12, temperature=0))
    main(["generate", "--model", str(run), "--prompt", "Ab", "--max_new_tokens", "12", "--temperature", "0", "--json"])
    assert json.loads(capsys.readouterr().out)["new_ids"] == greedy[0, 2:].tolist()
    main(["plot", str(run)])
    png = Path(capsys.readouterr().out.strip())
    assert png == run / "loss.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from txl.util.plot import run_figure

    assert [ax.get_ylabel() for ax in run_figure(run).axes] == ["loss (nats/token)", "bpc"]
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert "no metrics" in capsys.readouterr().err


def test_progress_bar_only_on_a_terminal(tmp_path, capsys):
    from txl.util.metrics import Reporter

    quiet = Reporter(tmp_path, enabled=True, progress=None, tensorboard=False, total=10)  # pytest: not a TTY
    assert quiet.bar is None
    quiet.close()
    shown = Reporter(tmp_path, enabled=True, progress=True, tensorboard=False, total=10)
    shown.advance(3, loss="1.0")
    assert shown.bar is not None and shown.bar.n == 3
    shown.close()
    assert "3/10" in capsys.readouterr().err
    off = Reporter(tmp_path / "nowhere", enabled=False, progress=True, tensorboard=False, total=10)  # rank > 0
    off.say("x")
    off.row({"step": 1})
    assert off.bar is None and not (tmp_path / "nowhere").exists()


def test_every_checkpoint_file_is_written_durably(tmp_path, monkeypatch):
    """One helper writes every file: the content is fsynced, renamed into place, then the folder is fsynced (so a
    power cut leaves the old file or the whole new one); files get the ordinary mode the umask gives."""
    events = []
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename")}

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real["fsync"](fd)

    def mover(name):
        def move(src, dst, **kw):
            events.append((name, str(src), str(dst)))
            return real[name](src, dst, **kw)

        return move

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", mover("replace"))
    monkeypatch.setattr(os, "rename", mover("rename"))
    run = run_inprocess(tmp_path, train__max_steps=2, train__checkpoint_interval=2, train__eval_interval=0)
    monkeypatch.undo()
    partial = str(run / "checkpoints" / ".step-2.partial")
    files = {"model.safetensors", "config.json", "tokenizer.json", "run.json", "metadata.json"}
    files |= {"train_state-rank0.pt", MARKER}
    for name in files:
        dest = f"{partial}/{name}"
        (i, (_, src, _)), *more = [(i, e) for i, e in enumerate(events) if e[0] == "replace" and e[2] == dest]
        assert not more and src.startswith(partial + "/.")  # written beside, as a hidden temporary file
        assert ("fsync", src) in events[:i], f"{name} renamed before its content was synced"
        assert ("fsync", partial) in events[i + 1 :], f"the folder of {name} was not synced after the rename"
    i = events.index(("rename", partial, str(run / "checkpoints" / "step-2")))
    assert ("fsync", str(run / "checkpoints")) in events[i + 1 :]
    umask = os.umask(0)
    os.umask(umask)
    for name in files:
        assert (run / "checkpoints" / "step-2" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_autocast_validates_the_precision():
    from txl.infer.evaluate import autocast, evaluate

    cpu = torch.device("cpu")
    for bad in ("fp8", "bf-16", "FP32"):  # a typo once ran fp16 autocast on the CPU
        with pytest.raises(ValueError, match=f"precision {bad!r} is not one of fp32, bf16, fp16"):
            autocast(cpu, bad)
    with pytest.raises(ValueError, match="fp16 needs CUDA"):
        autocast(cpu, "fp16")
    model = torch.nn.Linear(1, 1)  # never reached: the precision is checked before any work
    with pytest.raises(ValueError, match="precision 'fp8'"):
        evaluate(model, torch.zeros(100).numpy(), batch_size=2, tgt_len=4, mem_len=0, precision="fp8")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN: no route to choose")
def test_a_resumed_run_keeps_the_fp32_route_of_its_checkpoint(tmp_path, monkeypatch):
    """Checkpoints record the fp32 GEMM route (txl.kernels.runtime) and `txl train --resume` keeps it rather than
    measuring
    again: the two paths round differently (losses differ in the 6th digit at bench-char size), and the speed check
    is noisy enough to choose differently from one process to the next."""
    from txl.kernels import runtime

    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        run = run_inprocess(tmp_path, "r", **EXACT, train__max_tokens=5 * TOKENS_PER_STEP)
        meta_file = list_checkpoints(run)[-1][1] / "metadata.json"
        meta = json.loads(meta_file.read_text())
        assert isinstance(meta["fp32_route"], bool)
        for recorded in (not meta["fp32_route"], meta["fp32_route"]):  # as if the interrupted run had chosen so
            meta_file.write_text(json.dumps({**meta, "fp32_route": recorded}))
            with monkeypatch.context() as m:
                m.setattr(runtime, "paired", lambda *a, **k: pytest.fail("the route was measured again"))
                exact = runtime.choose_fp32_matmul(measure=False).exact
                run_inprocess(tmp_path, "r", **{**EXACT, "train__max_steps": 6})
            assert read_metadata(list_checkpoints(run)[-1][1])["fp32_route"] == (recorded and exact)
            for folder in [p for s, p in list_checkpoints(run) if s == 6]:  # resume from step 5 again
                shutil.rmtree(folder)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
