"""Writing one benchmark's section into docs/benchmarks.md without touching the others."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

TITLE = "# Benchmarks\n\nLatest results, with the command that produced them.\n"


PAPER_TITLE = "# The paper's experiments with txl\n\nResults, with the commands that made them.\n"


def tree_digest(root: Path) -> str:
    """12 hex digits of SHA-256 over the code a benchmark runs (src/txl and benchmarks/: paths and bytes). A copied
    tree can carry another commit's git metadata (the lent GPU machine's copy reports the session's first commit), so
    a result also names its code by content: ``python benchmarks/_report.py ROOT`` prints it for any checkout."""
    h = hashlib.sha256()
    files = [f for d in ("src/txl", "benchmarks") for f in (root / d).rglob("*") if f.is_file()]
    for f in sorted(files):
        rel = f.relative_to(root).as_posix()
        if f.suffix in (".py", ".c", ".h", ".sh", ".cpp") and "/results/" not in rel and "__pycache__" not in rel:
            h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def code_version(root: Path) -> str:
    """``git describe --always --dirty`` and the tree's digest (:func:`tree_digest`): "a059ddd (tree 3f2c...)"."""
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=root)
    return f"{described.stdout.strip() or 'unknown'} (tree {tree_digest(root)})"


def publish(section: str, path: Path | None, heading: str, title: str = PAPER_TITLE) -> None:
    """Print an experiment's or a benchmark's ``section``; with ``path`` (docs/paper.md, docs/benchmarks.md), also
    replace its section there."""
    print(section)
    if path is not None:
        replace_section(path, heading, section, title=title)


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


class MatmulFlops(TorchDispatchMode):
    """FLOPs of the matrix products that run inside it (``torch.utils.flop_counter``'s formulas), counted without
    ``FlopCounterMode``'s module tracker: that tracker installs global module hooks, and txl calls a linear layer
    that has hooks instead of reading its weight (so an adapter sees the call), which for the adaptive softmax's
    output layer (div_val 1) computes the whole vocabulary per cluster. Counted under FlopCounterMode, a step would be
    another computation than the one timed (from fd2501a to a059ddd the GPU tables' MFU were ~2.6x too high)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **(kwargs or {}), out_val=out)
        return out


if __name__ == "__main__":  # the digest of a checkout: python benchmarks/_report.py [ROOT]
    print(tree_digest(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])))


def median_time(fn, repeats: int = 5) -> float:  # noqa: ANN001
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call (a benchmark's table; the package's own
    choices are timed by txl.kernels.measured.paired)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
