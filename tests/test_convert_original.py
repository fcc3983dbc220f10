"""`txl convert original`: checkpoints of the original PyTorch code (`torch.save` of the whole model, in today's zip
format and PyTorch 0.4's legacy one, with the vocabulary from the corpus cache) and of NVIDIA's port (a checkpoint
dict). Stand-ins of the original classes (tests/fixtures/original_code) write them in a separate process from the
weights of two Hugging Face fixtures. The converted model gives HF's outputs, its weights equal `txl convert hf`'s,
none of the original code runs while reading, and a pickle that names anything else is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ADAPTIVE_FIXTURE, CHAR_FIXTURE, assert_hf_losses
from txl import CheckpointError, TransformerXLLM
from txl.cli import main
from txl.data import Tokenizer
from txl.data.tokenizer import BYTE_CHARS
from txl.interop.convert import convert_hf_checkpoint
from txl.interop.convert_original import Stub, convert_original_checkpoint, vocab_tokenizer

ORIGINAL_CODE = Path(__file__).parent / "fixtures" / "original_code"
CASES = {"adaptive": (ADAPTIVE_FIXTURE, "wt103"), "char": (CHAR_FIXTURE, "enwik8")}
INIT_ONLY = ("init_std", "init_range", "proj_init_std")  # (not in the original's files: txl's defaults)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("original")
    env = {**os.environ, "PYTHONPATH": str(ORIGINAL_CODE)}
    for name, (fixture, dataset) in CASES.items():
        args = [sys.executable, "save_checkpoints.py", str(fixture), str(out / name), dataset]
        subprocess.run(args, cwd=ORIGINAL_CODE, env=env, check=True, capture_output=True)
    return out


def expected_symbols(dataset: str, n: int) -> list[str]:
    if dataset == "enwik8":
        return [BYTE_CHARS[b] for b in range(32, 32 + n)]
    return ["<eos>", "<unk>"] + [f"w{i}" for i in range(n - 2)]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("file", ["model.pt", "model_legacy.pt", "checkpoint_best.pt"])
def test_cli_converts_original_and_nvidia_checkpoints(saved, name, file, tmp_path, capsys, monkeypatch):
    fixture, dataset = CASES[name]
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("TXL_TEST_MARKS", str(marks))  # a stand-in class that runs leaves a file here
    out = tmp_path / "txl"
    corpus = [] if file == "checkpoint_best.pt" else ["--corpus", str(saved / name / "cache.pt")]
    main(["convert", "original", str(saved / name / file), str(out), *corpus, "--trust-pickle"])
    printed = capsys.readouterr().out
    assert f"converted {saved / name / file} -> {out}: TransformerXLLM" in printed and "tokenizer:" in printed
    assert not any(marks.iterdir()), "the original code ran while its pickle was read"
    model = TransformerXLLM.from_pretrained(out)
    via_hf = convert_hf_checkpoint(fixture)
    ours, theirs = model.state_dict(), via_hf.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for field in INIT_ONLY:
        setattr(via_hf.config, field, getattr(model.config, field))
    assert model.config == via_hf.config  # ties, cutoffs, div_val, mem_len, same_length, clamp_len, ...
    assert_hf_losses(model, fixture)
    tokenizer = Tokenizer.load(out / "tokenizer.json")
    assert tokenizer.symbols == expected_symbols(dataset, model.config.n_token)
    assert tokenizer.kind == ("byte" if dataset == "enwik8" else "word")
    if dataset == "wt103":
        assert tokenizer.line_end == "eos" and tokenizer.unk_token == "<unk>"
        assert tokenizer.encode("w5 w7\n") == [7, 9, 0]


def test_without_trust_or_with_other_globals_nothing_is_read(saved, tmp_path, capsys):
    src = saved / "adaptive" / "model.pt"
    with pytest.raises(SystemExit) as e:
        main(["convert", "original", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is a pickle" in err and "--trust-pickle" in err
    assert not (tmp_path / "out").exists()

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    evil = tmp_path / "evil.pt"
    torch.save({"model_state": {}, "model_config": {"n_token": 3}, "vocab": Payload()}, evil)
    with pytest.raises(CheckpointError, match=r"refused to load (posix|os)\.system.*nothing in it was run"):
        convert_original_checkpoint(evil, trust_pickle=True)
    assert not (tmp_path / "ran").exists()
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, plain)
    with pytest.raises(CheckpointError, match="holds a dict, not a pickled MemTransformerLM or a checkpoint dict"):
        convert_original_checkpoint(plain, trust_pickle=True)


def test_a_folder_converts_the_checkpoint_in_it_and_wrong_paths_are_named_first(saved, tmp_path, capsys):
    """The original's work dir (model.pt) and its data folder (cache.pt) as folders: the same model as the files; a
    missing path, a folder without a checkpoint, a txl model folder and a file that is no pickle: one line each,
    before any question of trust."""
    folder = saved / "adaptive"
    out = tmp_path / "from_folder"
    main(["convert", "original", str(folder), str(out), "--corpus", str(folder), "--trust-pickle"])
    assert f"converted {folder / 'model.pt'} -> {out}: TransformerXLLM" in capsys.readouterr().out
    by_file, _ = convert_original_checkpoint(folder / "model.pt", corpus=folder / "cache.pt", trust_pickle=True)
    ours, theirs = TransformerXLLM.from_pretrained(out).state_dict(), by_file.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert Tokenizer.load(out / "tokenizer.json").symbols[:3] == ["<eos>", "<unk>", "w0"]
    nvidia = tmp_path / "nvidia"
    nvidia.mkdir()
    (nvidia / "checkpoint_best.pt").write_bytes((folder / "checkpoint_best.pt").read_bytes())
    main(["convert", "original", str(nvidia), str(tmp_path / "from_nvidia"), "--trust-pickle"])
    assert f"converted {nvidia / 'checkpoint_best.pt'}" in capsys.readouterr().out
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"hi\n")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "nope.pt")], "nope.pt: not found"),
        ([str(tmp_path / "from_folder"), "--trust-pickle"], "a txl model folder already"),
        ([str(nvidia), "--corpus", str(nvidia), "--trust-pickle"], "nvidia: a folder without cache.pt or cache.pkl"),
        ([str(tmp_path / "empty")], "empty: a folder without model.pt, checkpoint_best.pt, checkpoint_last.pt"),
        ([str(garbage), "--trust-pickle"], "garbage.pt: not a pickle or a PyTorch checkpoint"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            main(["convert", "original", args[0], str(tmp_path / "out"), *args[1:]])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()


def test_a_checkpoint_dict_of_a_wrapped_model_and_other_attention(tmp_path):
    """NVIDIA-style dict of plain tensors saved from a DistributedDataParallel model (keys under module.): the same
    weights; another attention than the paper's is refused by name."""
    hf = load_file(str(CHAR_FIXTURE / "model.safetensors"))
    aliases = ("attn.r_w_bias", "attn.r_r_bias")  # (HF's per-layer copies of the shared u, v)
    state = {f"module.{k.removeprefix('transformer.')}": v for k, v in hf.items() if not k.endswith(aliases)}
    config = {"n_token": 64, "d_embed": 32, "div_val": 1, "cutoffs": [], "tie_projs": [False], "mem_len": 20}
    config |= {"same_length": True, "clamp_len": 8, "dropout": 0.1, "dropatt": 0.0, "attn_type": 0}
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model_state": state, "model_config": config}, path)
    model, tokenizer = convert_original_checkpoint(path, tmp_path / "out", trust_pickle=True)
    assert tokenizer is None and not (tmp_path / "out" / "tokenizer.json").exists()
    assert_hf_losses(model, CHAR_FIXTURE)
    torch.save({"model_state": state, "model_config": {**config, "attn_type": 2}}, path)
    with pytest.raises(CheckpointError, match="attn_type 2 .only the paper's attention"):
        convert_original_checkpoint(path, trust_pickle=True)


