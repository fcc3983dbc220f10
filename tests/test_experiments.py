"""The experiment scripts run end to end, through the `txl` command, on a tiny corpus (slow: they train)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from train_helpers import ROOT, tiny_corpus


@pytest.mark.slow
def test_recurrence_experiment_writes_its_tables(tmp_path):
    corpus = tiny_corpus(tmp_path / "corpus")
    out = tmp_path / "paper.md"
    cmd = [sys.executable, str(ROOT / "experiments" / "recurrence.py"), "--steps", "6", "--tokens", "600"]
    cmd += ["--data", str(corpus), "--runs", str(tmp_path / "runs"), "--cache_dir", str(tmp_path / "cache")]
    cmd += ["--mem", "0,32,64", "--contexts", "16,32,48", "--write", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    assert text.startswith("# The paper's experiments with txl")
    rows = {m: re.search(rf"^\| {m} \|(.*)\|$", text, re.M) for m in ("xl", "no-recurrence")}
    for m, row in rows.items():
        values = [float(v) for v in row.group(1).split("|")]
        assert len(values) == 3 and all(0 < v < 10 for v in values), m  # bpc at memory 0, 32 and 64
    assert re.search(r"sliding_window 64`, one prediction per window, no memory\): \d+\.\d{4} bpc", text)
    for m in ("xl", "no-recurrence"):  # RECL at three ratios (whole numbers: context lengths)
        assert re.search(rf"^\| {m} \| \d+\+? \| \d+\+? \| \d+\+? \|$", text, re.M), m
    assert "Reading: the best bpc over the sweep is" in text
    for png in ("xl_sweep.png", "no-recurrence_sweep.png", "recl.png"):
        assert (tmp_path / "img" / f"recurrence_{png}").stat().st_size > 1000
    for name in ("xl_sweep.png", "no-recurrence_sweep.png", "recl.png", "recl.json"):
        assert (tmp_path / "runs" / name).stat().st_size > 100
