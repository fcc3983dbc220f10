"""Every `txl` command in the README and the docs pages parses as written (its subcommand and options exist and
take the values shown), and every page the README links to exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from txl.cli import build_parser, normalize_argv

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands(page: Path) -> list[str]:
    """The `txl ...` lines of a page's bash blocks (continuation lines joined, comments dropped)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r" #| \| | && | > | &$", line, maxsplit=1)[0].strip()  # (the txl command of a shell line)
            if line.startswith("txl ") and "lm-eval" not in line and "..." not in line:
                found.append(line)
    return found


CASES = [(page.relative_to(ROOT), line) for page in PAGES for line in commands(page)]


def test_the_pages_hold_commands():
    assert len(CASES) >= 30 and any(str(p) == "README.md" for p, _ in CASES)


@pytest.mark.parametrize("page, line", CASES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CASES)])
def test_each_command_parses_as_written(page, line):
    top, _ = build_parser()
    argv = shlex.split(line)[1:]
    try:
        top.parse_args(normalize_argv(argv))
    except SystemExit as e:  # (jsonargparse exits on --help only)
        assert e.code == 0, line


def test_every_linked_page_exists():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"
