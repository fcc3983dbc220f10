"""`txl convert tf`: checkpoints of the original TensorFlow code, read without TensorFlow. The fixtures in
tests/fixtures/tf were written by TensorFlow's own Saver (tests/fixtures/tf/make_tf_checkpoints.py) with the TF
code's variable names and the weights of two Hugging Face fixtures: the converted models give HF's outputs and the
weights `txl convert hf` gives, with the TF code's layer-norm epsilon; the vocabulary's pickle is read only when
trusted, and runs nothing."""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import replace

import pytest
import torch

from tests.conftest import ADAPTIVE_FIXTURE, CHAR_FIXTURE, ROOT, assert_hf_losses
from txl import CheckpointError, TransformerXLLM
from txl.cli import main
from txl.data import Tokenizer
from txl.data.tokenizer import BYTE_CHARS
from txl.interop.convert import convert_hf_checkpoint
from txl.interop.convert_tf import convert_tf_checkpoint
from txl.interop.tf_checkpoint import _snappy, read_tf_checkpoint

TF = ROOT / "tests" / "fixtures" / "tf"
# name: (HF fixture, the fixture's memory settings as options, untie_r)
CASES = {
    "adaptive": (ADAPTIVE_FIXTURE, ["--mem_len", "24", "--same_length", "false"], False),
    "adaptive-untied": (ADAPTIVE_FIXTURE, ["--mem_len", "24", "--same_length", "false"], True),
    "char": (CHAR_FIXTURE, ["--mem_len", "20", "--clamp_len", "8", "--same_length", "true"], False),
}


@pytest.mark.parametrize("name", CASES)
def test_cli_converts_tf_checkpoints(name, tmp_path, capsys):
    fixture, settings, untie_r = CASES[name]
    out = tmp_path / "txl"
    main(["convert", "tf", str(TF / name / "model"), str(out), "--trust-pickle", *settings])
    printed = capsys.readouterr().out
    assert f"-> {out}: TransformerXLLM" in printed and "tokenizer:" in printed
    assert printed.count(" (option)") == len(settings) // 2  # (what was not given: a default)
    assert "txl eval --zero_memory true reads as it did" in printed
    assert ("(tf_same_length)" in printed) == ("--same_length true" in " ".join(settings))
    assert TransformerXLLM.from_pretrained(out).config.tf_same_length  # (the TF code's window)
    model = TransformerXLLM.from_pretrained(out, tf_same_length=False)  # HF's fixture outputs: the PyTorch window
    cfg, via_hf = model.config, convert_hf_checkpoint(fixture)
    assert cfg.untie_r == untie_r and cfg.layer_norm_epsilon == 1e-12  # (tf.contrib.layers.layer_norm's)
    for field in ("n_token", "cutoffs", "div_val", "d_embed", "tie_projs", "mem_len", "same_length", "clamp_len"):
        assert getattr(cfg, field) == getattr(via_hf.config, field), field
    ours, theirs = model.state_dict(), via_hf.state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        expected = theirs[k].expand_as(ours[k]) if untie_r and k.endswith(("r_w_bias", "r_r_bias")) else theirs[k]
        assert torch.equal(ours[k], expected), k
    assert_hf_losses(model, fixture)  # (HF computed them with epsilon 1e-5: the same to well under 1e-4)
    tokenizer = Tokenizer.load(out / "tokenizer.json")
    if name == "char":
        assert tokenizer.kind == "byte" and tokenizer.symbols == [BYTE_CHARS[b] for b in range(32, 96)]
    else:
        assert tokenizer.symbols[:3] == ["<eos>", "<unk>", "w0"] and tokenizer.encode("w5 w7\n") == [7, 9, 0]


def test_the_reader_skips_training_state_and_reports_damage(tmp_path):
    tensors = read_tf_checkpoint(TF / "adaptive" / "model" / "model.ckpt-0.index")
    assert tensors["global_step"].dtype == torch.int64 and tensors["global_step"].dim() == 0
    assert any(k.endswith("/Adam") for k in tensors)  # read, and left out by the converter
    copy = tmp_path / "model"
    shutil.copytree(TF / "adaptive" / "model", copy)
    data = copy / "model.ckpt-0.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="its bytes run past the end of data shard 0"):
        read_tf_checkpoint(copy)
    (copy / "model.ckpt-0.index").write_bytes(b"\0" * 100)
    with pytest.raises(CheckpointError, match=r"not a readable TensorFlow checkpoint \(.*no table magic"):
        read_tf_checkpoint(copy)
    # raw snappy: a varint length, a one-byte literal, a copy of 9 from 1 back (overlapping what it writes)
    assert _snappy(bytes([10, 0x00, ord("a"), 0x15, 0x01])) == b"a" * 10


def test_memory_settings_and_the_vocabulary_need_saying(tmp_path, capsys):
    src = str(TF / "adaptive" / "model")
    with pytest.raises(SystemExit) as e:
        main(["convert", "tf", src, str(tmp_path / "a")])
    assert e.value.code == 2 and "holds no memory length; give --mem_len" in capsys.readouterr().err
    main(["convert", "tf", src, str(tmp_path / "b"), "--mem_len", "24"])  # the weights alone, and why
    printed = capsys.readouterr().out
    assert "vocabulary not read: " in printed and "cache.pkl is a pickle" in printed and "--trust-pickle" in printed
    assert (tmp_path / "b" / "model.safetensors").is_file() and not (tmp_path / "b" / "tokenizer.json").exists()

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    evil = tmp_path / "cache.pkl"
    evil.write_bytes(pickle.dumps(Payload(), protocol=2))
    with pytest.raises(CheckpointError, match=r"refused to load (posix|os)\.system.*nothing in it was run"):
        convert_tf_checkpoint(src, corpus=evil, trust_pickle=True, mem_len=24)
    assert not (tmp_path / "ran").exists()


