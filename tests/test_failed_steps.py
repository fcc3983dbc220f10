"""A training step that fails (a non-finite loss, out of memory in a forward pass) loses nothing: the steps before it
are saved first, undone to where that step began, so that the checkpoint is the one a run saving there writes and
`--resume auto` goes on bit for bit. A step that fails inside the optimizer's update saves nothing (its weights may
be half changed) and says so. Through `txl train` and `txl finetune`, the commands users run."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from test_finetune import args as finetune_args
from test_finetune import make_data
from train_helpers import assert_same_weights, final_weights, losses, train_args
from txl.cli import main
from txl.model.modeling import TransformerXLLM
from txl.train.checkpoint import latest_checkpoint
from txl.train.loop import TrainingLoop
from txl.train.trainer import Trainer

RUN = dict(train__max_steps=10, train__batch_chunk=2, train__log_interval=1, train__eval_interval=0)


def _state(step_dir):
    return torch.load(step_dir / "train_state-rank0.pt", map_location="cpu", weights_only=True)


def _same(a, b, where: str = "state") -> None:
    """Two saved training states are equal, tensors bit for bit (the time spent aside)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        keys = set(a) - {"elapsed"}
        assert keys == set(b) - {"elapsed"}, where
        for k in keys:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _nan_loss_at(monkeypatch, call: int) -> None:
    """The loop's update sees a non-finite loss at its ``call``-th call (the weights are then left as they were)."""
    real, calls = TrainingLoop.update, []

    def update(self, loss_sum, where):
        calls.append(1)
        return real(self, loss_sum * math.nan if len(calls) == call else loss_sum, where)

    monkeypatch.setattr(TrainingLoop, "update", update)


def _oom_in_forward_at(monkeypatch, call: int) -> None:
    """Out of memory in the ``call``-th forward pass (with two chunks a step: the second one's, after the first
    chunk replaced its memories and drew its dropout)."""
    real, calls = TransformerXLLM.forward, []

    def forward(self, *a, **k):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10737418240 bytes.")
        return real(self, *a, **k)

    monkeypatch.setattr(TransformerXLLM, "forward", forward)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run without a failure, saving at step 6 and at its end."""
    tmp = tmp_path_factory.mktemp("ref")
    main(train_args(tmp, "ref", **RUN, train__checkpoint_interval=6))
    return tmp / "ref"


@pytest.mark.parametrize("failure", ["non-finite loss", "out of memory in the forward pass"])
def test_a_failing_step_saves_the_steps_before_it_as_a_run_saving_there_would(
    failure, reference, tmp_path, capsys, monkeypatch
):
    if failure == "non-finite loss":
        _nan_loss_at(monkeypatch, 7)
        error = "non-finite training loss (nan) at step 7"
    else:
        _oom_in_forward_at(monkeypatch, 2 * 6 + 2)
        error = "out of memory (an allocation"
    args = train_args(tmp_path, "run", **RUN, train__checkpoint_interval=0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 1 and error in err.strip().splitlines()[-1] and "Traceback" not in err, err
    saved = latest_checkpoint(tmp_path / "run")
    assert f"step 7 failed: the steps before it were saved first, {saved}" in out
    assert saved.name == "step-6"
    ref6 = reference / "checkpoints" / "step-6"
    assert_same_weights(load_file(str(saved / "model.safetensors")), load_file(str(ref6 / "model.safetensors")))
    _same(_state(saved), _state(ref6))  # the data's position, the memories, the random state, the optimizer's lr

    monkeypatch.undo()
    main([*args, "--resume", "auto"])
    assert losses(tmp_path / "run") == losses(reference)
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(reference))


def test_without_the_rewind_the_saved_step_would_be_one_batch_ahead(reference, tmp_path, capsys, monkeypatch):
    """The comparison above catches a save that is not undone to the step's start."""
    _nan_loss_at(monkeypatch, 7)
    monkeypatch.setattr(Trainer, "rewind", lambda self, progress: None)
    with pytest.raises(SystemExit):
        main(train_args(tmp_path, "run", **RUN, train__checkpoint_interval=0))
    saved = _state(latest_checkpoint(tmp_path / "run"))
    ref = _state(reference / "checkpoints" / "step-6")
    assert saved["iterator"] != ref["iterator"]
    assert not torch.equal(saved["rng"]["torch"], ref["rng"]["torch"])
    assert not all(torch.equal(a, b) for a, b in zip(saved["mems"][0], ref["mems"][0], strict=True))


def test_a_step_failing_inside_the_optimizers_update_saves_nothing_and_says_so(tmp_path, capsys, monkeypatch):
    real, calls = torch.amp.GradScaler.step, []

    def step(self, optimizer, *a, **k):
        calls.append(1)
        if len(calls) == 7:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, optimizer, *a, **k)

    monkeypatch.setattr(torch.amp.GradScaler, "step", step)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(train_args(tmp_path, "run", **RUN, train__checkpoint_interval=4))
    out, err = capsys.readouterr()
    kept = tmp_path / "run" / "checkpoints" / "step-4"
    assert e.value.code == 1 and "out of memory" in err and "Traceback" not in err
    said = "step 7 failed while the optimizer changed the weights: they are not saved; the last complete checkpoint"
    assert f"{said} is {kept}" in out
    assert latest_checkpoint(tmp_path / "run") == kept


def test_a_failing_fine_tuning_step_saves_the_steps_before_it_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    from train_helpers import run_inprocess

    lm = run_inprocess(tmp_path / "lm", train__max_steps=4, train__eval_interval=0)
    data = make_data(tmp_path / "data", "single")
    kw = dict(max_steps=12, eval_interval=6, dropout=0.1)
    main(finetune_args(lm, data, tmp_path / "ref", checkpoint_interval=6, **kw))
    _nan_loss_at(monkeypatch, 7)
    run = tmp_path / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(finetune_args(lm, data, run, checkpoint_interval=100, **kw))
    out, err = capsys.readouterr()
    assert e.value.code == 1 and "non-finite training loss" in err, err
    saved = latest_checkpoint(run)
    assert saved.name == "step-6" and f"step 7 failed: the steps before it were saved first, {saved}" in out
    ref6 = tmp_path / "ref" / "checkpoints" / "step-6"
    assert_same_weights(load_file(str(saved / "model.safetensors")), load_file(str(ref6 / "model.safetensors")))
    _same(_state(saved), _state(ref6))

    monkeypatch.undo()
    main(finetune_args(lm, data, run, checkpoint_interval=100, **kw))  # (the same command resumes)
    assert_same_weights(
        load_file(str(latest_checkpoint(run) / "model.safetensors")),
        load_file(str(latest_checkpoint(tmp_path / "ref") / "model.safetensors")),
    )


def test_a_run_that_diverges_keeps_its_last_finite_step(tmp_path, capsys):
    """No injection: lr 1e30 makes step 1's weights ~1e30 and step 2's loss nan. Step 1 is saved before the error."""
    args = train_args(tmp_path, "run", **RUN, train__checkpoint_interval=0)
    args += ["--train.lr", "1e30", "--train.clip", "0", "--train.warmup_steps", "0"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 1 and "non-finite training loss (nan) at step 2" in err
    assert latest_checkpoint(tmp_path / "run").name == "step-1" and "step 2 failed: the steps before it" in out
