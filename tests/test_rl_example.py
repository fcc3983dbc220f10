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


@pytest.mark.parametrize("memory", ["gtrxl", pytest.param("gru", marks=pytest.mark.slow)])
def test_the_same_seed_gives_the_same_curve(tmp_path, memory):
    args = [*TINY, "--memory", memory, "--steps", "512", "--env", "repeat_previous"]
    a, b, c = (run(tmp_path / n, *args, "--seed", s) for n, s in (("a", "3"), ("b", "3"), ("c", "4")))
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    assert curve(tmp_path / "a") == curve(tmp_path / "b")
    assert curve(tmp_path / "a") != curve(tmp_path / "c")
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["env_steps"] == 512 and summary["args"]["seed"] == 3


@pytest.mark.parametrize("env", ["repeat_first", "count_recall", "autoencode", "position_only_cartpole"])
def test_every_environment_the_docs_list_runs(tmp_path, env):
    """Round 6: `--env autoencode`, listed in docs/agents.md, stopped at once (a Tuple observation space). Every
    POPGym task the docs list trains a few steps (repeat_previous and MiniGrid's: the tests above)."""
    r = run(tmp_path / env, *TINY, "--memory", "gtrxl", "--steps", "256", "--env", env)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / env / "summary.json").read_text())
    assert summary["args"]["env"] == env and summary["env_steps"] == 256


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


def test_minigrid_memory_view_and_a_seeded_run(tmp_path):
    """MiniGrid's Memory task through the example: the symbolic view one-hot encoded (each of the 7 x 7 cells' object,
    colour and state one of its own), MiniGrid's own view and its first three actions, and a seeded run repeats."""
    pytest.importorskip("minigrid")
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import ppo_gtrxl
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    from minigrid.core.constants import OBJECT_TO_IDX

    env = ppo_gtrxl.make_env("minigrid_memory_s7")()
    obs, _ = env.reset(seed=5)
    assert env.action_space.n == 3 and obs.shape == (147,)
    x = ppo_gtrxl.encode(obs[None], env.observation_space)  # [1, 49 * (11 + 6 + 3)]
    assert x.shape == (1, ppo_gtrxl.one_hot_space(env.observation_space)) == (1, 980)
    cells = x.reshape(49, 20)
    assert cells.sum().item() == 147 and (cells[:, :11].sum(1) == 1).all() and (cells[:, 11:17].sum(1) == 1).all()
    for action in (0, 0, 2):  # (turn left twice: facing the start room, then forward)
        obs, *_ = env.step(action)
        assert (obs == env.unwrapped.gen_obs()["image"].reshape(-1)).all()  # MiniGrid's own view, as it is
    assert int(env.unwrapped.agent_dir) == 2  # (facing left: the three actions are MiniGrid's first three)
    assert OBJECT_TO_IDX["wall"] in set(obs.reshape(49, 3)[:, 0].tolist())
    args = [*TINY, "--memory", "gtrxl", "--steps", "256", "--env", "minigrid_memory_s7", "--seed", "2"]
    a, b = run(tmp_path / "a", *args), run(tmp_path / "b", *args)
    assert a.returncode == b.returncode == 0, a.stderr
    assert curve(tmp_path / "a") == curve(tmp_path / "b")
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["params"] > 0
