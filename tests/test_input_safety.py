"""Nothing a user types damages what is already there: a command that writes a folder or file checks first and
refuses to overwrite by surprise (its own source never), writes into a staged copy that replaces the old one only
once complete, and leaves every existing file byte-identical when it fails; importing txl changes nothing
process-wide (the umask)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ADAPTIVE_FIXTURE, CHAR_FIXTURE, debug_config
from txl import TransformerXLLM
from txl.cli import main


def tree_digest(folder: Path) -> str:
    """One hash of every file below ``folder`` (names and bytes) and of the folder's entries."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        h.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def fails(args: list[str], capsys) -> str:
    """The one-line error of a txl command that must fail with exit code 2."""
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_convert_refuses_an_existing_folder_and_its_own_source(tmp_path, capsys):
    """`txl convert hf SRC runs/x/checkpoints/step-N` replaced a trained checkpoint's weights and config and kept its
    old tokenizer.json; `txl convert hf SRC SRC` overwrote the source. Now an existing non-empty folder needs
    --overwrite (and is then replaced whole, old files included), the source is never written, and a failed
    conversion leaves the folder as it was."""
    out = tmp_path / "out"
    main(["convert", "hf", str(CHAR_FIXTURE), str(out)])
    (out / "tokenizer.json").write_text('{"a stale": "tokenizer"}')  # (as a trained run's checkpoint has)
    before = tree_digest(out)
    err = fails(["convert", "hf", str(ADAPTIVE_FIXTURE), str(out)], capsys)
    assert "the folder exists and is not empty" in err and "--overwrite true" in err
    assert tree_digest(out) == before
    src = tmp_path / "src"
    shutil.copytree(CHAR_FIXTURE, src)
    source = tree_digest(src)
    for target in (src, src / "inside"):
        assert "into the source" in fails(["convert", "hf", str(src), str(target), "--overwrite", "true"], capsys)
    assert "around the source" in fails(["convert", "hf", str(src), str(tmp_path), "--overwrite", "true"], capsys)
    assert tree_digest(src) == source
    broken = tmp_path / "broken"
    shutil.copytree(ADAPTIVE_FIXTURE, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SystemExit):
        main(["convert", "hf", str(broken), str(out), "--overwrite", "true"])
    capsys.readouterr()
    assert tree_digest(out) == before and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    main(["convert", "hf", str(ADAPTIVE_FIXTURE), str(out), "--overwrite", "true"])
    fresh = tmp_path / "fresh"
    main(["convert", "hf", str(ADAPTIVE_FIXTURE), str(fresh)])
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())  # (no stale file)
    assert (out / "config.json").read_bytes() == (fresh / "config.json").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # (no staged copy left behind)


@pytest.mark.slow  # (the heaviest of the default suite: CI runs it with the slow ones)
def test_export_refuses_an_existing_file_and_leaves_nothing_when_it_fails(tmp_path, capsys):
    """A failed ONNX export left its .onnx at the destination; an existing one was overwritten silently."""
    pytest.importorskip("onnxruntime")
    model = tmp_path / "model"
    TransformerXLLM(debug_config()).save_pretrained(model)
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"an earlier export")
    err = fails(["export", "onnx", "--model", str(model), "--out", str(onnx_file)], capsys)
    assert "the file exists" in err and "--overwrite true" in err and onnx_file.read_bytes() == b"an earlier export"
    new = tmp_path / "new.onnx"
    assert "differs from PyTorch" in fails(
        ["export", "onnx", "--model", str(model), "--out", str(new), "--tolerance", "1e-15"], capsys
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "model"]  # nothing new, nothing staged
    main(["export", "onnx", "--model", str(model), "--out", str(onnx_file), "--overwrite", "true"])
    assert onnx_file.read_bytes()[:4] != b"an e" and onnx_file.stat().st_size > 1000


