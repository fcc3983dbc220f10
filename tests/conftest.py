"""Shared test helpers: the tiny `debug` model preset and the paths of the reference fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# Triton's kernels (txl.kernels.fused_attention) run under its interpreter on the CPU in the tests: it reads this
# when triton is imported, so it is set before anything can import it.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Every fast path runs wherever it applies (the tests hold each one to the reference), not only where this machine
# measured it faster (txl.kernels.measured; tests/test_measured.py fakes a measurement): set before txl is imported,
# and inherited by the commands the tests run.
os.environ.setdefault("TXL_MEASURE", "0")
# Under pytest-xdist (make test: -n 2) the machine's cores are shared by the workers: each takes its part, and so do
# the commands it runs (OMP_NUM_THREADS), so that two workers do not run four threads on two cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import pytest  # noqa: E402 (after the environment above)
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from txl import TransformerXLConfig  # noqa: E402

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
