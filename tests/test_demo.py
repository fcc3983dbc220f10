"""`make demo` (python -m txl.demo), the quick start's first command, on the project's corpus: the corpus found and
verified instead of downloaded, a short training run, test bpc with the training memory and with 4x longer memory,
500 sampled characters, the loss plot; run again, it continues the finished run instead of training anew."""

import re
import shutil
from pathlib import Path

import pytest

from txl import demo

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare"
EVAL = re.compile(r"^test: loss [\d.]+ \| bpc ([\d.]+) \| tgt_len 64, mem_len (\d+),", re.M)


@pytest.mark.slow
def test_make_demo_trains_evaluates_samples_and_plots_then_continues(tmp_path, monkeypatch, capsys):
    if not (SHARED / "test.txt").is_file():
        pytest.skip("needs ../shared/data/shakespeare (the project's corpus)")
    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path / "cache"))  # (the encoded corpus goes there)
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    for split in ("train", "valid", "test"):
        shutil.copy(SHARED / f"{split}.txt", data / f"{split}.txt")
    argv = ["--data", str(data), "--run_dir", str(run), "--max_steps", "3", "--budget", "300"]
    demo.main(argv)
    out, err = capsys.readouterr()
    assert "Shakespeare already there (sha256 verified)" in err  # (no download: the corpus is the verified one)
    for step in ("1/5 data", "2/5 train", "3/5 test bpc", "4/5 sample", "5/5 loss curves", "Where things are"):
        assert step in out
    assert "stopped at step 3 (max_steps 3)" in out
    evals = [(float(bpc), int(mem)) for bpc, mem in EVAL.findall(out)]
    assert [mem for _, mem in evals] == [64, 256], out  # the recipe's eval memory, then 4x longer
    assert all(5.5 < bpc < 7.5 for bpc, _ in evals)  # 3 steps from random: near log2(84) = 6.4 bits
    sample = out.split("== 4/5 sample")[1].split("== 5/5")[0].split("==\n", 1)[1]
    assert sample.startswith("ROMEO:") and len(sample.rstrip("\n")) >= 500 + len("ROMEO:")
    assert (run / "loss.png").stat().st_size > 0
    steps = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-3"]
    demo.main(argv)  # again: the finished run is evaluated and sampled again, not trained further
    again = capsys.readouterr().out
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == steps
    assert [(float(bpc), int(mem)) for bpc, mem in EVAL.findall(again)] == evals
    assert again.split("== 4/5 sample")[1].split("== 5/5")[0].split("==\n", 1)[1] == sample  # (seed 0)


def test_the_demo_says_when_its_time_budget_ended_training_and_a_rerun_gets_a_new_budget(tmp_path):
    """On a busy machine the demo's budget, not the recipe's steps, ended training (bpc 2.72 instead of 2.33) and
    nothing said so; a rerun stopped at once (the budget counts the run's whole training time). Now the demo says
    at which step of how many it stopped, and a rerun trains for another budget."""
    from train_helpers import run_inprocess
    from txl.train.checkpoint import resolve_model_dir

    cut = run_inprocess(tmp_path, "cut", train__max_steps=100_000, train__max_time=1, train__eval_interval=0)
    note = demo.budget_note(resolve_model_dir(cut), 1)
    assert note is not None and "the 1-s budget ended training at step" in note and "of the recipe's 100,000" in note
    assert 1.0 <= demo.trained_for(cut) < 30
    done = run_inprocess(tmp_path, "done", train__max_steps=2, train__eval_interval=0)
    assert demo.budget_note(resolve_model_dir(done), 600) is None
    assert demo.trained_for(tmp_path / "new") == 0.0