def test_importing_txl_leaves_the_umask_alone(tmp_path):
    """fileio read the umask at import by setting it to 0 for a moment: another thread creating a file then got mode
    0666. Now nothing sets it; files still get the mode the umask gives."""
    code = (
        "import os, sys\ncalls = []\nreal = os.umask\nos.umask = lambda m: calls.append(m) or real(m)\n"
        "import txl, txl.cli, txl.util.fileio, txl.train.trainer, txl.serve\n"
        "from txl.util.fileio import write_bytes, save_torch\n"
        "write_bytes(sys.argv[1] + '/a', b'x')\nsave_torch({'x': 1}, sys.argv[1] + '/b')\n"
        "print(calls)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr
    umask = 0o022  # (the subprocess inherits this process's umask)
    umask = os.umask(umask)
    os.umask(umask)
    for name in ("a", "b"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_tokenizer_of_another_size_is_refused_where_a_model_is_loaded(tmp_path, capsys):
    """A 10-symbol tokenizer beside a model of 35 token ids: txl eval printed a loss, generation failed part-way and
    the server answered 500. Now every command that loads the pair names the mismatch in one line."""
    from train_helpers import run_inprocess
    from txl.data import Tokenizer
    from txl.train.checkpoint import latest_checkpoint

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    capsys.readouterr()
    model = tmp_path / "model"
    shutil.copytree(latest_checkpoint(run), model)
    Tokenizer("char", list("abcdefghij")).save(model / "tokenizer.json")
    text = tmp_path / "text.txt"
    text.write_text("abc def\n")
    n_token = TransformerXLLM.load_config(model).n_token
    message = f"a tokenizer of 10 symbols beside a model of {n_token} token ids: it is not this model's tokenizer"
    for args in (
        ["generate", "--model", str(model), "--prompt", "ab", "--max_new_tokens", "5"],
        ["eval", "--model", str(model), "--data", str(text)],
        ["serve", "--model", str(model), "--port", "0"],
    ):
        assert message in fails(args, capsys), args


def test_finetune_locks_its_run_folder_as_train_does(tmp_path, capsys):
    """Two `txl finetune` on one run folder both exited 0, the folder mixing their metrics; now the second stops
    with the run lock's one line (the same as txl train's), and a refused run leaves the folder as it was."""
    from test_finetune import args, make_data
    from train_helpers import run_inprocess
    from txl.train.checkpoint import RunLock

    lm = run_inprocess(tmp_path / "lm", train__max_steps=2, train__eval_interval=0)
    data = make_data(tmp_path / "data", "single")
    run = tmp_path / "ft"
    run.mkdir()
    holder = RunLock(run, "txl finetune")
    try:
        before = tree_digest(run)
        err = fails(args(lm, data, run, max_steps=4), capsys)
        assert f"{run} is in use by another txl finetune (pid {os.getpid()} on " in err
        assert tree_digest(run) == before
    finally:
        holder.release()
    main(args(lm, data, run, max_steps=4, eval_interval=4, checkpoint_interval=4))
    assert (run / "checkpoints" / "step-4").is_dir()
    missing = tmp_path / "never"
    with pytest.raises(SystemExit):
        main(args(lm, tmp_path / "no-data", missing, max_steps=4))
    assert not missing.exists()  # (a run that never began leaves no folder behind)


def test_a_refused_finetune_resume_leaves_its_run_folder_byte_identical(tmp_path, capsys):
    """A fine-tuning run folder is resumed only with the settings that decide its model and data order, and on the
    same data files: otherwise one line naming what differs, before anything in the folder changes (a changed
    dropout or batch size used to be ignored or mixed in silently, and other data read from the saved position)."""
    from test_finetune import args, make_data
    from train_helpers import run_inprocess

    lm = run_inprocess(tmp_path / "lm", train__max_steps=2, train__eval_interval=0)
    data = make_data(tmp_path / "data", "single")
    run = tmp_path / "ft"
    main(args(lm, data, run, max_steps=4, eval_interval=4, checkpoint_interval=4))
    before = tree_digest(run)
    for change, message in (
        ({"dropout": 0.3}, "resuming needs the run's settings (dropout: run None, now 0.3)"),
        ({"batch_size": 4}, "(batch_size: run 8, now 4)"),
    ):
        err = fails(args(lm, data, run, max_steps=8, **change), capsys)
        assert message in err and "or choose another --run_dir" in err
        assert tree_digest(run) == before
    other = make_data(tmp_path / "other", "single", seed=1)
    err = fails(args(lm, other, run, max_steps=8), capsys)
    assert "the run was fine-tuned on another train file than" in err and tree_digest(run) == before
    main(args(lm, data, run, max_steps=8, eval_interval=4, checkpoint_interval=4))  # (as before: it resumes)
    assert (run / "checkpoints" / "step-8").is_dir()


@pytest.mark.parametrize(
    "recipe, message",
    [
        ("model: 5\n", "the section model: must be a mapping of its fields"),
        ("train: [1, 2]\n", "the section train: must be a mapping of its fields"),
        ("model:\n  d_model: 64\nmodel:\n  d_model: 32\n", "line 3: the key 'model' is given twice"),
        ("model:\n  d_model: 64\n  d_model: 32\n", "line 3: the key 'd_model' is given twice"),
        ("x: &x [*x]\n", "line 1: an alias refers to the structure it is part of"),
        (
            "a: &a [1,2,3,4,5,6,7,8,9,10]\n"
            + "".join(
                f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            ),
            "its aliases expand to more than 100,000 values",
        ),  # (10^9 values from 1 kB: it used to hang)
    ],
    ids=["section-int", "section-list", "duplicate-section", "duplicate-field", "recursive-alias", "billion-laughs"],
)
def test_recipes_that_yaml_would_take_silently_or_endlessly_are_one_error(recipe, message, tmp_path, capsys):
    """Duplicate keys (YAML keeps the last), a section that is not a mapping (a traceback), a recursive alias (a
    RecursionError) and an alias bomb (gigabytes, a hang) in a recipe: one line naming the file and the line."""
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe)
    err = fails(["train", "--config", str(path), "--run_dir", str(tmp_path / "run")], capsys)
    assert err.startswith(f"txl: error: {path}: ") and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_refused_resume_leaves_the_run_folder_byte_identical(tmp_path, capsys):
    """A resume with a changed model flag failed with "--resume the checkpoint before it"; following that moved the
    later checkpoint to superseded/ and deleted metrics rows, then failed the same way. A resume on another corpus
    whose vocabulary has the same size went on with remapped ids (and on other text of the same vocabulary, with its
    data position pointing elsewhere). Now all three are refused before anything is touched,
    with no hint that would fail too, and the run folder (lock file included) is byte-identical."""
    from train_helpers import tiny_corpus, train_args
    from txl.data import Tokenizer

    base = dict(train__max_steps=4, train__eval_interval=2, train__checkpoint_interval=2, train__keep_last=5)
    main(train_args(tmp_path, **base))
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step-2").is_dir() and (run / "checkpoints" / "step-4").is_dir()
    capsys.readouterr()
    before = tree_digest(run)
    step2 = str(run / "checkpoints" / "step-2")
    for resume in ("auto", step2):
        args = train_args(tmp_path, **(base | {"train__max_steps": 6, "model__d_inner": 48})) + ["--resume", resume]
        err = fails(args, capsys)
        assert "the checkpoint's model differs from the config (d_inner: checkpoint" in err and "--resume" not in err
        assert tree_digest(run) == before, resume
    other = tiny_corpus(tmp_path / "other", seed=1)
    theirs = Tokenizer.load(run / "checkpoints" / "step-4" / "tokenizer.json")
    args = train_args(tmp_path, **(base | {"train__max_steps": 6})) + ["--resume", step2]
    args[args.index("--data.path") + 1] = str(other)
    args[args.index("--data.cache_dir") + 1] = str(tmp_path / "other-cache")
    err = fails(args, capsys)
    ours = Tokenizer.load(tmp_path / "other-cache")  # (the other corpus's vocabulary, built before the refusal)
    assert ours.vocab_size == theirs.vocab_size and ours.sha256() != theirs.sha256()  # (same size, other ids)
    assert "the checkpoint was trained with another vocabulary" in err and tree_digest(run) == before
    same_symbols = tmp_path / "shuffled"  # the run's text in another order: the same vocabulary, other ids to read
    shutil.copytree(tmp_path / "corpus", same_symbols)
    lines = (same_symbols / "train.txt").read_text().splitlines(keepends=True)
    (same_symbols / "train.txt").write_text("".join(reversed(lines)))
    args[args.index("--data.path") + 1] = str(same_symbols)
    args[args.index("--data.cache_dir") + 1] = str(tmp_path / "shuffled-cache")
    err = fails(args, capsys)
    assert Tokenizer.load(tmp_path / "shuffled-cache").sha256() == theirs.sha256()
    assert "the checkpoint was trained on other text than" in err and tree_digest(run) == before


def test_a_resave_cut_between_its_renames_keeps_the_complete_copy(tmp_path):
    """Re-saving a step deleted the old folder, then renamed the new one in: a crash between left a folder marked
    complete with files missing, or none, and the next prune deleted the complete new copy. Now the old one is
    renamed aside first, and a crash at any point leaves (after recovery, which every save runs) a complete step."""
    from txl.train.checkpoint import MARKER, list_checkpoints, recover_checkpoints

    root = tmp_path / "checkpoints"

    def folder(name: str, content: str, complete: bool = True) -> Path:
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_text(content)
        if complete:
            (root / name / MARKER).write_text("4\n")
        return root / name

    folder(".step-4.old", "old")
    folder(".step-4.partial", "new")  # (cut after the old one was set aside: the new copy is complete)
    recover_checkpoints(tmp_path)
    assert [(s, (p / "model.safetensors").read_text()) for s, p in list_checkpoints(tmp_path)] == [(4, "new")]
    assert sorted(p.name for p in root.iterdir()) == ["step-4"]
    shutil.rmtree(root)
    folder(".step-4.old", "old")
    folder(".step-4.partial", "half", complete=False)  # (the new copy was not complete: the old one goes back)
    recover_checkpoints(tmp_path)
    assert [(s, (p / "model.safetensors").read_text()) for s, p in list_checkpoints(tmp_path)] == [(4, "old")]


def test_data_paths_and_text_are_checked_at_the_edge(tmp_path, capsys):
    """`--data ''` read the current folder as a dataset; `--data /dev/zero` hung; binary standard input to
    `txl tokenize` was an internal codec message. Now each is one line, and a refused train leaves no run folder."""
    from train_helpers import run_inprocess

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    capsys.readouterr()
    assert "--data is empty" in fails(["eval", "--model", str(run), "--data", ""], capsys)
    assert "/dev/zero: not a regular file or folder" in fails(["eval", "--model", str(run), "--data", "/dev/zero"],
                                                             capsys)  # fmt: skip
    for path, message in (("", "--data.path is empty"), ("/dev/zero", "/dev/zero: not a regular file or folder")):
        err = fails(
            ["train", "--data.path", path, "--run_dir", str(tmp_path / "new"), "--train.max_steps", "1"], capsys
        )
        assert message in err and not (tmp_path / "new").exists()
    code = "import sys; from txl.cli import main; main(sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    res = subprocess.run([sys.executable, "-c", code, "tokenize", "--model", str(run)], input=b"ab\xff\xfe cd",
                         capture_output=True, env=env)  # fmt: skip
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and err == (
        "txl: error: standard input: not UTF-8 text (byte 0xff at offset 2); give text, e.g. a .txt file's content"
    )


