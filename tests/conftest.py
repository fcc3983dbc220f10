"""Shared test helpers: the tiny `debug` model preset and the paths of the reference fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# Triton's kernels (txl.kernels.fused_attention) run under its interpreter on the CPU in the tests: it reads this
# when triton is imported, so it is set before anything can import it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from txl import TransformerXLConfig

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT.parent / "shared" / "oracle" / "hf"
ORACLE_NAMES = sorted(p.name for p in ORACLE.iterdir() if (p / "config.json").exists()) if ORACLE.exists() else []
VENDORED = ROOT / "tests" / "fixtures" / "hf"  # two of them, in the repository (tests/fixtures/vendor_hf.py)
# Every Hugging Face reference fixture available: the vendored ones always, the full set of ../shared when present.
HF_FIXTURES = {f"vendored/{p.name}": p for p in sorted(VENDORED.iterdir()) if (p / "config.json").exists()}
HF_FIXTURES |= {f"shared/{name}": ORACLE / name for name in ORACLE_NAMES}
ADAPTIVE_FIXTURE = VENDORED / "word-adaptive-div4-sharp"  # adaptive input/softmax, tied projections
CHAR_FIXTURE = VENDORED / "same-length-clamp-sharp"


def assert_hf_losses(model, fixture: Path, segments: int = 3) -> None:
    """The fixture's segments, from the memory its outputs start from (HF's zeros, or the original code's empty
    memory where the fixture has those outputs), give the per-token NLL that HF computed."""
    from safetensors.torch import load_file

    inputs = load_file(str(fixture / "inputs.safetensors"))
    empty = (fixture / "outputs_empty_init.safetensors").exists()
    ref = load_file(str(fixture / ("outputs_empty_init.safetensors" if empty else "outputs.safetensors")))
    cfg = model.config
    mems = None if empty else [torch.zeros(2, cfg.mem_len, cfg.d_model) for _ in range(cfg.n_layer)]
    with torch.no_grad():
        for s in range(segments):
            out = model(inputs[f"seg{s}.input_ids"], inputs[f"seg{s}.targets"], mems=mems)
            torch.testing.assert_close(out.losses, ref[f"seg{s}.nll_targets"], atol=1e-4, rtol=0)
            mems = out.mems


def debug_config(**overrides) -> TransformerXLConfig:
    """The tiny `debug` preset every test starts from (dropout off so outputs are deterministic)."""
    base = dict(
        n_token=97, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, dropout=0.0, dropatt=0.0,
        mem_len=8, init_std=0.3, proj_init_std=0.3,
    )  # fmt: skip
    base.update(overrides)
    return TransformerXLConfig(**base)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _backends():
    """A test may choose fast paths with txl.kernels.backends.set_backends: the process's policy is put back after
    it."""
    from txl.kernels.backends import set_backends

    before = set_backends()
    yield
    set_backends(before)
