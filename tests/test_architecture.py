"""The layering of docs/architecture.md is enforced: import-linter's contract (pyproject.toml) holds on the tree
and breaks when a lower layer imports a higher one; the one declared exception is the model's generate()."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    env = {"PYTHONPATH": str(tree / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([str(exe), "--no-cache", "--config", str(tree / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_layers_hold_and_an_upward_import_breaks_them(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src" / "txl", tree / "src" / "txl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    ok = lint_imports(tree)
    assert ok.returncode == 0 and "1 kept, 0 broken" in ok.stdout, ok.stdout + ok.stderr
    fileio = tree / "src" / "txl" / "fileio.py"
    fileio.write_text(fileio.read_text() + "\n\ndef _late():\n    from txl.checkpoint import RunLock  # noqa\n")
    broken = lint_imports(tree)
    assert broken.returncode != 0 and "txl.fileio -> txl.checkpoint" in broken.stdout, broken.stdout
