"""The outside probes of ../shared/research/probes.md that found a defect, as regressions, through the CLI as the
prober typed them (each test names its probe ids). Each one failed on the code the probes ran against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_finetune import make_data
from tests.test_input_safety import fails, tree_digest
from txl.cli import main


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from train_helpers import run_inprocess

    return run_inprocess(tmp_path_factory.mktemp("probes"), train__max_steps=2, train__eval_interval=0)


def finetune_args(lm, data, run) -> list[str]:
    return ["finetune", "--model", str(lm), "--data", str(data), "--run_dir", str(run), "--max_steps=2",
            "--eval_interval=2", "--checkpoint_interval=2", "--tgt_len=16", "--threads=1"]  # fmt: skip


@pytest.mark.parametrize(
    "probe, fmt, row, message",
    [
        ("fg", "jsonl", '{"text": 12345, "label": "yes"}', "the text must be a string, not int (12345)"),
        ("fl", "jsonl", '{"text": "ab cd", "label": "yes", "label": "nö"}', "the key 'label' is given twice"),
        ("f12", "csv", '"ab cd",yes,extra,fields', "4 fields, the header has 2"),
        ("f12", "csv", '"ab cd"', "1 fields, the header has 2"),
    ],
)
def test_finetune_rows_that_were_read_wrong_are_one_error(probe, fmt, row, message, lm, tmp_path, capsys):
    data = make_data(tmp_path / "data", "single", fmt=fmt, n_train=20)
    train = data / f"train.{fmt}"
    lines = train.read_text(encoding="utf-8").splitlines()
    train.write_text("\n".join([*lines[:5], row, *lines[5:]]) + "\n", encoding="utf-8")
    err = fails(finetune_args(lm, data, tmp_path / "ft"), capsys)
    assert f"train.{fmt}: line 6: {message}" in err, err
    assert not (tmp_path / "ft" / "checkpoints").exists()


def test_predict_refuses_a_ragged_csv(lm, tmp_path, capsys):
    """pr1: a row with an extra field and one without its label were scored silently."""
    data = make_data(tmp_path / "data", "single", fmt="csv", n_train=20)
    main(finetune_args(lm, data, tmp_path / "ft"))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text('text,label\n"ab cd",yes\n"ef gh",nö,extra\n', encoding="utf-8")
    err = fails(["predict", "--model", str(tmp_path / "ft"), "--file", str(ragged)], capsys)
    assert "ragged.csv: line 3: 3 fields, the header has 2" in err


def test_tokenize_reads_standard_input_as_a_training_file(lm, monkeypatch, capsys):
    """tk4: a byte order mark on standard input was a character 'not in the vocabulary'; k05: --ids with --decode
    was ignored."""
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xef\xbb\xbfab\r\ncd")))
    main(["tokenize", "--model", str(lm)])
    assert json.loads(capsys.readouterr().out) == ["a", "b", "\n", "c", "d"]
    err = fails(["tokenize", "--model", str(lm), "--text", "3 4", "--ids", "true", "--decode", "true"], capsys)
    assert "--ids prints a text's ids, --decode reads ids: give one of them" in err


@pytest.mark.parametrize(
    "contexts, message",
    [
        ("[0, 16, 32]", "each length must be >= 1 (a context of 0 tokens)"),  # r3
        ("[-16, 0, 16]", "each length must be >= 1 (a context of -16 tokens)"),  # r4
        ("[100000, 200000]", "the shortest is 100,000 tokens, but 200 are scored"),  # r8
        ("[16, 32, 48.5]", "--contexts = [16, 32, 48.5]: 48.5 is not an int (expected list[int])"),  # r9
    ],
)
def test_recl_contexts_are_checked_against_the_text(contexts, message, lm, tmp_path, capsys):
    args = ["recl", "--models", str(lm), str(lm), "--contexts", contexts, "--tokens", "200", "--out", str(tmp_path)]
    assert message in fails(args, capsys)
    assert not (tmp_path / "recl.json").exists()


@pytest.mark.parametrize("value", ["[[0, 8.5], [10, 16]]", '[[0, "a"], [10, 16]]', "[[0, true], [10, 16]]"])
def test_a_bad_item_of_a_list_option_is_named(value, tmp_path, capsys):
    """n19, n23, n26: '--train.mem_len_schedule = "8.5 - Expected a <class 'NoneType'>": expected an int'."""
    from train_helpers import train_args

    err = fails([*train_args(tmp_path), "--train.mem_len_schedule", value], capsys)
    bad = value.split(", ")[1].rstrip("]").strip('"').replace("true", "True")
    assert "--train.mem_len_schedule = [[0, " in err and f": {bad} is not an int (expected list[list[int]])" in err, err
    assert "NoneType" not in err


def test_an_integer_tf_variable_is_refused(tmp_path, monkeypatch):
    """tf11: an int64 r_w_bias was converted, its values truncated to integers."""
    import txl.interop.convert_tf as convert_tf
    from txl import CheckpointError
    from txl.interop.tf_checkpoint import read_tf_checkpoint

    src = Path(__file__).parent / "fixtures" / "tf" / "adaptive-untied" / "model"
    tensors = dict(read_tf_checkpoint(src))
    tensors["transformer/r_w_bias"] = tensors["transformer/r_w_bias"].long()
    monkeypatch.setattr(convert_tf, "read_tf_checkpoint", lambda _: tensors)
    with pytest.raises(CheckpointError, match="transformer/r_w_bias holds torch.int64 values"):
        convert_tf.convert_tf_checkpoint(src, tmp_path / "out", mem_len=24, corpus=None)
    assert not (tmp_path / "out").exists()


def test_resuming_a_checkpoint_without_its_settings_names_what_is_missing(lm, tmp_path, capsys):
    """n59: a checkpoint without run.json was compared with txl train's defaults ("d_model: checkpoint 32, config
    64 ... change the config back"); t28: a txl finetune checkpoint likewise, without saying what it is."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lm, run)
    step = sorted((run / "checkpoints").iterdir())[-1]
    (step / "run.json").unlink()
    before = tree_digest(run)
    err = fails(["train", "--resume", str(step)], capsys)
    assert f"{step}: no run.json (the settings of the run that wrote it)" in err
    assert tree_digest(run) == before
    data = make_data(tmp_path / "data", "single", n_train=20)
    main(finetune_args(lm, data, tmp_path / "ft"))
    ft_step = sorted((tmp_path / "ft" / "checkpoints").iterdir())[-1]
    assert "a checkpoint of txl finetune (finetune.json): continue it with txl finetune" in fails(
        ["train", "--resume", str(ft_step)], capsys
    )


