"""txl installs beside its user's packages (round 5, issue 64's point 6): pyproject.toml declares ranges, not pins;
`pip install .` into an environment that already holds a supported torch keeps it; the constraints files pin what the
test environments hold. Run in the main environment, and by `make test-oldest` in one with the oldest supported
versions (torch 2.9.1): there the same install keeps that torch."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXACT = {"transformers"}  # (the bench extra's reference implementation: 4.46.3's TransfoXL, exactly)


def test_the_requirements_are_ranges():
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    reqs += [Requirement(r) for extra in PROJECT["optional-dependencies"].values() for r in extra]
    pinned = [str(r) for r in reqs if r.name not in EXACT and any(s.operator in ("==", "===") for s in r.specifier)]
    assert not pinned, f"exact pins belong in constraints/*.txt, not pyproject.toml: {pinned}"
    torch = next(r for r in reqs if r.name == "torch")
    assert (
        torch.specifier.contains("2.9.1") and torch.specifier.contains("2.13.0") and torch.specifier.contains("2.14.1")
    )


def test_installing_txl_keeps_the_torch_already_there(tmp_path):
    """pip's resolver, on this environment's installed packages alone (no index): the one thing it installs is
    transformer-xl itself; the torch already here (2.13.0 in the main environment, 2.9.1 in the oldest) stays."""
    report = tmp_path / "report.json"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--quiet",
         "--report", str(report), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    installs = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]
    assert [name for name, _ in installs] == ["transformer-xl"], installs
    torch = Version(metadata.version("torch"))
    spec = next(Requirement(r) for r in PROJECT["dependencies"] if r.startswith("torch")).specifier
    assert spec.contains(torch.base_version), (torch, spec)


@pytest.mark.skipif(Path(sys.prefix).name not in (".venv", ".venv-oldest"), reason="not one of make's environments")
def test_the_constraints_file_reproduces_this_environment():
    """Every package of this environment at the version its constraints file pins (torch's +cpu label aside)."""
    name = "oldest.txt" if Path(sys.prefix).name == ".venv-oldest" else "main.txt"
    pins = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        if line and not line.startswith("#"):
            pkg, version = line.split("==")
            pins[pkg.lower().replace("_", "-")] = version
    site = [sysconfig.get_paths()["purelib"]]  # (not the vendored dist-infos of a package on sys.path: setuptools')
    here = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in metadata.distributions(path=site)}
    here.pop("transformer-xl", None)
    for tool in ("pip", "setuptools", "wheel"):  # (the venv's own tools)
        here.pop(tool, None)
    wrong = {k: (v, pins.get(k)) for k, v in here.items() if pins.get(k) != v.split("+")[0]}
    assert not wrong, f"installed vs constraints/{name}: {wrong}"
