"""Every recipe in configs/ through the real CLI path: `txl train --config X` hands the trainer the same resolved
configuration as the library loader and as `--print_config` shows, derived defaults (d_embed, tie_projs) follow the
final values, the model has the reference parameter count, and the eight reference recipes carry the original
run_*.sh training settings and eval-branch evaluation settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import txl.train.trainer
from txl.cli import main
from txl.config import ConfigError, RunConfig, load_recipe
from txl.model.modeling import TransformerXLConfig, TransformerXLLM

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


def meta_params(cfg: TransformerXLConfig) -> int:
    with torch.device("meta"):
        model = TransformerXLLM(cfg, init=False)
    return sum(p.numel() for p in model.parameters())  # tied tensors once


@pytest.fixture
def cli_config(monkeypatch):
    """Run `txl train ARGS` through the real command line; return the RunConfig the trainer was handed."""
    seen = []
    monkeypatch.setattr(txl.train.trainer, "train", lambda cfg, resume="auto": seen.append(cfg))

    def run(*args: str) -> RunConfig:
        seen.clear()
        main(["train", *args])
        assert len(seen) == 1
        return seen[0]

    return run


def printed_config(capsys, *args: str) -> RunConfig:
    capsys.readouterr()
    main(["train", *args, "--print_config"])
    return RunConfig.from_dict(yaml.safe_load(capsys.readouterr().out))


@pytest.mark.parametrize("name", ALL)
def test_cli_path_equals_library_loader_and_print_config(name, cli_config, capsys):
    path = str(CONFIGS / name)
    cfg = cli_config("--config", path)
    assert cfg == load_recipe(path)
    assert cfg == printed_config(capsys, "--config", path)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg  # run.json round trip
    assert cfg.run_dir == f"runs/{name.removesuffix('.yaml')}"
    raw = yaml.safe_load((CONFIGS / name).read_text())["model"]
    # The model the trainer builds is the model the YAML describes, field for field (derived ones included).
    by_hand = TransformerXLConfig(**raw)
    assert cfg.model == by_hand
    if "d_embed" not in raw:
        assert cfg.model.d_embed == cfg.model.d_model
    assert meta_params(cfg.model) == meta_params(by_hand)


def test_reference_parameter_counts_through_the_cli(cli_config):
    counts = {name: meta_params(cli_config("--config", str(CONFIGS / f"{name}.yaml")).model) for name in PARAMS}
    assert counts == PARAMS
    assert round(counts["wt103_base"] / 1e6, 1) == 151.1
    assert round(counts["enwik8_base"] / 1e6, 1) == 41.1
    assert round(counts["enwik8_large"] / 1e6, 1) == 277.2


def test_derived_fields_follow_the_final_values(cli_config, capsys, tmp_path):
    debug = str(CONFIGS / "debug.yaml")
    assert cli_config("--config", debug, "--model.d_model", "512").model.d_embed == 512
    assert printed_config(capsys, "--config", debug, "--model.d_model", "512").model.d_embed == 512
    assert load_recipe(debug, {"model": {"d_model": 512}}).model.d_embed == 512
    kept = cli_config("--config", debug, "--model.d_model", "512", "--model.d_embed", "128").model
    assert (kept.d_model, kept.d_embed) == (512, 128)
    explicit = tmp_path / "explicit.yaml"
    explicit.write_text(
        (CONFIGS / "debug.yaml").read_text().replace("  d_model: 32\n", "  d_model: 32\n  d_embed: 24\n")
    )
    assert cli_config("--config", str(explicit), "--model.d_model", "64").model.d_embed == 24
    # tie_projs follows the final cutoffs (one entry per cluster, the head untied)
    cutoffs = cli_config("--config", debug, "--model.cutoffs", "[10, 40]").model
    assert cutoffs.tie_projs == [False, True, True]
    word = cli_config("--config", str(CONFIGS / "shakespeare_word.yaml"), "--model.cutoffs", "[2000, 8000]").model
    assert word.tie_projs == [False, True, True]  # (the word recipe leaves tie_projs to its default)
    # a recipe that sets tie_projs keeps it: new cutoffs without it are an error that says what to give
    with pytest.raises(SystemExit):
        main(["train", "--config", str(CONFIGS / "wt103_base.yaml"), "--model.cutoffs", "[2000, 8000]"])
    err = capsys.readouterr().err
    assert "tie_projs = [False, True, True, True]: needs one entry per cluster" in err
    assert "e.g. the default [False, True, True]" in err
    # no section is built from the defaults of the parser: nothing but the given fields differs from a bare recipe
    bare = tmp_path / "bare.yaml"
    bare.write_text("model:\n  d_model: 96\n  n_head: 4\n")
    model = cli_config("--config", str(bare)).model
    assert model == TransformerXLConfig(d_model=96, n_head=4) and model.d_embed == 96


def test_yaml_numbers_and_overrides_parse_alike(cli_config, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  lr: 2.5e-4\n  eta_min: 1e-6\nmodel:\n  dropout: 0.0\n")
    cfg = cli_config("--config", str(recipe), "--train.max_steps", "7")
    assert cfg.train.lr == 2.5e-4 and cfg.train.eta_min == 1e-6  # YAML 1.1 reads 2.5e-4 as a string
    assert cfg == load_recipe(recipe, {"train": {"max_steps": 7}})


def test_number_lists_on_the_command_line(cli_config):
    """`--model.cutoffs 2000,8000`, `--model.cutoffs=2000,8000` and `--model.cutoffs 2000` (a list of one) as the
    YAML list would give them; `--train.betas 0.9,0.98` too."""
    word = str(CONFIGS / "shakespeare_word.yaml")
    yaml_list = cli_config("--config", word, "--model.cutoffs", "[2000, 8000]", "--train.betas", "[0.9, 0.98]")
    for args in (["--model.cutoffs", "2000,8000"], ["--model.cutoffs=2000,8000"]):
        assert cli_config("--config", word, *args, "--train.betas", "0.9,0.98") == yaml_list
    assert yaml_list.model.cutoffs == [2000, 8000] and yaml_list.train.betas == [0.9, 0.98]
    one = cli_config("--config", word, "--model.cutoffs", "2000").model
    assert one.cutoffs == [2000] and one.tie_projs == [False, True]
    assert cli_config("--config", word, "--model.cutoffs", "[]").model.cutoffs == []


@pytest.mark.parametrize(
    "override, message",
    [
        ({"train": {"threads": -1}}, r"train\.threads = -1"),
        ({"train": {"eval_tgt_len": 40}}, r"train\.eval_tgt_len = 40: .*below 32"),
        ({"eval": {"mem_len": -5}}, r"eval\.mem_len = -5"),
        ({"eval": {"split": "bogus"}}, "split"),
        ({"eval": {"batch_size": 0}}, r"eval\.batch_size = 0"),
        ({"model": {"memory_length": 3}}, "memory_length"),
        ({"train": {"lr": "fast"}}, "train.lr"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(CONFIGS / "debug.yaml", override)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_recipe_settings(name, cli_config):
    cfg = cli_config("--config", str(CONFIGS / f"{name}.yaml"))
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