def test_a_csv_saved_with_a_byte_order_mark_is_read(tmp_path, capsys):
    """A fine-tuning CSV with a UTF-8 BOM (as Excel saves it) was refused as having "no text column"."""
    from test_finetune import args, make_data
    from train_helpers import run_inprocess

    lm = run_inprocess(tmp_path / "lm", train__max_steps=2, train__eval_interval=0)
    data = make_data(tmp_path / "data", "single", fmt="csv", n_train=20)
    for split in ("train", "valid"):
        f = data / f"{split}.csv"
        f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    main(args(lm, data, tmp_path / "ft", max_steps=2, eval_interval=2, checkpoint_interval=2))
    assert (tmp_path / "ft" / "checkpoints" / "step-2").is_dir()


@pytest.mark.parametrize("change", ["fewer-rows", "more-rows", "unknown-variable"])
def test_tf_checkpoints_are_checked_whole(change, tmp_path, monkeypatch):
    """An untied r_w_bias with fewer rows than layers ended in an IndexError traceback, more rows were dropped
    silently, and unknown variables were ignored. Now each is a CheckpointError naming the variable, before anything
    is written."""
    import torch

    import txl.interop.convert_tf as convert_tf
    from txl import CheckpointError
    from txl.interop.tf_checkpoint import read_tf_checkpoint

    src = Path(__file__).parent / "fixtures" / "tf" / "adaptive-untied" / "model"
    tensors = dict(read_tf_checkpoint(src))
    bias = tensors["transformer/r_w_bias"]
    if change == "fewer-rows":
        tensors["transformer/r_w_bias"] = bias[:-1]
    elif change == "more-rows":
        tensors["transformer/r_w_bias"] = torch.cat([bias, bias[:1]])
    else:
        tensors["transformer/layer_0/rel_attn/extra_gate"] = torch.zeros(3)
    monkeypatch.setattr(convert_tf, "read_tf_checkpoint", lambda _: tensors)
    message = "transformer/layer_0/rel_attn/extra_gate" if change == "unknown-variable" else "transformer/r_w_bias has"
    with pytest.raises(CheckpointError, match=message):
        convert_tf.convert_tf_checkpoint(src, tmp_path / "out", mem_len=24, corpus=None)
    assert not (tmp_path / "out").exists()


