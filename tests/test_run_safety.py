"""What a hostile user does to a run folder: two `txl train` on it, a read-only folder or cache, a full disk during
a checkpoint, a file-size limit. Each ends with one line naming the path and the cause, and neither the last good
checkpoint nor the metrics are lost: the run resumes to the same losses and weights as one that never failed."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import (
    ROOT,
    assert_same_weights,
    final_weights,
    losses,
    train_args,
    txl_process,
)
from txl.model.modeling import TransformerXLLM
from txl.train.checkpoint import MARKER, list_checkpoints, load_states

QUICK = dict(train__log_interval=1, train__eval_interval=0, train__checkpoint_interval=10, train__max_steps=30)


def _wait_for_rows(run: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    end = time.time() + timeout
    while len(losses(run)) < n:
        assert proc.poll() is None, "the run ended too early"
        assert time.time() < end, f"{run}: fewer than {n} metrics rows"
        time.sleep(0.01)


def _one_line_error(res: subprocess.CompletedProcess) -> str:
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "txl", *args], env=env, capture_output=True, text=True, **kw)


@pytest.mark.slow
def test_second_train_on_a_run_folder_is_refused_and_a_dead_runs_lock_is_not(tmp_path):
    args = train_args(tmp_path, **{**QUICK, "train__max_steps": 10**6, "train__checkpoint_interval": 20})
    run = tmp_path / "run"
    first = txl_process(args, stdout=subprocess.DEVNULL)
    try:
        _wait_for_rows(run, first, 5)
        second = _run(args, timeout=120)
        assert second.returncode == 2
        line = _one_line_error(second)
        assert line.startswith(f"txl: error: {run} is in use by another txl train (pid {first.pid} on ")
        _wait_for_rows(run, first, len(losses(run)) + 30)  # the survivor goes on writing its metrics
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
    steps = [s for s, _ in losses(run)]
    assert steps == list(range(1, len(steps) + 1))  # nothing dropped by the refused second start
    # A run killed outright leaves the lock file behind, but not the lock: the next start continues the run.
    third = txl_process(args, stdout=subprocess.DEVNULL)
    _wait_for_rows(run, third, len(steps) + 3)
    third.kill()
    third.wait(timeout=60)
    assert (run / ".lock").exists()
    resumed = _run([*args, "--train.max_steps", str(list_checkpoints(run)[-1][0] + 2)], timeout=300)
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.parametrize("where", ["run_dir", "data.cache_dir"])
def test_a_folder_that_cannot_be_created_is_named(tmp_path, where):
    forbidden = "/sys/txl-test-cannot-write"  # sysfs refuses new entries, even to root
    args = train_args(tmp_path, **QUICK)
    args[args.index(f"--{where}") + 1] = forbidden
    res = _run(args, timeout=120)
    assert res.returncode == 2  # (a place the user may not write: the user's to change, as a bad option is)
    line = _one_line_error(res)
    assert line.startswith(f"txl: error: {forbidden}") and "not permitted" in line and "check its permissions" in line


@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A size-limited tmpfs at ``path`` (needs CAP_SYS_ADMIN, as root in CI has); yields False where impossible."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# Without the privilege to mount a small filesystem, the full disk is made by failing the second checkpoint's
# first write with ENOSPC, as the kernel would.
ENOSPC_AT_SECOND_SAVE = """
import errno, os, sys
import txl.util.fileio as io_
original, calls = io_.save_torch, []
def save_torch(obj, dest):
    calls.append(dest)
    if len(calls) == 2:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest))
    original(obj, dest)
