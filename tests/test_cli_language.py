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
    assert json.loads(capsys.readouterr().out) == plain and plain["tokens"] > 0
    from train_helpers import train_args

    main([*train_args(tmp_path, "other"), "--threads", "1", "--device", "cpu", "--seed", "7", "--print_config", "true"])
    printed = capsys.readouterr().out
    assert "threads: 1" in printed and "device: cpu" in printed and "seed: 7" in printed
    assert set(ALIASES) <= set(COMMANDS)