def test_predict_refuses_empty_texts_and_files_that_are_not_files(tmp_path, capsys):
    """`txl predict --text '[]'` ended in a traceback; a device as --file would be read forever."""
    assert "--text: give a text, or a list of texts" in fails(["predict", "--model", str(tmp_path), "--text", "[]"],
                                                              capsys)  # fmt: skip
    assert "--text: give a text" in fails(["predict", "--model", str(tmp_path), "--text", " "], capsys)
    assert "--file /dev/zero: not a file" in fails(["predict", "--model", str(tmp_path), "--file", "/dev/zero"], capsys)


def test_a_corpus_changed_with_its_size_and_mtime_kept_is_read_again(tmp_path):
    """A data cache was reused when a source file's size and mtime matched, so a file edited in place and given its
    old mtime back (touch -d, a copy that keeps times) trained on the old ids. Now the content decides then."""
    from train_helpers import tiny_corpus
    from txl.data import DataConfig, prepare_corpus

    corpus = tiny_corpus(tmp_path / "corpus")
    cfg = DataConfig(path=str(corpus), dataset="custom", cache_dir=str(tmp_path / "cache"))
    first = prepare_corpus(cfg)
    train = corpus / "train.txt"
    st = train.stat()
    text = train.read_text()
    train.write_text(text[:100] + text[100:200][::-1] + text[200:])  # (the same size, other text)
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert train.stat().st_size == st.st_size and train.stat().st_mtime_ns == st.st_mtime_ns
    before = list(first.splits["train"])
    again = prepare_corpus(cfg)
    fresh = prepare_corpus(DataConfig(path=str(corpus), dataset="custom", cache_dir=str(tmp_path / "fresh")))
    assert list(again.splits["train"]) == list(fresh.splits["train"]) != before


