"""`txl train` (the real command line) against training written out by hand: the same per-step losses as a plain
forward/backward/clip/Adam loop over a model built from the same YAML, and training with ext_len scoring exactly
what one pass over the text scores."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from train_helpers import ROOT, losses, tiny_corpus
from txl.cli import main
from txl.data import cached_corpus
from txl.model.modeling import TransformerXLConfig, TransformerXLLM

SHAKESPEARE = ROOT.parent / "shared" / "data" / "shakespeare"
RECIPE = ROOT / "configs" / "shakespeare_char.yaml"


def shakespeare(tmp_path: Path) -> Path:
    """The project's corpus when ../shared has it, else a small text in the same layout."""
    return SHAKESPEARE if (SHAKESPEARE / "train.txt").exists() else tiny_corpus(tmp_path / "corpus", n_train=60_000)


def train_cli(tmp_path: Path, data: Path, **overrides) -> tuple[Path, np.ndarray, int]:
    """`txl train --config configs/shakespeare_char.yaml` with overrides: the run folder, the training ids and the
    vocabulary size."""
    args = ["train", "--config", str(RECIPE), "--data.path", str(data), "--data.cache_dir", str(tmp_path / "cache")]
    args += ["--run_dir", str(tmp_path / "run"), "--train.log_interval", "1", "--train.eval_interval", "0"]
    args += ["--train.checkpoint_interval", "0", "--train.eval_max_steps", "2"]
    for key, value in overrides.items():
        args += [f"--{key.replace('__', '.')}", str(value)]
    threads = torch.get_num_threads()
    try:
        main(args)
    finally:
        torch.set_num_threads(threads)
    corpus = cached_corpus(path=str(data), dataset="shakespeare", cache_dir=str(tmp_path / "cache"))
    return tmp_path / "run", np.asarray(corpus.splits["train"], dtype=np.int64), corpus.tokenizer.vocab_size


def columns(ids: np.ndarray, batch: int) -> torch.Tensor:
    """The reference's batchify: ``batch`` contiguous columns of the stream, the tail dropped."""
    n = len(ids) // batch
    return torch.from_numpy(ids[: n * batch].reshape(batch, n))


def recipe_model(vocab: int, **changes) -> tuple[dict, TransformerXLLM]:
    """The recipe's sections and its model, built by hand from the YAML (n_token = the vocabulary)."""
    recipe = yaml.safe_load(RECIPE.read_text())
    torch.manual_seed(recipe["train"]["seed"])
    model = TransformerXLLM(TransformerXLConfig(**{**recipe["model"], "n_token": vocab, **changes}))
    return recipe, model


def test_txl_train_equals_a_plain_loop(tmp_path):
    steps = 20
    run, ids, vocab = train_cli(tmp_path, shakespeare(tmp_path), train__max_steps=steps)
    recipe, model = recipe_model(vocab)
    t = recipe["train"]
    assert model.config.d_embed == model.config.d_model  # what the YAML means (no embedding projection)
    torch.set_num_threads(t["threads"])
    cols = columns(ids, t["batch_size"])
    opt = torch.optim.Adam(model.parameters(), lr=t["lr"], betas=(0.9, 0.999), eps=1e-8)
    expected, mems = [], None
    for step in range(1, steps + 1):
        if step < t["warmup_steps"]:  # the recipe's schedule written out: linear warm-up, then cosine
            lr = t["lr"] * step / t["warmup_steps"]
        else:
            lr = t["eta_min"] + (t["lr"] - t["eta_min"]) * (1 + math.cos(math.pi * step / steps)) / 2
        for group in opt.param_groups:
            group["lr"] = lr
        i = (step - 1) * t["tgt_len"]
        out = model(cols[:, i : i + t["tgt_len"]], cols[:, i + 1 : i + t["tgt_len"] + 1], mems=mems)
        mems = out.mems
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["clip"])
        opt.step()
        expected.append(out.loss.item())
    got = [loss for _, loss in losses(run)]
    assert len(got) == steps
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-5
    assert expected[-1] < expected[0] - 0.1  # it learned: the comparison is not between two constant curves


def frozen_run(tmp_path: Path, steps: int, batch: int, tgt: int, mem_len: int, **overrides):
    """`txl train` with lr 1e-30 (the weights stay as initialised, so each step's logged loss is the initial
    model's NLL of what the step scores), and the same model built by hand with the columns of the training ids."""
    run, ids, vocab = train_cli(
        tmp_path, shakespeare(tmp_path), train__max_steps=steps, train__lr=1e-30, train__batch_size=batch,
        train__tgt_len=tgt, model__mem_len=mem_len, **overrides,
    )  # fmt: skip
    _, model = recipe_model(vocab, mem_len=mem_len)
    got = torch.tensor([loss for _, loss in losses(run)])
    return run, model, columns(ids, batch), got


