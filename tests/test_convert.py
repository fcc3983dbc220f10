"""`txl convert hf`: every reference fixture, HF's extra config fields, tied copies, and every bad input (on the
vendored fixtures, so a plain clone runs all of it; every fixture of ../shared too when it is there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import ADAPTIVE_FIXTURE, CHAR_FIXTURE, HF_FIXTURES, assert_hf_losses
from txl import CheckpointError, TransformerXL, TransformerXLLM
from txl.cli import main as cli_main
from txl.interop.convert import convert_hf_checkpoint, hf_config_to_txl


@pytest.mark.parametrize("name", HF_FIXTURES)
def test_cli_converts_every_fixture(tmp_path, name, capsys):
    fixture = HF_FIXTURES[name]
    cli_main(["convert", "hf", str(fixture), str(tmp_path)])
    assert "TransformerXLLM" in capsys.readouterr().out
    hf_cfg = json.loads((fixture / "config.json").read_text())
    model = TransformerXLLM.from_pretrained(tmp_path)
    cfg = model.config
    assert (cfg.n_token, cfg.cutoffs, cfg.div_val, cfg.d_embed) == (
        hf_cfg["vocab_size"], hf_cfg["cutoffs"], hf_cfg["div_val"], hf_cfg["d_embed"]
    )  # fmt: skip
    assert (cfg.same_length, cfg.clamp_len, cfg.mem_len, cfg.untie_r, cfg.tie_weight) == (
        hf_cfg["same_length"], hf_cfg["clamp_len"], hf_cfg["mem_len"], hf_cfg["untie_r"], hf_cfg["tie_word_embeddings"]
    )  # fmt: skip
    # every HF tensor is represented: tied groups collapse to one parameter
    hf = load_file(str(fixture / "model.safetensors"))
    groups = json.loads((fixture / "tied_params.json").read_text())
    n_hf = sum(t.numel() for k, t in hf.items() if k != "transformer.pos_emb.inv_freq")
    n_dup = sum(hf[k].numel() for g in groups for k in g[1:])
    assert sum(p.numel() for p in model.parameters()) == n_hf - n_dup
    # the converted, saved and reloaded model reproduces the HF outputs (all of them: test_oracle_parity)
    assert_hf_losses(model, fixture)


def test_console_script_runs(tmp_path):
    exe = shutil.which("txl", path=os.path.dirname(sys.executable))
    assert exe, "the txl console script is installed with the package"
    res = subprocess.run([exe, "convert", "hf", str(CHAR_FIXTURE), str(tmp_path / "m")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [exe, "convert", "hf", str(tmp_path / "none"), str(tmp_path / "x")], capture_output=True, text=True
    )
    assert res.returncode == 2 and res.stderr.startswith("txl: error:") and "Traceback" not in res.stderr


def copy_fixture(tmp_path, fixture=ADAPTIVE_FIXTURE):
    dst = tmp_path / "hf"
    dst.mkdir(parents=True)
    shutil.copy(fixture / "config.json", dst / "config.json")
    return dst, load_file(str(fixture / "model.safetensors"))


def test_extra_and_default_config_fields(tmp_path):
    cfg = json.loads((ADAPTIVE_FIXTURE / "config.json").read_text()) | {"untie_r": True, "tie_word_embeddings": False}
    assert len(cfg) > 60  # HF configs carry many fields that we ignore
    ours = hf_config_to_txl({**cfg, "some_future_field": 1})
    assert ours.untie_r and not ours.tie_weight and ours.tie_projs == [False, True, True]
    derived = hf_config_to_txl({k: v for k, v in cfg.items() if k != "tie_projs"} | {"proj_share_all_but_first": False})
    assert derived.tie_projs == [False, False, False]
    with pytest.raises(CheckpointError, match="attn_type 2"):
        hf_config_to_txl({**cfg, "attn_type": 2})
    with pytest.raises(CheckpointError, match=r"TransformerXLConfig\.cutoffs"):
        hf_config_to_txl({**cfg, "cutoffs": [500, 100]})


def test_bad_weight_keys_listed_in_one_error(tmp_path):
    src, hf = copy_fixture(tmp_path)
    hf["transformer.layers.0.dec_attn.extra_net.weight"] = torch.zeros(3)
    del hf["transformer.layers.1.pos_ff.CoreNet.3.bias"]
    hf["transformer.layers.0.dec_attn.o_net.weight"] = torch.zeros(5, 5)
    save_file(hf, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        convert_hf_checkpoint(src, tmp_path / "out")
    msg = str(err.value)
    assert "missing keys: transformer.layers.1.ff.layer_2.bias" in msg
    assert "unexpected keys: transformer.layers.0.dec_attn.extra_net.weight" in msg
    assert "mis-shaped keys: transformer.layers.0.attn.o_net.weight: file (5, 5) vs model (32, 32)" in msg
    assert not (tmp_path / "out").exists()


def test_tied_copies_must_be_equal(tmp_path):
    src, hf = copy_fixture(tmp_path)
    hf["crit.out_projs.2"] = hf["crit.out_projs.2"] + 1
    save_file(hf, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"crit\.out_projs\.2 .*differ"):
        convert_hf_checkpoint(src)
    src2, hf = copy_fixture(tmp_path / "second")
    hf["transformer.layers.1.dec_attn.r_w_bias"] = hf["transformer.r_w_bias"] * 2
    save_file(hf, str(src2 / "model.safetensors"))
    with pytest.raises(CheckpointError, match="r_w_bias.*differ"):
        convert_hf_checkpoint(src2)


def test_hf_file_that_stores_tied_tensors_once(tmp_path):
    """HF's safetensors writer drops the tied aliases (crit.*); the tie is restored from the config."""
    src, hf = copy_fixture(tmp_path)
    whole = convert_hf_checkpoint(ADAPTIVE_FIXTURE)
    for k in ("crit.out_layers.0.weight", "crit.out_layers.1.weight", "crit.out_layers.2.weight"):
        del hf[k]
    for k in ("crit.out_projs.1", "crit.out_projs.2"):
        del hf[k]
    save_file(hf, str(src / "model.safetensors"))
    model = convert_hf_checkpoint(src)
    emb, crit = model.transformer.word_emb, model.crit
    assert crit.out_projs[1] is emb.emb_projs[1] and crit.out_projs[2] is emb.emb_projs[2]
    assert all(o.weight is e.weight for o, e in zip(crit.out_layers, emb.emb_layers, strict=True))
    assert all(a.equal(b) for a, b in zip(model.state_dict().values(), whole.state_dict().values(), strict=True))