def vocab(symbols: list[str], lower_case: bool = False) -> Stub:
    stub = Stub()
    stub.__setstate__({"idx2sym": symbols, "sym2idx": {s: i for i, s in enumerate(symbols)}, "lower_case": lower_case})
    return stub


def test_vocabularies_of_each_dataset_keep_their_ids():
    text8 = vocab_tokenizer(vocab(["_", "e", "t", "a"]), "text8", "cache.pt")
    assert text8.kind == "char" and text8.encode("a te") == [3, 0, 2, 1]  # prep_text8.py wrote spaces as '_'
    lm1b = vocab_tokenizer(vocab(["<S>", "</S>", "<UNK>", "the", "cat"]), "lm1b", "cache.pt")
    assert (lm1b.line_end, lm1b.unk_token) == ("double", "<UNK>") and lm1b.encode("the dog\n") == [0, 3, 2, 0]
    ptb = vocab_tokenizer(vocab(["<eos>", "<unk>", "the"], lower_case=True), "ptb", "cache.pt")
    assert ptb.lower_case and ptb.encode("The\n") == [2, 0]
    enwik8 = vocab_tokenizer(vocab(["32", "101", "60"]), "enwik8", "cache.pt")
    assert enwik8.kind == "byte" and enwik8.drop_newlines and enwik8.encode("e<") == [1, 2]
    with pytest.raises(CheckpointError, match="not byte values"):
        vocab_tokenizer(vocab(["a", "b"]), "enwik8", "cache.pt")
