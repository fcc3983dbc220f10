"""Data-parallel training with torchrun (gloo, 2 processes on the CPU): the same losses as one process with the
same global batch, and exact resume of a 2-process run (also continued by 1 process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from train_helpers import ROOT, assert_same_weights, final_weights, losses, train_args
from txl.train.checkpoint import list_checkpoints, load_states
from txl.util.metrics import read_metrics

pytestmark = pytest.mark.slow  # torchrun processes (make test-all and CI run them)

SETTINGS = dict(
    model__dropout=0.0,
    model__dropatt=0.0,
    train__log_interval=1,
    train__eval_interval=4,
    train__checkpoint_interval=4,
    train__max_steps=8,
    train__eval_max_steps=10,
)


def _launch(args: list[str], nproc: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "txl", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += ["-m", "txl", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _close(a: list[tuple[int, float]], b: list[tuple[int, float]], tol: float) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) <= tol


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    settings = SETTINGS
    _launch(train_args(tmp, "single", **settings), 1)
    _launch(train_args(tmp, "ddp", **settings), 2)
    return tmp, settings


def test_two_processes_equal_one(runs):
    tmp, _ = runs
    _close(losses(tmp / "ddp"), losses(tmp / "single"), 1e-5)
    _close(losses(tmp / "ddp", "valid"), losses(tmp / "single", "valid"), 1e-5)
    w1, w2 = final_weights(tmp / "single"), final_weights(tmp / "ddp")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
    states = load_states(list_checkpoints(tmp / "ddp")[-1][1])
    assert len(states) == 2 and [s["world_size"] for s in states] == [2, 2]
    assert states[0]["mems"][0][0].shape[0] == 2  # each process keeps the memory of its own 2 of the 4 columns
    assert not torch.equal(states[0]["mems"][0][0], states[1]["mems"][0][0])


def test_resume_under_ddp(runs):
    tmp, settings = runs
    args = train_args(tmp, "ddp_resumed", **settings, train__max_tokens=3 * 4 * 16)
    _launch(args, 2)
    assert list_checkpoints(tmp / "ddp_resumed")[-1][0] == 3
    _launch(train_args(tmp, "ddp_resumed", **settings), 2)
    assert losses(tmp / "ddp_resumed") == losses(tmp / "ddp")
    assert_same_weights(final_weights(tmp / "ddp_resumed"), final_weights(tmp / "ddp"))


def test_two_process_checkpoint_continues_on_one(runs):
    tmp, settings = runs
    _launch(train_args(tmp, "shrunk", **settings, train__max_tokens=3 * 4 * 16), 2)
    _launch(train_args(tmp, "shrunk", **settings), 1)  # memories regrouped into one process's 4 columns
    _close(losses(tmp / "shrunk"), losses(tmp / "single"), 1e-5)


def test_a_diverging_run_saves_its_steps_on_every_process_before_it_stops(tmp_path):
    """lr 1e30: step 1's update makes the weights ~1e30, step 2's loss is nan on both processes alike (the loss is
    all-reduced), before the weights change. Both processes undo step 2 and save step 1 together, then stop with
    the one-line error; the checkpoint is complete and holds both processes' states."""
    args = train_args(tmp_path, "diverged", **SETTINGS | dict(train__checkpoint_interval=0, train__eval_interval=0))
    args += ["--train.lr", "1e30", "--train.clip", "0", "--train.warmup_steps", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "txl", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "non-finite training loss (nan) at step 2" in out, out[-3000:]
    assert "step 2 failed: the steps before it were saved first" in out, out[-3000:]
    assert [s for s, _ in list_checkpoints(tmp_path / "diverged")] == [1]
    states = load_states(list_checkpoints(tmp_path / "diverged")[0][1])
    assert [(s["step"], s["world_size"]) for s in states] == [(1, 2), (1, 2)]


ROUTE_SPY = """
import os, sys
from pathlib import Path
import torch
import txl.train.trainer
from txl.kernels.runtime import RouteChoice, choose_fp32_matmul
rank = os.environ["RANK"]
def choose(earlier=None, **kw):
    if earlier is None:  # a measurement: process 0 finds the route faster, the others slower
        choice = RouteChoice(rank == "0", 2.0 if rank == "0" else 0.5, True)
    else:
        choice = RouteChoice(bool(earlier), 1.0, True, earlier)
    Path(sys.argv[1], f"route-{rank}").write_text(f"{earlier} {choice.enabled}")
    return choice
txl.train.trainer.choose_fp32_matmul = choose
from txl.cli import main
main(sys.argv[2:])
"""


def test_every_process_takes_process_0s_fp32_route(tmp_path):
    """The fp32 GEMM route is measured by process 0 only and given to the others (the paths round differently)."""
    script = tmp_path / "spy.py"
    script.write_text(ROUTE_SPY)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = train_args(tmp_path, "r", **{**SETTINGS, "train__max_steps": 2, "train__fp32_route": "true"})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    res = subprocess.run([*cmd, str(tmp_path), *args], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (tmp_path / "route-0").read_text() == "None True"  # measured
    assert (tmp_path / "route-1").read_text() == "True True"  # given, not measured


def test_a_compressive_transformer_trains_under_ddp_as_on_one_process(tmp_path):
    """Issue 76: a Compressive Transformer (compression from the third step on, its reconstruction loss) under
    torchrun gives one process's losses and weights, the compression function's included."""
    settings = SETTINGS | dict(model__mem_len=8, model__cmem_len=4, model__cmem_ratio=2, train__max_steps=6)
    _launch(train_args(tmp_path, "single", **settings), 1)
    _launch(train_args(tmp_path, "ddp", **settings), 2)
    _close(losses(tmp_path / "ddp"), losses(tmp_path / "single"), 1e-5)
    recon = {run: [(r["step"], r["recon"]) for r in read_metrics(tmp_path / run) if r["split"] == "train"]
             for run in ("single", "ddp")}  # fmt: skip
    assert any(v > 0 for _, v in recon["single"])  # (the logged recon: the mean over processes, as the loss)
    _close(recon["ddp"], recon["single"], 1e-5)
    w1, w2 = final_weights(tmp_path / "single"), final_weights(tmp_path / "ddp")
    assert any(k.startswith("transformer.compress.") for k in w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-5, rtol=1e-4)