def test_pickle_needs_explicit_trust(tmp_path):
    src, hf = copy_fixture(tmp_path)
    torch.save(hf, src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        convert_hf_checkpoint(src)
    model = convert_hf_checkpoint(src, trust_pickle=True)
    ref = convert_hf_checkpoint(ADAPTIVE_FIXTURE)
    assert all(a.equal(b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
    with pytest.raises(SystemExit):  # the CLI accepts --trust-pickle and --trust_pickle
        cli_main(["convert", "hf", str(src), str(tmp_path / "o1")])
    cli_main(["convert", "hf", "--trust-pickle", str(src), str(tmp_path / "o2")])
    assert (tmp_path / "o2" / "model.safetensors").exists()


class Sentinel:  # any non-tensor object makes weights_only refuse the file
    pass


def test_pickle_with_objects_is_refused(tmp_path):
    src, hf = copy_fixture(tmp_path)
    torch.save({**hf, "evil": Sentinel()}, src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        convert_hf_checkpoint(src, trust_pickle=True)


def test_sharded_safetensors_and_bare_base_model(tmp_path):
    src, hf = copy_fixture(tmp_path)
    keys = sorted(hf)
    save_file({k: hf[k] for k in keys[:10]}, str(src / "part1.safetensors"))
    save_file({k: hf[k] for k in keys[10:]}, str(src / "part2.safetensors"))
    weight_map = {k: "part1.safetensors" if i < 10 else "part2.safetensors" for i, k in enumerate(keys)}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = convert_hf_checkpoint(src)
    whole = convert_hf_checkpoint(ADAPTIVE_FIXTURE)
    assert all(a.equal(b) for a, b in zip(sharded.state_dict().values(), whole.state_dict().values(), strict=True))
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    shutil.copy(src / "config.json", base_dir / "config.json")
    base = {k.removeprefix("transformer."): v for k, v in hf.items() if k.startswith("transformer.")}
    save_file(base, str(base_dir / "model.safetensors"))
    model = convert_hf_checkpoint(base_dir, tmp_path / "base_out")
    assert isinstance(model, TransformerXL)
    ids = torch.randint(0, 1000, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).last_hidden_state, whole.transformer(ids).last_hidden_state)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        convert_hf_checkpoint(tmp_path / "nope")
    src, _ = copy_fixture(tmp_path)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        convert_hf_checkpoint(src)
