"""Writing one benchmark's section into docs/benchmarks.md without touching the others."""

from __future__ import annotations

from pathlib import Path

TITLE = "# Benchmarks\n\nLatest results, with the command that produced them.\n"


PAPER_TITLE = "# The paper's experiments with txl\n\nResults, with the commands that made them.\n"


def publish(section: str, path: Path | None, heading: str) -> None:
    """Print an experiment's ``section``; with ``path`` (docs/paper.md), also replace its section there."""
    print(section)
    if path is not None:
        replace_section(path, heading, section, title=PAPER_TITLE)


def replace_section(path: Path, heading: str, section: str, title: str = TITLE) -> None:
    """Replace the ``heading`` section (up to the next ``## ``) of ``path`` with ``section``, or append it (to a new
    file that starts with ``title``)."""
    text = path.read_text() if path.exists() else title
    section = section.rstrip("\n") + "\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
