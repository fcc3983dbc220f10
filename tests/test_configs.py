"""Every recipe in configs/ parses with the CLI, builds its model on the meta device, and the eight reference
recipes carry the original run_*.sh training settings and eval-branch evaluation settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from txl.cli import main
from txl.config import load_recipe
from txl.modeling import TransformerXLLM

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(p.name for p in CONFIGS.glob("*.yaml"))

# (n_layer, d_model, n_head, d_head, d_inner, dropout, dropatt, warmup, max_step, tgt_len, mem_len, eval_tgt_len,
#  batch) from the reference run_*.sh (train branch) and (eval batch, tgt_len, mem_len, clamp_len) from eval.
REFERENCE = {
    "wt103_base": ((16, 410, 10, 41, 2100, 0.1, 0.0, 0, 200_000, 150, 150, 150, 60), (10, 64, 640, 400)),
    "wt103_large": ((18, 1024, 16, 64, 4096, 0.2, 0.2, 16_000, 4_000_000, 384, 384, 128, 128), (10, 128, 1600, 1000)),
    "enwik8_base": ((12, 512, 8, 64, 2048, 0.1, 0.0, 0, 400_000, 512, 512, 128, 22), (10, 80, 2100, 820)),
    "enwik8_large": ((24, 1024, 8, 128, 3072, 0.15, 0.15, 4000, 400_000, 768, 768, 128, 64), (10, 128, 3800, 1000)),
    "text8_base": ((12, 512, 8, 64, 2048, 0.1, 0.0, 0, 400_000, 512, 512, 128, 22), (10, 80, 2100, 820)),
    "text8_large": ((24, 1024, 8, 128, 3072, 0.15, 0.15, 0, 400_000, 768, 768, 128, 64), (10, 128, 3800, 1000)),
    "lm1b_base": ((18, 1024, 8, 128, 4096, 0.0, 0.0, 20_000, 500_000, 32, 32, 32, 224), (64, 32, 128, -1)),
    "lm1b_large": ((24, 1280, 16, 80, 8192, 0.05, 0.05, 30_000, 1_200_000, 32, 32, 32, 512), (8, 32, 128, -1)),
}
# Total parameters of the original MemTransformerLM for these recipes (research/original_code.md 1.13).
PARAMS = {
    "wt103_base": 151_107_538,
    "wt103_large": 285_170_506,
    "enwik8_base": 41_055_436,
    "enwik8_large": 277_231_820,
    "text8_base": 40_964_635,
    "text8_large": 277_050_395,
}


def meta_params(cfg) -> int:
    with torch.device("meta"):
        model = TransformerXLLM(cfg, init=False)
    return sum(p.numel() for p in model.parameters())  # tied tensors once


@pytest.mark.parametrize("name", ALL)
def test_recipe_parses_with_the_cli_and_builds(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(CONFIGS / name), "--print_config"])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    cfg = load_recipe(CONFIGS / name)
    assert f"n_layer: {cfg.model.n_layer}" in printed and f"batch_size: {cfg.train.batch_size}" in printed
    cfg.train.validate()
    assert meta_params(cfg.model) > 0
    assert cfg.run_dir == f"runs/{name.removesuffix('.yaml')}"


def test_reference_parameter_counts():
    counts = {name: meta_params(load_recipe(CONFIGS / f"{name}.yaml").model) for name in PARAMS}
    assert counts == PARAMS
    assert round(counts["wt103_base"] / 1e6, 1) == 151.1
    assert round(counts["enwik8_base"] / 1e6, 1) == 41.1
    assert round(counts["enwik8_large"] / 1e6, 1) == 277.2


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_recipe_settings(name):
    cfg = load_recipe(CONFIGS / f"{name}.yaml")
    m, t, e = cfg.model, cfg.train, cfg.eval
    train, evaluation = REFERENCE[name]
    assert (
        m.n_layer, m.d_model, m.n_head, m.d_head, m.d_inner, m.dropout, m.dropatt, t.warmup_steps, t.max_steps,
        t.tgt_len, m.mem_len, t.eval_tgt_len, t.batch_size,
    ) == train  # fmt: skip
    assert (e.batch_size, e.tgt_len, e.mem_len, e.clamp_len) == evaluation
    assert e.same_length and e.split == "test"
    assert (t.optimizer, t.lr, t.scheduler, t.eta_min, t.clip, t.seed) == ("adam", 0.00025, "cosine", 0.0, 0.25, 1111)
    assert m.d_embed == m.d_model and m.tie_weight and not m.pre_lnorm and m.init_std == 0.02
    assert not m.same_length and m.clamp_len == -1  # training: no same_length, no clamping
    adaptive = name.startswith(("wt103", "lm1b"))
    assert bool(m.cutoffs) == adaptive
    if name.startswith("wt103"):
        assert m.cutoffs == [20000, 40000, 200000] and m.tie_projs == [False, True, True, True]
    if name.startswith("lm1b"):
        assert m.cutoffs == [60000, 100000, 640000] and m.tie_projs == [False] * 4 and m.div_val == 4
    if name.startswith("enwik8"):
        assert m.n_token == 204 and cfg.data.paper_compatible
