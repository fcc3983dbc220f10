"""Parity with Hugging Face TransfoXL (transformers 4.46.3) on the 12 reference fixtures, through the real
converter: log-probs, in-order per-token NLL (both label conventions), memories, hidden states."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ORACLE, ORACLE_NAMES, requires_oracle
from txl import TransformerXLLM
from txl.convert import convert_hf_checkpoint

pytestmark = requires_oracle()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every fixture converted with `convert_hf_checkpoint` and reloaded from the saved txl folder."""
    out = {}
    for name in ORACLE_NAMES:
        dst = tmp_path_factory.mktemp(name)
        convert_hf_checkpoint(ORACLE / name, dst)
        out[name] = TransformerXLLM.from_pretrained(dst)
    return out


def _run_segments(model, inputs, zero_init: bool, grad: bool):
    cfg = model.config
    mems = [torch.zeros(2, cfg.mem_len, cfg.d_model) for _ in range(cfg.n_layer)] if zero_init else None
    results = []
    with torch.set_grad_enabled(grad):
        for s in range(3):
            ids = inputs[f"seg{s}.input_ids"]
            out = model(ids, inputs[f"seg{s}.targets"], mems=mems, return_log_probs=True, output_hidden_states=True)
            hf_style = model(ids, labels=inputs[f"seg{s}.labels"], mems=mems)
            results.append((out, hf_style))
            mems = out.mems
    return results


@pytest.mark.parametrize("name", ORACLE_NAMES)
@pytest.mark.parametrize("zero_init", [False, True], ids=["empty_init", "zero_mems"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference_path", "training_path"])
def test_matches_hf(converted, name, zero_init, grad):
    atol = 1e-4 if name.endswith("-sharp") else 1e-5
    d = ORACLE / name
    inputs = load_file(str(d / "inputs.safetensors"))
    ref = load_file(str(d / ("outputs.safetensors" if zero_init else "outputs_empty_init.safetensors")))
    model = converted[name]
    n_layer, mem_len = model.config.n_layer, model.config.mem_len

    def close(actual, key, time_major=False):
        expected = ref[key].transpose(0, 1) if time_major else ref[key]  # HF mems are [M, B, D]
        assert actual.shape == expected.shape, key
        torch.testing.assert_close(actual.detach(), expected, atol=atol, rtol=0, msg=key)

    for s, (out, hf_style) in enumerate(_run_segments(model, inputs, zero_init, grad)):
        close(out.log_probs, f"seg{s}.log_probs")
        close(out.losses, f"seg{s}.nll_targets")  # per token, input order
        close(hf_style.losses, f"seg{s}.losses_ordered")
        close(out.last_hidden_state, f"seg{s}.last_hidden_state")
        for i in range(n_layer + 1):
            close(out.hidden_states[i], f"seg{s}.hidden_states.{i}")
        expected_len = mem_len if zero_init else min(16 * (s + 1), mem_len)
        for layer in range(n_layer):
            assert out.mems[layer].shape[1] == expected_len
            close(out.mems[layer], f"seg{s}.mems.{layer}", time_major=True)
