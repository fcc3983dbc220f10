"""Shared test helpers: the tiny `debug` model preset and the paths of the reference fixtures."""

from __future__ import annotations

from pathlib import Path

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
