"""Helpers of the trainer tests: a tiny corpus, `txl train` in-process or as a process, and what a run wrote."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from txl.cli import main
from txl.train.checkpoint import latest_checkpoint
from txl.util.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.yaml"


def tiny_corpus(folder: Path, n_train: int = 40_000, seed: int = 0) -> Path:
    """A char corpus with structure to learn: words from a small lexicon, lines of a few words."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(60)]

    def text(n: int) -> str:
        out, size = [], 0
        while size < n:
            line = " ".join(rng.choice(lexicon) for _ in range(rng.randint(3, 9))).capitalize() + ".\n"
            out.append(line)
            size += len(line)
        return "".join(out)

    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", 4_000), ("test", 4_000)):
        (folder / f"{split}.txt").write_text(text(n))
    return folder


def train_args(tmp: Path, run: str = "run", **overrides) -> list[str]:
    """`txl train` arguments: the debug preset on the tiny corpus in ``tmp`` (made once), run folder ``tmp/run``."""
    corpus = tmp / "corpus"
    if not corpus.exists():
        tiny_corpus(corpus)
    args = ["train", "--config", str(DEBUG), "--data.path", str(corpus), "--data.cache_dir", str(tmp / "cache")]
    args += ["--run_dir", str(tmp / run)]
    for k, v in overrides.items():
        args += [f"--{k.replace('__', '.')}", str(v)]
    return args


def run_inprocess(tmp: Path, run: str = "run", **overrides) -> Path:
    threads = torch.get_num_threads()
    try:
        main(train_args(tmp, run, **overrides))
    finally:
        torch.set_num_threads(threads)
    return tmp / run


def txl_process(args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "txl", *args], env=env, **kw)


def losses(run: Path, split: str = "train") -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if r["split"] == split]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run) / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
