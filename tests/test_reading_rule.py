"""One rule for how a trained model reads text: every command and endpoint that does (txl eval, txl generate,
txl lm-eval, the server's score and generate) takes mem_len / clamp_len / same_length from the options given,
else the run's eval section, else the model's config, and says what it used. (`txl eval` and `/v1/score` read
with the run's evaluation memory, `txl generate` and `/v1/generate` used the model's training memory.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient

from txl import TransformerXLLM
from txl.cli import main
from txl.infer.evaluate import reading_settings
from txl.infer.generation import generate
from txl.serve.app import ServeLimits, create_app
from txl.train.checkpoint import resolve_model_dir

EVAL = {"mem_len": 24, "clamp_len": 12, "same_length": True}  # (the run's eval section; the model trains with 16)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from train_helpers import run_inprocess

    overrides = {f"eval__{k}": str(v).lower() for k, v in EVAL.items()}
    run = run_inprocess(tmp_path_factory.mktemp("rule"), train__max_steps=2, train__eval_interval=0, **overrides)
    folder = resolve_model_dir(run)  # sharp random weights instead: positions and memory change every prediction
    model = TransformerXLLM.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    model.save_pretrained(folder)
    return run


def reference(run, prompt_ids, n, temperature=1.0, **reading):
    """The library's continuation (sampled as txl generate --seed 0 samples), reading as ``reading`` says."""
    model = TransformerXLLM.from_pretrained(resolve_model_dir(run)).eval()
    model.config.clamp_len, model.config.same_length = reading["clamp_len"], reading["same_length"]
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([prompt_ids])
    return generate(model, ids, n, temperature=temperature, mem_len=reading["mem_len"], generator=g)[0].tolist()


def test_every_reader_uses_the_runs_eval_settings_unless_told_otherwise(run, tmp_path, capsys):
    folder = resolve_model_dir(run)
    model_cfg = TransformerXLLM.load_config(folder)
    assert model_cfg.mem_len == 16 and not model_cfg.same_length  # (so that the rule shows)
    s = reading_settings(folder, model_cfg)
    assert {"mem_len": s.mem_len, "clamp_len": s.clamp_len, "same_length": s.same_length} == EVAL

    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    n = 40  # (past the training memory of 16: the memory length matters)
    main(["generate", "--model", str(run), "--prompt_ids", json.dumps(prompt), "--max_new_tokens", str(n),
          "--temperature", "1", "--seed", "0", "--json"])  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    assert got["reading"] == EVAL and prompt + got["new_ids"] == reference(run, prompt, n, **EVAL)
    trained = {"mem_len": 16, "clamp_len": model_cfg.clamp_len, "same_length": False}
    assert reference(run, prompt, n, **trained) != reference(run, prompt, n, **EVAL)  # (the old default differs)
    main(["generate", "--model", str(run), "--prompt_ids", json.dumps(prompt), "--max_new_tokens", str(n),
          "--temperature", "1", "--seed", "0", "--json", "--mem_len", "16", "--clamp_len", str(model_cfg.clamp_len),
          "--same_length", "false"])  # fmt: skip
    assert prompt + json.loads(capsys.readouterr().out)["new_ids"] == reference(run, prompt, n, **trained)

    text = tmp_path / "text.txt"
    text.write_text("Abc def ghi jkl. " * 30)
    main(["eval", "--model", str(run), "--data", str(text), "--json"])
    scored = json.loads(capsys.readouterr().out)
    assert {k: scored[k] for k in EVAL} == EVAL

    with TestClient(create_app(run, ServeLimits())) as client:
        assert client.get("/v1/model").json()["reading"] == EVAL
        body = {"prompt_ids": prompt, "max_new_tokens": n, "temperature": 0}
        served = client.post("/v1/generate", json=body).json()["token_ids"]
        assert prompt + served == reference(run, prompt, n, temperature=0.0, **EVAL)
        score = client.post("/v1/score", json={"text": text.read_text()}).json()
        assert {k: score["settings"][k] for k in EVAL} == EVAL

    from txl.interop.lm_harness import TransformerXLHarnessLM

    lm = TransformerXLHarnessLM(str(run))
    assert {k: getattr(lm.settings, k) for k in EVAL} == EVAL


def test_a_model_folder_without_a_run_reads_with_its_own_config(run, tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(resolve_model_dir(run), folder)
    (folder / "run.json").unlink()
    cfg = TransformerXLLM.load_config(folder)
    main(["generate", "--model", str(folder), "--prompt_ids", "[3, 4]", "--max_new_tokens", "5", "--json"])
    assert json.loads(capsys.readouterr().out)["reading"] == {
        "mem_len": cfg.mem_len, "clamp_len": cfg.clamp_len, "same_length": cfg.same_length,
    }  # fmt: skip


def test_no_reader_writes_its_settings_into_the_models_config(run):
    """The reading settings are passed to the model's calls (``reading=``), never written into ``model.config``: the
    loaded model keeps the config of its folder, and generation with a Reading equals a model whose config says the
    same."""
    from txl.infer.load import load
    from txl.model.config import Reading
    from txl.serve.state import Server

    folder = resolve_model_dir(run)
    saved = TransformerXLLM.load_config(folder)
    loaded = load(run, "cpu", clamp_len=5, same_length=True, mem_len=20)
    assert loaded.model.config == saved and loaded.reading == Reading(20, True, 5)
    assert Server(run, ServeLimits()).model.config == saved
    ids, g = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]]), torch.Generator().manual_seed(0)
    got = generate(loaded.model, ids, 30, generator=g, reading=loaded.reading)[0].tolist()
    assert got == reference(run, ids[0].tolist(), 30, mem_len=20, clamp_len=5, same_length=True)
    assert loaded.model.config == saved
