"""`make test-latest`: the newest release of every integration inside the ranges pyproject.toml declares, tested.

A range is a promise: `make test` tests the lock files' versions (constraints/*.txt) and `make test-oldest` the
floors; this tests the newest versions the registry has today. For each leg (an extra and its suite) it resolves the
extra with no lock file (torch kept at the lock file's version: torch is the user's, and its range is tested at the
floor and at the lock), and compares the integrations' newest versions with the lock file's. Where they are equal,
`make test` already tested them and the leg says so; where one is newer, the leg installs the newest into its own
environment (.venv-latest-LEG, upgraded on every run) and runs its suite there. Exit status: non-zero when a suite
fails or an install fails.

    python tools/test_latest.py [LEG ...]     (legs: hf, keras, main; default: all)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGS = {
    # leg: (extra, its lock file, the integrations it checks, the suite: one command per line)
    "hf": ("hf-test", "hf5.txt", ["transformers", "peft", "accelerate", "huggingface-hub", "tokenizers", "miditok"],
           [["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests_hf"]]),
    "keras": ("keras-test", "keras.txt", ["keras", "jax", "jaxlib", "tensorflow-cpu"],
              [["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--maxprocesses", "4", "tests_keras"]]),
    "main": ("dev,rl,music,serve,quant", "main.txt",
             ["torchrl", "tensordict", "gymnasium", "popgym", "minigrid", "miditok", "symusic", "music21", "torchao"],
             [["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "auto", "--maxprocesses", "4", "-m", "not slow",
               "tests/test_rl_memory.py", "tests/test_rl_acting.py", "tests/test_rl_torchrl.py",
               "tests/test_rl_example.py", "tests/test_music.py", "tests/test_quantized.py"]]),
}  # fmt: skip
KERAS_BACKENDS = ("jax", "tensorflow", "torch")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(lock: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / lock).read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[norm(name)] = version.split(";")[0].strip()
    return pins


def torch_pin() -> Path:
    pin = f"torch=={locked('main.txt')['torch']}\n"
    fd, path = tempfile.mkstemp(suffix=".txt", prefix="txl-torch-")
    os.write(fd, pin.encode())
    os.close(fd)
    return Path(path)


def pip(python: str, *args: str) -> None:
    cmd = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"test-latest: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def newest(extra: str, pin: Path) -> dict[str, str]:
    """The versions pip resolves for `.[extra]` today with no lock file (torch pinned)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip(sys.executable, "--dry-run", "--ignore-installed", "--report", str(report), "-c", str(pin), f".[{extra}]")
        doc = json.loads(report.read_text())
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in doc["install"]}


def run_leg(name: str, pin: Path) -> bool:
    extra, lock, integrations, suite = LEGS[name]
    pins, got = locked(lock), newest(extra, pin)
    newer = {p: (pins.get(p), got[p]) for p in integrations if p in got and got[p] != pins.get(p)}
    if not newer:
        print(f"test-latest {name}: the newest {', '.join(p for p in integrations if p in got)} are the lock file's "
              f"(constraints/{lock}): make test tests them")  # fmt: skip
        return True
    print(
        f"test-latest {name}: newer than the lock file: "
        + ", ".join(f"{p} {old} -> {new}" for p, (old, new) in sorted(newer.items()))
    )
    venv = ROOT / f".venv-latest-{name}"
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip(python, "-c", str(pin), "torch")
    pip(python, "--upgrade", "--upgrade-strategy", "eager", "-c", str(pin), "-e", f".[{extra}]")
    ok = True
    for args in suite:
        runs = [{"KERAS_BACKEND": b} for b in KERAS_BACKENDS] if name == "keras" else [{}]
        for env in runs:
            print(f"test-latest {name}: {' '.join(args)} {env or ''}", flush=True)
            ok &= subprocess.run([python, *args], cwd=ROOT, env={**os.environ, **env}).returncode == 0
    return ok


def main(argv: list[str]) -> int:
    legs = argv or list(LEGS)
    unknown = [leg for leg in legs if leg not in LEGS]
    if unknown:
        print(f"test-latest: no leg {unknown[0]!r} (legs: {', '.join(LEGS)})", file=sys.stderr)
        return 2
    pin = torch_pin()
    try:
        results = {leg: run_leg(leg, pin) for leg in legs}
    finally:
        pin.unlink()
    failed = [leg for leg, ok in results.items() if not ok]
    print(
        f"test-latest: {len(results) - len(failed)} legs passed, {len(failed)} failed"
        + (f": {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
