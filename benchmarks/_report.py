"""Writing one benchmark's section into docs/benchmarks.md without touching the others."""

from __future__ import annotations

from pathlib import Path

TITLE = "# Benchmarks\n\nLatest results, with the command that produced them.\n"


def replace_section(path: Path, heading: str, section: str) -> None:
    """Replace the ``heading`` section (up to the next ``## ``) of ``path`` with ``section``, or append it."""
    text = path.read_text() if path.exists() else TITLE
    section = section.rstrip("\n") + "\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[nxt:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