@pytest.mark.parametrize("ext_len", [5, 80])
def test_training_with_ext_len_scores_what_one_pass_scores(tmp_path, ext_len):
    """lr 1e-30 keeps the weights as initialised, so every step's training loss must be the full-context NLL of its
    tokens: ext_len context fed again in front of each segment, the memory reaching back to the start."""
    steps, batch, tgt = 6, 4, 32
    _, model, cols, got = frozen_run(tmp_path, steps, batch, tgt, steps * tgt, train__ext_len=ext_len)
    with torch.no_grad():
        one_pass = model(cols[:, : steps * tgt], cols[:, 1 : steps * tgt + 1]).losses  # [batch, steps * tgt]
    expected = one_pass.view(batch, steps, tgt).mean(dim=(0, 2))
    assert len(got) == steps
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=0)


def test_half_loss_scores_the_last_half_of_each_segment(tmp_path):
    """train.loss_fraction 0.5 (the paper's half loss): with the weights kept as initialised, each step's loss is
    the mean NLL of the last half of every segment, with the memory reaching back to the start."""
    steps, batch, tgt = 4, 4, 30
    _, model, cols, got = frozen_run(tmp_path, steps, batch, tgt, steps * tgt, train__loss_fraction=0.5)
    with torch.no_grad():
        one_pass = model(cols[:, : steps * tgt], cols[:, 1 : steps * tgt + 1]).losses.view(batch, steps, tgt)
    torch.testing.assert_close(got, one_pass[:, :, tgt // 2 :].mean(dim=(0, 2)).float(), atol=1e-5, rtol=0)
    assert (got - one_pass.mean(dim=(0, 2))).abs().max() > 1e-3  # not the full loss


def test_a_memory_schedule_grows_the_memory_of_training(tmp_path, capsys):
    """train.mem_len_schedule: with the weights kept as initialised, step s's loss is the NLL of its segment under
    the memory that the schedule gives step s (none, then 30, then 90 tokens, the memory kept so far), not the
    model's full memory from the start; a schedule that does not end at model.mem_len is refused."""
    steps, batch, tgt, schedule = 6, 4, 30, [[0, 0], [2, 30], [4, 90]]
    run, model, cols, got = frozen_run(tmp_path, steps, batch, tgt, 90, train__mem_len_schedule=schedule)
    expected, full, mems, full_mems = [], [], None, None
    with torch.no_grad():
        for step in range(steps):
            m = [mem for at, mem in schedule if at <= step][-1]
            x, y = cols[:, step * tgt : (step + 1) * tgt], cols[:, step * tgt + 1 : (step + 1) * tgt + 1]
            out = model(x, y, mems=mems, mem_len=m)
            mems = out.mems if m > 0 else None
            expected.append(out.loss)
            out = model(x, y, mems=full_mems)
            full_mems = out.mems
            full.append(out.loss)
    torch.testing.assert_close(got, torch.stack(expected).float(), atol=1e-5, rtol=0)
    assert (got[1:3] - torch.stack(full)[1:3]).abs().min() > 1e-4  # (the schedule is what changed them)
    assert "the memory grows: [[0, 0], [2, 30], [4, 90]]" in (run / "train.log").read_text()
    with pytest.raises(SystemExit):
        main(["train", "--config", str(RECIPE), "--train.mem_len_schedule", "[[0, 4], [10, 8]]",
              "--run_dir", str(tmp_path / "r")])  # fmt: skip
    assert "its last memory must be model.mem_len" in capsys.readouterr().err
    for bad, message in [("[[5, 4]]", "the first at step 0"), ("[[0, 8], [0, 16]]", "steps must increase"),
                         ("[[0, 16], [5, 8]]", "grow (never shrink)")]:  # fmt: skip
        with pytest.raises(SystemExit):
            main(["train", "--config", str(RECIPE), "--train.mem_len_schedule", bad, "--run_dir", str(tmp_path / "r")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_training_without_recurrence_carries_no_memory(tmp_path):
    """model.mem_len 0 in training (the ablation's "without recurrence"): every segment is scored alone, while
    evaluation may still give the model a memory."""
    steps, batch, tgt = 4, 4, 30
    run, model, cols, got = frozen_run(tmp_path, steps, batch, tgt, 0, eval__mem_len=60)
    with torch.no_grad():
        alone = [model(cols[:, i : i + tgt], cols[:, i + 1 : i + tgt + 1]).loss for i in range(0, steps * tgt, tgt)]
        carried = model(cols[:, : steps * tgt], cols[:, 1 : steps * tgt + 1]).losses.view(batch, steps, tgt)
    torch.testing.assert_close(got, torch.stack(alone).float(), atol=1e-5, rtol=0)
    # a memory would have changed the loss (an untrained model uses context little, but 10x the tolerance above)
    assert (got[1:] - carried.mean(dim=(0, 2))[1:]).abs().max() > 1e-4
    assert yaml.safe_load((run / "config.yaml").read_text())["eval"]["mem_len"] == 60


def test_loss_fraction_is_validated(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--config", str(RECIPE), "--train.loss_fraction", "0", "--run_dir", str(tmp_path / "r")])
    assert "train.loss_fraction = 0.0: must be in (0, 1]" in capsys.readouterr().err