def test_sizes_beyond_the_machine_are_refused_before_allocation(tmp_path, capsys):
    """`txl eval --mem_len 100000000` tried to allocate ~100 GB; `txl train --model.d_model 10000000` ran out of
    memory building the model. Now each is one line saying how much it would need, before anything is allocated
    (and a refused train leaves no run folder). Over a short text the memory holds at most the text's column: eval
    then scores it (its cache is sized by what the text gives), unless the memory starts as mem_len zero vectors."""
    from train_helpers import run_inprocess, train_args

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    text = tmp_path / "text.txt"
    text.write_text((tmp_path / "corpus" / "valid.txt").read_text()[:500])
    capsys.readouterr()
    main(["eval", "--model", str(run), "--data", str(text), "--mem_len", "100000000"])
    assert "mem_len 100000000" in capsys.readouterr().out
    err = fails(["eval", "--model", str(run), "--data", str(text), "--mem_len", "100000000", "--zero_memory", "true"],
                capsys)  # fmt: skip
    assert "txl eval with mem_len 100,000,000" in err and "GiB of memory, more than the" in err
    # probes.md u31: txl generate allocated its cache and died with a traceback after printing the prompt; its
    # cache now holds what the prompt and the new tokens give, unless the memory starts as mem_len zero vectors
    main(["generate", "--model", str(run), "--prompt", "ab", "--mem_len", "100000000", "--max_new_tokens", "5"])
    assert capsys.readouterr().out.startswith("ab")
    err = fails(["generate", "--model", str(run), "--prompt", "ab", "--mem_len", "100000000", "--zero_memory", "true"],
                capsys)  # fmt: skip
    assert "txl generate (2 prompt tokens, mem_len 100,000,000, 1 beam(s))" in err and "GiB of memory, more than" in err
    # probes.md a7: txl attention sized its arrays by mem_len, not by the text, and ran for minutes
    out = tmp_path / "att"
    main(["attention", "--model", str(run), "--data", str(text), "--out", str(out), "--mem_len", "100000000"])
    assert any(out.iterdir())
    args = train_args(tmp_path, "big", model__d_model=10_000_000, train__max_steps=1)
    err = fails(args, capsys)
    assert "parameters (fp32 weights, gradients and Adam's two moments) needs about" in err
    assert not (tmp_path / "big").exists()