io_.save_torch = save_torch
import txl.train.checkpoint as ck
ck.save_torch = save_torch
from txl.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_keeps_the_last_one_and_resumes_exactly(tmp_path):
    reference = _run(train_args(tmp_path, "reference", **QUICK), timeout=300)
    assert reference.returncode == 0, reference.stderr
    size = sum(f.stat().st_size for f in list_checkpoints(tmp_path / "reference")[-1][1].iterdir())
    disk = tmp_path / "disk"
    args = train_args(tmp_path, **QUICK)
    args[args.index("--run_dir") + 1] = str(disk / "run")
    with tmpfs(disk, size * 3 // 2 + 64 * 1024) as mounted:  # room for one checkpoint and the logs, not two
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "txl", *args] if mounted else [sys.executable, "-c", ENOSPC_AT_SECOND_SAVE, *args]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 1
        line = _one_line_error(res)
        run = disk / "run"
        assert line.startswith(f"txl: training stopped: could not write checkpoint step-20 in {run / 'checkpoints'}")
        assert "No space left on device" in line and f"{run / 'checkpoints' / 'step-10'}, is intact" in line
        assert [s for s, _ in list_checkpoints(run)] == [10]
        assert not list((run / "checkpoints").glob(".step-*"))  # the partial checkpoint was removed
        last = list_checkpoints(run)[0][1]
        assert (last / MARKER).exists() and TransformerXLLM.from_pretrained(last) and load_states(last)
        assert [s for s, _ in losses(run)] == list(range(1, 21))  # every metrics row written before the failure
        saved = tmp_path / "moved"
        shutil.copytree(run, saved)  # "free some space": the folder moves to a disk with room
    args[args.index("--run_dir") + 1] = str(saved)
    resumed = _run(args, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(saved) == losses(tmp_path / "reference")
    assert_same_weights(final_weights(saved), final_weights(tmp_path / "reference"))


@pytest.mark.slow
def test_a_file_size_limit_is_one_line_and_loses_nothing(tmp_path):
    args = train_args(tmp_path, **QUICK)
    warm = _run([*args[:-2], "--run_dir", str(tmp_path / "warm"), "--train.max_steps", "1"], timeout=300)
    assert warm.returncode == 0, warm.stderr  # the corpus cache is built before the limit applies
    state_bytes = (list_checkpoints(tmp_path / "warm")[-1][1] / "train_state-rank0.pt").stat().st_size
    limit = state_bytes // 2  # the training state of a checkpoint does not fit, the logs and metrics do

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    res = _run(args, timeout=300, preexec_fn=limit_file_size)
    assert res.returncode == 1
    line = _one_line_error(res)
    run = tmp_path / "run"
    assert line.startswith(f"txl: training stopped: could not write checkpoint step-10 in {run / 'checkpoints'}")
    assert "File too large" in line and "no complete checkpoint exists yet" in line
    assert list_checkpoints(run) == [] and not list((run / "checkpoints").glob(".step-*"))
    assert [s for s, _ in losses(run)] == list(range(1, 11))


@pytest.mark.slow
def test_a_read_only_run_folder_still_evaluates_and_refuses_training_in_one_line(tmp_path):
    disk = tmp_path / "disk"
    args = train_args(tmp_path, **QUICK)
    args[args.index("--run_dir") + 1] = str(disk / "run")
    with tmpfs(disk, 16 * 1024 * 1024) as mounted:
        if not mounted and os.geteuid() == 0:
            pytest.skip("root without CAP_SYS_ADMIN: no read-only folder can be made here")
        assert _run(args, timeout=300).returncode == 0
        run = disk / "run"
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        else:
            for p in [run, *run.rglob("*")]:
                p.chmod(0o555 if p.is_dir() else 0o444)
        res = _run([*args, "--train.max_steps", "40"], timeout=300)
        assert res.returncode == 1
        line = _one_line_error(res)
        assert line.startswith(f"txl: error: {run / '.lock'}: ") and ("Read-only" in line or "Permission" in line)
        ok = _run(["eval", "--model", str(run), "--max_batches", "2", "--json"], timeout=300)
        assert ok.returncode == 0, ok.stderr  # evaluating a finished run never writes to it
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("garbage", ["{}", "5", '{"step": "x"}', "\udcff"])
def test_a_metrics_line_that_is_not_a_row_does_not_stop_a_resume(tmp_path, garbage, capsys):
    """probes.md mt1-mt4: a metrics.jsonl line of `{}` or `5` made every resume a traceback (KeyError / TypeError).
    Such a line is skipped as a torn one is: the run resumes, rewinds to its checkpoint and keeps its real rows."""
    from train_helpers import run_inprocess
    from txl.cli import main
    from txl.util.metrics import read_metrics

    run = run_inprocess(tmp_path, train__max_steps=4, train__eval_interval=0, train__checkpoint_interval=2)
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_bytes(("\n".join([*lines[:2], garbage, *lines[2:]]) + "\n").encode("utf-8", "surrogateescape"))
    before = [r["step"] for r in read_metrics(run)]
    main(["train", "--resume", str(run / "checkpoints" / "step-2"), "--train.max_steps", "6"])
    assert "Traceback" not in capsys.readouterr().err
    steps = [r["step"] for r in read_metrics(run) if r.get("split") == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) and set(before) <= set(range(0, 7))
    assert list_checkpoints(run)[-1][0] == 6


def test_a_bit_flipped_in_a_checkpoint_is_found_before_a_resume_trains_on_it(tmp_path, capsys):
    """probes.md n57: a bit flipped inside the weights of a checkpoint resumed and trained on silently. Each
    checkpoint records the sha256 of its files in metadata.json; a resume verifies them first: one error naming the
    file and the checkpoint before it, and the run folder as it was."""
    from train_helpers import run_inprocess
    from txl.cli import main

    run = run_inprocess(tmp_path, train__max_steps=4, train__eval_interval=0, train__checkpoint_interval=2)
    last = run / "checkpoints" / "step-4"
    recorded = json.loads((last / "metadata.json").read_text())["sha256"]
    assert recorded.keys() == {"model.safetensors", "train_state-rank0.pt"}
    weights = last / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1000] ^= 0b100
    weights.write_bytes(bytes(data))
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--resume", str(run), "--train.max_steps", "6"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{weights}: its sha256 differs" in err and "--resume" in err and "step-2" in err, err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before


def test_a_run_inside_another_runs_checkpoint_is_refused(tmp_path, capsys):
    """probes.md n69: `--run_dir runs/nest/checkpoints/step-60` started a run there, and the outer run's retention
    later deleted it with step-60. Such a folder is refused before anything is written."""
    from train_helpers import run_inprocess
    from txl.cli import main

    outer = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    step = outer / "checkpoints" / "step-2"
    before = sorted(str(p) for p in step.rglob("*"))
    capsys.readouterr()
    for inner in (step, step / "deeper"):
        with pytest.raises(SystemExit) as e:
            main(train_args(tmp_path, str(inner), train__max_steps=2))
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"inside {step}, a checkpoint of another run" in err and err.count("\n") == 1, err
    assert sorted(str(p) for p in step.rglob("*")) == before
