"""One command language: `txl --help` gives each command a whole first sentence, and each command takes the names
the others use for the same thing (`txl eval --data.path` as `txl train` says it, `txl train --threads` as every
other command says it)."""

from __future__ import annotations

import json

import pytest

from txl.cli import ALIASES, COMMANDS, _description, _summary, main


def commands(tree=COMMANDS):
    for target in tree.values():
        if isinstance(target, dict):
            yield from commands(target)
        else:
            yield target


@pytest.mark.parametrize("target", list(commands()), ids=lambda t: t.__name__)
def test_every_summary_is_a_whole_sentence(target):
    summary = _summary(target)
    assert summary.endswith((".", ")")) and " ".join(_description(target).split()).startswith(summary)
    assert len(summary) >= 20


def test_help_lists_every_command_with_its_whole_summary(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    printed = " ".join(capsys.readouterr().out.split())
    for target in commands(COMMANDS):
        if target.__module__.startswith("txl.cli.") and target.__name__ in COMMANDS:
            assert _summary(target) in printed, target.__name__


def test_the_options_of_one_command_work_in_the_others(tmp_path, capsys):
    from train_helpers import run_inprocess

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    text = tmp_path / "text.txt"
    text.write_text("Abc def ghi. " * 40)
    capsys.readouterr()
    main(["eval", "--model", str(run), "--data", str(text), "--json", "true"])
    plain = json.loads(capsys.readouterr().out)
    main(["eval", "--model", str(run), "--data.path", str(text), "--json", "true"])
    again = json.loads(capsys.readouterr().out)
    timing = ("seconds", "tokens_per_s")  # (the scoring's speed: the one part that differs between two runs)
    assert {k: v for k, v in again.items() if k not in timing} == {k: v for k, v in plain.items() if k not in timing}
    assert plain["tokens"] > 0 and plain["tokens_per_s"] == pytest.approx(plain["tokens"] / plain["seconds"])
    main(["eval", "--model", str(run), "--data", str(text)])
    assert f"{plain['tokens']:,} tokens, " in capsys.readouterr().out.split(" tokens/s |")[0]
    from train_helpers import train_args

    main([*train_args(tmp_path, "other"), "--threads", "1", "--device", "cpu", "--seed", "7", "--print_config", "true"])
    printed = capsys.readouterr().out
    assert "threads: 1" in printed and "device: cpu" in printed and "seed: 7" in printed
    assert set(ALIASES) <= set(COMMANDS)


def test_an_option_given_before_config_is_not_replaced_by_the_file(tmp_path, capsys):
    """`txl train --run_dir A --config R`: the option wins over the recipe's value wherever --config stands (the
    parser applies arguments in order; txl reads the recipe first), as in `--config R --run_dir A`."""
    from pathlib import Path

    import yaml

    recipe = Path(__file__).resolve().parents[1] / "configs" / "debug.yaml"
    printed = []
    for args in (["--run_dir", str(tmp_path / "a"), "--train.lr", "0.5", "--config", str(recipe)],
                 ["--config", str(recipe), "--run_dir", str(tmp_path / "a"), "--train.lr", "0.5"],
                 [f"--run_dir={tmp_path / 'a'}", "--train.lr=0.5", f"--config={recipe}"]):  # fmt: skip
        main(["train", *args, "--print_config"])
        printed.append(yaml.safe_load(capsys.readouterr().out))
    assert printed[0] == printed[1] == printed[2]
    assert printed[0]["run_dir"] == str(tmp_path / "a") and printed[0]["train"]["lr"] == 0.5
    assert yaml.safe_load(recipe.read_text())["run_dir"] != str(tmp_path / "a")  # (the file says otherwise)
    assert not (tmp_path / "a").exists()