def test_the_fp32_route_is_opt_in_and_routes_only_products_checked_exact(tmp_path, capsys, monkeypatch):
    """The oneDNN fp32 route was switched on for the whole process after a check of one 256x512x384 product, while
    a training step runs products of many other shapes. Now a run takes it only when asked (train.fp32_route), and
    then every kind of product (operation, shapes, strides) is checked before the route computes it: with a route
    that computes the larger products in bf16, the run trains bit for bit as on the default path, and its
    checkpoint records the choice and the checks."""
    import txl.train.trainer
    from test_runtime import bf16_when_large
    from train_helpers import final_weights, run_inprocess
    from txl.kernels.runtime import CheckedRoute, RouteChoice
    from txl.train.checkpoint import latest_checkpoint, read_metadata

    def never(**_):
        raise AssertionError("the route was measured although not asked for")

    setting = torch.backends.mkldnn.matmul.fp32_precision
    base = dict(train__max_steps=3, train__eval_interval=3, model__mem_len=8, model__dropout=0.0)
    monkeypatch.setattr(txl.train.trainer, "choose_fp32_matmul", never)
    plain = run_inprocess(tmp_path, "plain", **base)
    assert read_metadata(latest_checkpoint(plain))["fp32_route"] is False
    monkeypatch.setattr(txl.train.trainer, "choose_fp32_matmul", lambda **_: RouteChoice(True, 1.2, True))
    monkeypatch.setattr(txl.train.trainer, "CheckedRoute", lambda: CheckedRoute(call=bf16_when_large))
    routed = run_inprocess(tmp_path, "routed", **base, train__fp32_route="true")
    meta = read_metadata(latest_checkpoint(routed))
    kinds = meta["fp32_route_kinds"]
    assert meta["fp32_route"] is True and kinds["routed"] > 0 and kinds["not_exact"] > 0
    assert "kinds of fp32 product routed through oneDNN" in capsys.readouterr().out
    weights, expected = final_weights(routed), final_weights(plain)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert torch.backends.mkldnn.matmul.fp32_precision == setting  # nothing left set


