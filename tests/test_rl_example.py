"""The PPO example (examples/rl/ppo_gtrxl.py) through its command line: the same seed gives the same curve, bad
arguments get one line, and (slow) GTrXL uses its memory: it beats the MLP on a task that needs one."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("popgym")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "rl" / "ppo_gtrxl.py"
TINY = ["--num-envs", "4", "--rollout", "32", "--window", "16", "--mem-len", "8", "--d-model", "16", "--n-head", "2"]


def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--out", str(out)], capture_output=True, text=True, timeout=600
    )


def curve(out: Path) -> list[tuple[str, str]]:
    with open(out / "curve.csv") as f:
        return [(r[0], r[2]) for r in csv.reader(f)]  # (env steps, mean return): wall-clock differs


@pytest.mark.parametrize("memory", ["gtrxl", "gru"])
def test_the_same_seed_gives_the_same_curve(tmp_path, memory):
    args = [*TINY, "--memory", memory, "--steps", "512", "--env", "repeat_previous"]
    a, b, c = (run(tmp_path / n, *args, "--seed", s) for n, s in (("a", "3"), ("b", "3"), ("c", "4")))
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    assert curve(tmp_path / "a") == curve(tmp_path / "b")
    assert curve(tmp_path / "a") != curve(tmp_path / "c")
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["env_steps"] == 512 and summary["args"]["seed"] == 3


def test_bad_arguments_get_one_line(tmp_path):
    bad = run(tmp_path / "x", "--env", "pong")
    assert bad.returncode == 2 and "--env must be one of repeat_first, repeat_previous" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = run(tmp_path / "y", "--rollout", "100", "--window", "32")
    assert bad.returncode == 2 and "--rollout (100) must be a multiple of --window (32)" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_gtrxl_uses_its_memory(tmp_path):
    """PositionOnlyCartPole (positions only: velocities need memory): GTrXL beats the MLP clearly in 150k steps."""
    finals = {}
    for memory in ("gtrxl", "mlp"):
        r = run(tmp_path / memory, "--env", "position_only_cartpole", "--memory", memory, "--steps", "150000")
        assert r.returncode == 0, r.stderr
        finals[memory] = json.loads((tmp_path / memory / "summary.json").read_text())["final_mean_return"]
    assert finals["gtrxl"] > finals["mlp"] + 0.2, finals