def test_a_projection_the_tf_code_leaves_out_is_the_identity(monkeypatch):
    """proj_same_dim=False (One Billion Word): a cluster already d_model wide has no proj_W, and its softmax no proj;
    the same model as one whose file holds identity matrices there."""
    import txl.interop.convert_tf as convert_tf

    tensors = read_tf_checkpoint(TF / "adaptive" / "model")
    eye = torch.eye(32)
    with_eye = tensors | {
        "transformer/adaptive_embed/cutoff_0/proj_W": eye,
        "transformer/adaptive_softmax/cutoff_0/proj": eye,
    }
    without = {k: v for k, v in with_eye.items() if not k.endswith(("cutoff_0/proj_W", "cutoff_0/proj"))}
    models = []
    for variables in (with_eye, without):
        monkeypatch.setattr(convert_tf, "read_tf_checkpoint", lambda _, v=variables: v)
        models.append(convert_tf_checkpoint(TF / "adaptive" / "model", mem_len=24, corpus=None, trust_pickle=True)[0])
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["transformer.word_emb.emb_projs.0"], eye)


def tf_create_mask(qlen: int, mlen: int, same_length: bool) -> torch.Tensor:
    """tf/model.py's _create_mask, transcribed op for op (1 = masked): matrix_band_part(x, 0, -1) is the upper
    triangle with the diagonal, (x, 0, 0) the diagonal, (x, -1, 0) the lower triangle with the diagonal."""
    ones = torch.ones(qlen, qlen)
    mask_u, mask_dia = torch.triu(ones), torch.diag(torch.diag(ones))
    ret = torch.cat([torch.zeros(qlen, mlen), mask_u - mask_dia], 1)
    if same_length:
        mask_l = torch.tril(ones)
        ret = torch.cat([ret[:, :qlen] + mask_l - mask_dia, ret[:, qlen:]], 1)
    return ret > 0


@pytest.mark.parametrize("qlen, mem_len", [(4, 6), (6, 4), (5, 5), (1, 3), (8, 16)])
def test_tf_same_length_is_the_tf_codes_mask(qlen, mem_len):
    """With the TF code's memory (always mem_len positions, zero-started), tf_same_length's mask is _create_mask's:
    each query sees mem_len + 1 keys; the PyTorch code's window (mem_len keys) masks one more. A model with it gives
    what the PyTorch window of mem_len + 1 gives, also through the K/V cache."""
    from tests.conftest import debug_config
    from txl.infer.evaluate import evaluate
    from txl.model.modeling import causal_mask

    tf = tf_create_mask(qlen, mem_len, same_length=True)
    assert torch.equal(causal_mask(qlen, mem_len, True, mem_len + 1), tf)
    assert torch.equal(causal_mask(qlen, mem_len, False, 0), tf_create_mask(qlen, mem_len, same_length=False))
    assert (causal_mask(qlen, mem_len, True, mem_len) & ~tf).sum() == qlen  # (the PyTorch code's: one key fewer)
    torch.manual_seed(0)
    cfg = debug_config(same_length=True, mem_len=mem_len, clamp_len=-1)
    theirs = TransformerXLLM(cfg).eval()
    ours = TransformerXLLM(replace(cfg, tf_same_length=True)).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randint(0, cfg.n_token, (2, qlen))
    mems = [torch.randn(2, mem_len, cfg.d_model) for _ in range(cfg.n_layer)]
    with torch.no_grad():
        got = ours(x, mems=mems, return_log_probs=True).log_probs
        torch.testing.assert_close(got, theirs(x, mems=mems, mem_len=mem_len + 1, return_log_probs=True).log_probs)
        assert not torch.allclose(got, theirs(x, mems=mems, return_log_probs=True).log_probs)
    ids = torch.randint(0, cfg.n_token, (200,)).numpy()
    kw = dict(batch_size=2, tgt_len=qlen, mem_len=mem_len, zero_memory=True)
    assert evaluate(ours, ids, **kw).loss == pytest.approx(evaluate(ours, ids, cache=False, **kw).loss, rel=1e-6)


@pytest.mark.parametrize("shape", [(8,), ()])
def test_a_bias_of_the_wrong_rank_is_one_error(shape, monkeypatch, tmp_path, capsys):
    """probes.md tf5/tf6: a 1-D or scalar r_w_bias in the file was an IndexError traceback."""
    import txl.interop.convert_tf as convert_tf

    variables = read_tf_checkpoint(TF / "adaptive" / "model") | {"transformer/r_w_bias": torch.zeros(shape)}
    monkeypatch.setattr(convert_tf, "read_tf_checkpoint", lambda _: variables)
    with pytest.raises(SystemExit) as e:
        main(["convert", "tf", str(TF / "adaptive" / "model"), str(tmp_path / "out"), "--mem_len", "24"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"r_w_bias has shape {list(shape)}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