def test_small_cli_defects_are_one_clear_line(lm, tmp_path, capsys, monkeypatch):
    """u38: `txl attention --text ''` read the current folder as a data set; e05: --mem_len -3 reported as 0; e03:
    --tolerance -1 taken (the export then failed after its work); u36: a malformed --stop list read as one text;
    d16: the advice named --unknown, which generate lacked; k08: a metrics file of bad lines was "no metrics yet";
    d09: a link to nothing among the splits was not named."""
    monkeypatch.chdir(tmp_path)
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.txt").write_text("ab cd\n" * 50)
    err = fails(["attention", "--model", str(lm), "--text", "", "--out", str(tmp_path / "att")], capsys)
    assert "--text is empty" in err and not (tmp_path / "att").exists()
    onnx = tmp_path / "m.onnx"
    assert "mem_len = -3: the exported step carries a memory" in fails(
        ["export", "onnx", "--model", str(lm), "--out", str(onnx), "--mem_len", "-3"], capsys
    )
    assert "--tolerance = -1.0: must be >= 0" in fails(
        ["export", "onnx", "--model", str(lm), "--out", str(onnx), "--tolerance", "-1"], capsys
    )
    assert not onnx.exists()
    assert "--stop '[\"a\",': not a list" in fails(
        ["generate", "--model", str(lm), "--prompt", "ab", "--stop", '["a",', "--max_new_tokens", "2"], capsys
    )
    main(["generate", "--model", str(lm), "--prompt", "ab ☃", "--unknown", "replace", "--max_new_tokens", "2"])
    capsys.readouterr()
    assert "not in the vocabulary" in fails(["generate", "--model", str(lm), "--prompt", "ab ☃"], capsys)
    bad = tmp_path / "k08"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text("{bad\n5\n")
    assert "none of its 2 line(s) is a metrics row" in fails(["plot", str(bad)], capsys)
    (bad / "metrics.jsonl").write_text("{bad\n5")  # (no newline at the end: the same two lines)
    assert "none of its 2 line(s) is a metrics row" in fails(["plot", str(bad)], capsys)
    links = tmp_path / "d09"
    links.mkdir()
    (links / "train.txt").write_text("ab\n")
    (links / "valid.txt").write_text("ab\n")
    (links / "test.txt").symlink_to(links / "nowhere.txt")
    err = fails(["data", "prepare", "--data.path", str(links), "--data.dataset", "custom"], capsys)
    assert "test.txt is a link to a file that does not exist" in err


def test_checkpoint_and_model_files_that_mislead_are_named(lm, tmp_path, capsys):
    """c06: a config.json without d_model filled in the default and listed ~20 mis-shaped tensors; s02: a pickle that
    weights_only refuses printed torch's multi-line text, advice to load it unsafely included; t15: a resume with
    another batch size was the iterator's "batch_size=4, but this iterator has batch_size=8"."""
    import os
    import shutil

    import torch

    from train_helpers import train_args

    model = tmp_path / "c06"
    shutil.copytree(sorted((lm / "checkpoints").iterdir())[-1], model)
    config = json.loads((model / "config.json").read_text())
    del config["d_model"]
    (model / "config.json").write_text(json.dumps(config))
    assert "config.json: no d_model (a model's config.json gives its shape" in fails(
        ["generate", "--model", str(model), "--prompt", "ab"], capsys
    )

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo PWNED",))

    hf = tmp_path / "hf"
    hf.mkdir()
    torch.save({"a": Evil()}, hf / "pytorch_model.bin")
    (hf / "config.json").write_text('{"model_type": "transfo-xl"}')
    err = fails(["convert", "hf", "--trust_pickle", "true", str(hf), str(tmp_path / "out")], capsys)
    assert "refused it: Trying to load unsupported GLOBAL posix.system); it is not loaded" in err
    assert "weights_only set to False" not in err and "will likely succeed" not in err

    run = tmp_path / "t15"
    main([*train_args(tmp_path, "t15"), "--train.max_steps", "2", "--train.eval_interval", "0"])
    before = tree_digest(run)
    err = fails([*train_args(tmp_path, "t15"), "--train.max_steps", "4", "--train.batch_size", "8"], capsys)
    assert "trained with a batch of 4 columns, this run asks for 8 (--train.batch_size" in err
    assert tree_digest(run) == before


