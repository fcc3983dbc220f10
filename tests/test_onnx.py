"""`txl export onnx`: the exported step matches PyTorch (checked right after export, also with adaptive softmax
and same_length), examples/onnx_generate.py generates without PyTorch the same greedy tokens as `txl generate`, and
what cannot be exported is one error naming the option."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from conftest import debug_config  # noqa: E402
from txl.cli import main  # noqa: E402
from txl.model.modeling import TransformerXLLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def exported_diff(out: str) -> float:
    return float(out.split("max |diff| ")[1].split()[0])


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from train_helpers import run_inprocess

    return run_inprocess(tmp_path_factory.mktemp("onnx"), train__max_steps=150, train__lr=0.01, train__eval_interval=0)


def test_exported_step_generates_what_txl_generate_does_without_torch(lm, tmp_path, capsys):
    """A model with sharp random weights (a tiny trained one repeats one character greedily) and the tokenizer of a
    trained run: 60 greedy tokens, 6 times past the memory of 16."""
    import shutil

    import torch

    from txl.train.checkpoint import resolve_model_dir

    torch.manual_seed(0)
    model = tmp_path / "sharp"
    TransformerXLLM(debug_config(n_token=35, init_std=0.3, init_range=0.6)).save_pretrained(model)
    shutil.copyfile(resolve_model_dir(lm) / "tokenizer.json", model / "tokenizer.json")
    lm = model
    onnx_file = tmp_path / "model.onnx"
    main(["export", "onnx", "--model", str(lm), "--out", str(onnx_file), "--last_only"])
    out = capsys.readouterr().out
    assert onnx_file.is_file() and (tmp_path / "model.tokenizer.json").is_file()
    assert exported_diff(out) <= 1e-4

    prompt = "Abc def gh"
    main(["generate", "--model", str(lm), "--prompt", prompt, "--max_new_tokens", "60", "--temperature", "0",
          "--json"])  # fmt: skip
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_ids"]
    code = (  # torch made unimportable: the example must not need it
        "import sys, runpy; sys.modules['torch'] = None; "
        f"sys.argv = ['onnx_generate.py', '--onnx', {str(onnx_file)!r}, '--prompt', {prompt!r}, "
        "'--max_new_tokens', '60', '--json']; "
        f"runpy.run_path({str(ROOT / 'examples' / 'onnx_generate.py')!r}, run_name='__main__')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["ids"] == want and len(want) == 60
    assert len(set(want)) >= 3  # not one token repeated (seeded weights: a fixed continuation)


@pytest.mark.slow  # (~25 s: an export and its check in a process of its own; CI runs it)
def test_adaptive_softmax_and_same_length_export_within_tolerance(tmp_path):
    """Through the txl command as a user runs it: the one line of the report, and nothing from torch's exporter
    about itself (the torchvision operators it skips, its deprecations) on stderr."""
    cfg = debug_config(n_token=300, cutoffs=[40, 120], div_val=2, d_embed=32, same_length=True, mem_len=12)
    TransformerXLLM(cfg).save_pretrained(tmp_path / "model")
    cmd = [sys.executable, "-m", "txl", "export", "onnx", "--model", str(tmp_path / "model")]
    res = subprocess.run([*cmd, "--out", str(tmp_path / "m.onnx")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert exported_diff(res.stdout) <= 1e-4
    import onnx

    meta = {p.key: json.loads(p.value) for p in onnx.load(str(tmp_path / "m.onnx")).metadata_props}
    assert meta["txl.same_length"] == 1 and meta["txl.mem_len"] == 12 and meta["txl.n_token"] == 300


@pytest.mark.parametrize(
    "overrides, args, message",
    [
        ({"attn_type": 2}, [], "attn_type 2 (absolute positions"),
        ({}, ["--mem_len", "0"], "mem_len = 0"),
        ({}, ["--tolerance", "1e-15"], "onnxruntime differs from PyTorch by"),
    ],
)
def test_what_cannot_be_exported_is_one_error_naming_it(overrides, args, message, tmp_path, capsys):
    TransformerXLLM(debug_config(**overrides)).save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as e:
        main(["export", "onnx", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "m.onnx"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_an_existing_tokenizer_beside_the_output_is_not_replaced_without_overwrite(tmp_path, capsys):
    """probes.md n50: --overwrite covers the .onnx file and its tokenizer beside it; without it, a file of the user's
    at OUT.tokenizer.json is one error, and nothing is written."""
    from txl.data import Tokenizer

    model = tmp_path / "model"
    TransformerXLLM(debug_config()).save_pretrained(model)
    Tokenizer.bytes256().save(model / "tokenizer.json")
    mine = tmp_path / "m.tokenizer.json"
    mine.write_text("the user's own file")
    with pytest.raises(SystemExit) as e:
        main(["export", "onnx", "--model", str(model), "--out", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{mine}, which exists" in err and err.count("\n") == 1, err
    assert mine.read_text() == "the user's own file" and not (tmp_path / "m.onnx").exists()
