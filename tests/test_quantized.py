"""Quantized models (round 6, item 7): `torch.ao.quantization.quantize_dynamic(model, {nn.Linear})`, the standard
recipe for CPU inference in int8, failed in the model's own forward. A quantized model now runs forward, generation
(greedy, sampling, beam search, streaming), cached evaluation and the server's engine; every fast path declines its
quantized layers in one line, so each path computes what the quantized model's own code computes (with every fast
path off). torchao's int8 weight-only recipe too (its activations are not quantized: cached = uncached). `txl
generate`, `txl eval` and `txl serve` take --quantize."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.cli import main
from txl.infer.quantize import quantize
from txl.kernels import admission
from txl.kernels.backends import Backends, use_backends
from txl.model.cache import KVCache

ALL_OFF = {f: (False if isinstance(getattr(Backends(), f), bool) else ()) for f in Backends.__dataclass_fields__}
CONFIGS = {"plain": {}, "adaptive": dict(cutoffs=[10, 20], div_val=2, d_embed=32)}


def _has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


RECIPES = ["int8", "user-int8", pytest.param("int8-weight-only", marks=pytest.mark.skipif(
    not _has_torchao(), reason="torchao (the extra 'quant') is not installed"))]  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh_checks():
    admission.forget_verified()
    yield
    admission.forget_verified()


def _quantized(recipe: str, config: str) -> TransformerXLLM:
    torch.manual_seed(0)
    m = TransformerXLLM(debug_config(n_token=40, mem_len=16, d_model=32, d_inner=64, n_head=4, **CONFIGS[config]))
    m.eval()
    if recipe == "user-int8":  # (what a user types)
        return torch.ao.quantization.quantize_dynamic(m, {nn.Linear}, dtype=torch.qint8)
    return quantize(m, recipe)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_path_computes_what_the_quantized_model_computes(recipe, config, caplog):
    from txl.infer.generation import beam_search, generate, stream

    caplog.set_level(logging.WARNING, logger="txl")
    q = _quantized(recipe, config)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.isfinite(q(prompt, return_log_probs=True).log_probs).all()
        loss = q(prompt[:, :-1], prompt[:, 1:]).loss
    assert torch.isfinite(loss)

    out = generate(q, prompt, 10, temperature=0.0, mem_len=16)
    with use_backends(**ALL_OFF):
        ref = generate(q, prompt, 10, temperature=0.0, mem_len=16)
        sampled_ref = generate(q, prompt, 8, mem_len=16, generator=torch.Generator().manual_seed(3))
        beams_ref = beam_search(q, prompt[:1], 6, num_beams=3, mem_len=16)
    assert torch.equal(out, ref)
    assert torch.equal(generate(q, prompt, 8, mem_len=16, generator=torch.Generator().manual_seed(3)), sampled_ref)
    assert torch.equal(beam_search(q, prompt[:1], 6, num_beams=3, mem_len=16), beams_ref)
    assert torch.equal(torch.cat(list(stream(q, prompt, 10, temperature=0.0, mem_len=16)), 1), out[:, 5:])

    # cached evaluation (segments of 4 on a KV cache, as txl eval reads) = the same with every fast path off
    def cached() -> torch.Tensor:
        with torch.no_grad():
            cache, parts = KVCache(q.config, 2, 16, 4), []
            for s in range(0, out.shape[1], 4):
                parts.append(q(out[:, s : s + 4], cache=cache, mem_len=16, return_log_probs=True).log_probs)
        return torch.cat(parts, 1)

    got = cached()
    with use_backends(**ALL_OFF):
        torch.testing.assert_close(got, cached(), atol=1e-5, rtol=0)
        with torch.no_grad():
            whole = q(out, mem_len=16, return_log_probs=True).log_probs
    if recipe == "int8-weight-only":  # (no activation quantization: the cache reads as the uncached model does)
        torch.testing.assert_close(got, whole, atol=1e-4, rtol=0)
    declined = [r.getMessage() for r in caplog.records if "declined" in r.getMessage()]
    assert declined and all(line.count("\n") == 0 for line in declined)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_serve_engine_generates_what_the_quantized_model_generates(recipe):
    pytest.importorskip("fastapi", reason="the server needs the extra 'serve'")
    from serve_helpers import engine_tokens
    from txl.infer.generation import generate

    q = _quantized(recipe, "plain")
    prompt = torch.randint(0, 40, (5,), generator=torch.Generator().manual_seed(1)).tolist()
    got = engine_tokens(q, prompt, 8, 16)
    alone = generate(q, torch.tensor([prompt]), 8, temperature=0.0, mem_len=16)[0, len(prompt) :].tolist()
    assert got == alone


def test_quantize_refuses_what_it_cannot_do():
    m = TransformerXLLM(debug_config(n_token=40, d_model=32, d_inner=64, n_head=4))
    with pytest.raises(ValueError, match="model.eval"):
        quantize(m, "int8")
    with pytest.raises(ValueError, match="--quantize int4: must be one of none, int8, int8-weight-only"):
        quantize(m.eval(), "int4")
    with pytest.raises(ValueError, match="runs on the CPU"):
        quantize(m, "int8", "cuda")
    assert quantize(m, "none") is m


def test_txl_eval_and_generate_take_quantize(tmp_path, capsys):
    from train_helpers import run_inprocess

    run = run_inprocess(tmp_path, train__max_steps=30, train__eval_interval=0)
    scores = {}
    for how in ("none", "int8"):
        main(["eval", "--model", str(run), "--quantize", how, "--json", "true", "--max_batches", "4"])
        scores[how] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]
    assert abs(scores["int8"] - scores["none"]) < 0.05 * scores["none"], scores
    main(["generate", "--model", str(run), "--prompt", "Ab", "--max_new_tokens", "8", "--quantize", "int8",
          "--temperature", "0", "--json", "true"])  # fmt: skip
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["new_ids"]) == 8
    pytest.importorskip("fastapi", reason="the server needs the extra 'serve'")
    from fastapi.testclient import TestClient

    from txl.serve.app import ServeLimits, create_app

    with TestClient(create_app(run, ServeLimits(), quantization="int8")) as client:
        res = client.post("/v1/generate", json={"prompt": "Ab", "max_new_tokens": 8, "temperature": 0})
        assert res.status_code == 200, res.text
        assert res.json()["token_ids"] == out["new_ids"]  # (one request alone: the batch of one generate runs)