def test_permission_and_disk_errors_say_what_to_check():
    """d14: a file the user cannot read exited 1 with "check that folder's permissions and free space"."""
    import errno

    from txl.cli.app import _error

    assert _error(PermissionError(errno.EACCES, "Permission denied", "data/valid.txt")) == (
        2, "txl: error: data/valid.txt: Permission denied (check its permissions)"
    )  # fmt: skip
    code, message = _error(OSError(errno.ENOSPC, "No space left on device", "run/x"))
    assert code == 1 and message.endswith("(check free space on that disk)")


def test_a_finished_finetune_run_again_changes_nothing(lm, tmp_path, capsys):
    """n03: re-running a finished fine-tuning with another --lr rewrote finetune.json with an lr never used; n04: the
    same command again appended the final validation row again."""
    data = make_data(tmp_path / "data", "single", n_train=20)
    run = tmp_path / "ft"
    main(finetune_args(lm, data, run))

    def files() -> dict[str, bytes]:  # (but the lock file, which names the last command that held the folder)
        return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    capsys.readouterr()
    main([*finetune_args(lm, data, run), "--lr=0.05"])
    assert "finished at step 2 (max_steps 2): nothing to do" in capsys.readouterr().out
    main(finetune_args(lm, data, run))
    assert files() == before


def test_safetensors_files_are_the_same_bytes_from_every_process(tmp_path):
    """kc2: the same tensors saved by two processes differed (the metadata's keys in hash-map order)."""
    import subprocess
    import sys

    from train_helpers import ROOT

    code = (
        "import sys, torch; from txl.util.fileio import save_safetensors; "
        "save_safetensors({'b': torch.ones(3, 4), 'a': torch.arange(5)}, sys.argv[1], "
        "metadata={'format': 'pt', 'txl_format_version': '1', 'other': 'x'})"
    )
    files = [tmp_path / f"{i}.safetensors" for i in range(4)]
    for f in files:
        subprocess.run([sys.executable, "-c", code, str(f)], check=True, env={"PYTHONPATH": str(ROOT / "src")})
    assert len({f.read_bytes() for f in files}) == 1


def test_a_corpus_build_killed_while_writing_leaves_no_temporary_file(tmp_path):
    """n42: a killed build's .train.bin.<hex>.tmp stayed in the cache folder for good."""
    from train_helpers import train_args

    main([*train_args(tmp_path), "--train.max_steps", "1", "--train.eval_interval", "0"])
    cache = tmp_path / "cache"
    (cache / ".train.bin.0123456789ab.tmp").write_bytes(b"\0" * 1000)
    (cache / "meta.json").unlink()  # (so that the next command rebuilds)
    main([*train_args(tmp_path, "again"), "--train.max_steps", "1", "--train.eval_interval", "0"])
    assert not list(cache.glob(".*.tmp"))


def test_a_changed_memory_schedule_on_resume_is_said(tmp_path, capsys):
    """n28: resuming with another --train.mem_len_schedule trained on with memory 4 after 16, and said nothing (a
    changed learning-rate schedule gets a note)."""
    from train_helpers import train_args

    main([*train_args(tmp_path), "--train.max_steps", "4", "--train.eval_interval", "0",
          "--train.mem_len_schedule", "[[0, 16]]"])  # fmt: skip
    capsys.readouterr()
    main([*train_args(tmp_path), "--train.max_steps", "6", "--train.eval_interval", "0",
          "--train.mem_len_schedule", "[[0, 4], [100, 16]]"])  # fmt: skip
    out = capsys.readouterr()
    assert (
        "note: the memory schedule changed ([[0, 16]] -> [[0, 4], [100, 16]]): step 5 carries a memory of 4 where "
        "the checkpoint's run would have used 16" in out.out + out.err
    )


def test_export_to_a_folder_that_takes_no_file_is_refused_before_the_export(lm, tmp_path, capsys, monkeypatch):
    """n43: a read-only --out folder was found after the 18-s export, naming a hidden temporary file."""
    import errno
    import time

    def read_only(self, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "touch", read_only)
    out = tmp_path / "ro" / "m.onnx"
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["export", "onnx", "--model", str(lm), "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and f"{out}: Read-only file system" in err and ".partial-" not in err, err
    assert time.monotonic() - t0 < 5