def test_commands_that_write_into_a_locked_folder_take_its_lock(tmp_path, capsys):
    """One lock for every command that writes a run folder or a corpus cache: `txl convert --overwrite` into a
    checkpoint of a run that is training stops with the run lock's message (the folder byte-identical), and goes
    through once the run is over, leaving the lock file as it was; `txl data prepare` into a cache that another
    process is preparing says so, waits, and then reads the finished cache."""
    from train_helpers import tiny_corpus, txl_process
    from txl.train.checkpoint import RunLock
    from txl.util.fileio import FolderLock

    run = tmp_path / "run"
    main(["convert", "hf", str(CHAR_FIXTURE), str(run / "checkpoints" / "step-1")])
    (run / ".lock").write_text("txl train (pid 1 on elsewhere since then)\n")  # (a run folder, not training now)
    holder = RunLock(run)  # a txl train at work
    try:
        before = tree_digest(run)
        args = ["convert", "hf", str(ADAPTIVE_FIXTURE), str(run / "checkpoints" / "step-1"), "--overwrite", "true"]
        err = fails(args, capsys)
        assert f"{run} is in use by another txl train (pid {os.getpid()} on " in err and "--out" in err
        assert tree_digest(run) == before
    finally:
        holder.release(restore=True)
    lock_file = (run / ".lock").read_text()
    main(args)
    assert TransformerXLLM.load_config(run / "checkpoints" / "step-1").n_token != 64  # (replaced: the adaptive one)
    assert (run / ".lock").read_text() == lock_file

    corpus, cache = tiny_corpus(tmp_path / "corpus"), tmp_path / "cache"
    held = FolderLock(cache, "txl train", option="--data.cache_dir")
    prep = ["data", "prepare", "--data.path", str(corpus), "--data.dataset", "custom", "--data.cache_dir", str(cache)]
    proc = txl_process(prep, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"{cache} is in use by another txl train (pid {os.getpid()}" in line and "waiting" in line, line
        assert not (cache / "meta.json").exists() and proc.poll() is None  # (it waits, and writes nothing)
    finally:
        held.release()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and '"vocab_size"' in out, out


def test_work_that_the_disk_cannot_hold_is_refused_before_it_begins(tmp_path, capsys, monkeypatch):
    """Free disk space is checked where the size is known first (a run's checkpoint, a conversion's weights, a
    corpus's token ids): one line saying how much is needed, and nothing made, instead of a write failing part-way
    after the work."""
    import txl.util.fileio
    from train_helpers import tiny_corpus, train_args

    corpus = tiny_corpus(tmp_path / "corpus")
    monkeypatch.setattr(txl.util.fileio.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 5000))
    cache = tmp_path / "cache"
    prep = ["data", "prepare", "--data.path", str(corpus), "--data.dataset", "custom", "--data.cache_dir", str(cache)]
    with pytest.raises(SystemExit) as e:
        main(prep)
    err = capsys.readouterr().err.splitlines()  # (a line saying what is being prepared, then the error)
    assert e.value.code == 2 and len(err) == 2 and err[0].startswith("preparing corpus")
    assert "corpus's token ids (48,107 bytes of word-level text) needs about" in err[1]
    assert "more than the 4.9 KiB free there: free space, or give --data.cache_dir" in err[1] and not cache.exists()
    err = fails(["convert", "hf", str(CHAR_FIXTURE), str(tmp_path / "out")], capsys)
    assert "needs about" in err and "of disk, more than the 4.9 KiB free there" in err
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    real = shutil.disk_usage
    monkeypatch.setattr(
        txl.util.fileio.shutil, "disk_usage",
        lambda path: real(path)._replace(free=5000) if "run" in str(path) else real(path),
    )  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(train_args(tmp_path, train__max_steps=2))  # (its corpus prepared where the disk has room)
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and "run: a checkpoint of 20,099 parameters needs about" in err
    assert "choose a --run_dir on a disk with more" in err and not (tmp_path / "run").exists()


def test_a_bad_nvidia_model_config_is_one_line_naming_the_file(tmp_path, capsys):
    """`txl convert original` of an NVIDIA checkpoint dict whose model_config is not a mapping of the constructor's
    arguments ended in an internal message ("dictionary update sequence element #0 ...") or a traceback; now one
    line naming the file (random layouts: test_fuzz_inputs)."""
    from safetensors.torch import load_file

    hf = load_file(str(CHAR_FIXTURE / "model.safetensors"))
    aliases = ("attn.r_w_bias", "attn.r_r_bias")
    state = {k.removeprefix("transformer."): v for k, v in hf.items() if not k.endswith(aliases)}
    good = {"n_token": 64, "d_embed": 32, "div_val": 1, "cutoffs": [], "tie_projs": [False], "mem_len": 20}
    for config in ("n_token=64", [1, 2], good | {"n_token": "sixty-four"}, good | {"cutoffs": 5}):
        path = tmp_path / "checkpoint_best.pt"
        torch.save({"model_state": state, "model_config": config}, path)
        err = fails(["convert", "original", str(path), str(tmp_path / "out"), "--trust-pickle"], capsys)
        assert f"txl: error: {path}: " in err and not (tmp_path / "out").exists(), err
