"""The experiment scripts run end to end, through the `txl` command, on a tiny corpus (slow: they train)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from train_helpers import ROOT, tiny_corpus


@pytest.mark.slow
def test_recurrence_experiment_writes_its_tables(tmp_path):
    corpus = tiny_corpus(tmp_path / "corpus")
    out = tmp_path / "paper.md"
    cmd = [sys.executable, str(ROOT / "experiments" / "recurrence.py"), "--steps", "6", "--tokens", "600"]
    cmd += ["--data", str(corpus), "--runs", str(tmp_path / "runs"), "--cache_dir", str(tmp_path / "cache")]
    cmd += ["--mem", "0,32,64", "--contexts", "16,32,48", "--write", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    assert text.startswith("# The paper's experiments with txl")
    rows = {m: re.search(rf"^\| {m} \|(.*)\|$", text, re.M) for m in ("xl", "no-recurrence")}
    for m, row in rows.items():
        values = [float(v) for v in row.group(1).split("|")]
        assert len(values) == 3 and all(0 < v < 10 for v in values), m  # bpc at memory 0, 32 and 64
    assert re.search(r"sliding_window 64`, one prediction per window, no memory\): \d+\.\d{4} bpc", text)
    for m in ("xl", "no-recurrence"):  # RECL at three ratios (whole numbers: context lengths)
        assert re.search(rf"^\| {m} \| \d+\+? \| \d+\+? \| \d+\+? \|$", text, re.M), m
    assert "Reading: the best bpc over the sweep is" in text
    for png in ("xl_sweep.png", "no-recurrence_sweep.png", "recl.png"):
        assert (tmp_path / "img" / f"recurrence_{png}").stat().st_size > 1000
    for name in ("xl_sweep.png", "no-recurrence_sweep.png", "recl.png", "recl.json"):
        assert (tmp_path / "runs" / name).stat().st_size > 100


@pytest.mark.slow
def test_ablation_experiment_quick_mode(tmp_path):
    """experiments/ablation.py (the quick budget with few steps, on a tiny corpus): seven rows, parameter counts
    within 2% of the xl row, init/best/attention length consistent with the per-length table; a rerun resumes
    (trains nothing, scores nothing again)."""
    corpus = tiny_corpus(tmp_path / "corpus")
    out = tmp_path / "paper.md"
    cmd = [sys.executable, str(ROOT / "experiments" / "ablation.py"), "--budget", "quick", "--steps", "4"]
    cmd += ["--tokens", "500", "--lengths", "32", "--data", str(corpus), "--runs", str(tmp_path / "runs")]
    cmd += ["--cache_dir", str(tmp_path / "cache"), "--write", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp_path)
    text = out.read_text()
    rows = re.findall(r"^\| ([a-z-]+) \| (yes|no) \| [^|]+ \| (full|half) \| ([\d,]+) \| (\d\.\d{4}) \((\d+)\) \| "
                      r"(\d\.\d{4}) \| (\d+) \|", text, re.M)  # fmt: skip
    assert [r[0] for r in rows] == ["xl", "shaw-rec", "xl-half", "xl-norec", "shaw-norec", "vaswani-norec-half",
                                    "alrfou-half"]  # fmt: skip
    params = [int(r[3].replace(",", "")) for r in rows]
    assert all(abs(p - params[0]) <= 0.02 * params[0] for p in params)
    sweep = {m.group(1): [float(v) for v in m.group(2).split("|") if v.strip()]
             for m in re.finditer(r"^\| ([a-z-]+) \|((?: \d\.\d{4} \|)+)$", text, re.M)}  # fmt: skip
    lengths = [int(a) for a in re.findall(r"\| A=(\d+)", text)]
    assert lengths == [32, 64, 128]  # the sweep plus both training attention lengths (tgt_len, tgt_len + mem_len)
    for name, rec, _, _, init, train_len, best, attn_len in rows:
        by_len = dict(zip(lengths, sweep[name], strict=True))
        assert int(train_len) == (128 if rec == "yes" else 64)
        assert float(init) == pytest.approx(by_len[int(train_len)], abs=1e-4)
        assert float(best) == pytest.approx(min(by_len.values()), abs=1e-4) and by_len[int(attn_len)] == float(best)
    assert "Reading (computed from the table):" in text and (tmp_path / "img" / "ablation.png").stat().st_size > 1000
    for m in ("xl", "xl-norec", "alrfou-half"):  # RECL of the three at r = 0.1, 0.5, 1.0 (context lengths)
        assert re.search(rf"^\| {m} \| \d+\+? \| \d+\+? \| \d+\+? \|$", text, re.M), m
    assert "RECL of xl longer than both others: r = 0.1:" in text
    assert not list(tmp_path.glob("*.png"))  # no stray plot in the working folder
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/ablation_eval.json")}
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.read_text() == text  # the same numbers: nothing was trained or scored differently
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps and len(stamps) == 7  # the scores were reused


def test_long_doc_documents_put_the_marker_near_the_start():
    sys.path.insert(0, str(ROOT / "experiments"))
    import random

    from long_doc_classification import MARKERS, make_documents

    valid = ROOT.parent / "shared" / "data" / "shakespeare" / "valid.txt"
    if not valid.is_file():
        pytest.skip("needs ../shared/data/shakespeare (the project's corpus)")
    docs = make_documents(valid.read_text(encoding="utf-8"), 40, 2048, random.Random(1))
    assert sorted(d["label"] for d in docs) == ["aye"] * 20 + ["nay"] * 20  # balanced: chance is 50%
    for d in docs:
        marker = MARKERS[d["label"]].strip()
        at = d["text"].index(marker)
        assert at < 100 and len(d["text"]) >= 2048  # near the start of a long document
        assert d["text"].count("XXXXX") + d["text"].count("ZZZZZ") == 10  # only one marker, nowhere else
        assert at == 0 or d["text"][at - 1] == "\n"


@pytest.mark.slow
def test_long_doc_experiment_writes_its_table(tmp_path):
    out = tmp_path / "paper.md"
    cmd = [sys.executable, str(ROOT / "experiments" / "long_doc_classification.py"), "--budget", "smoke"]
    cmd += ["--runs", str(tmp_path / "runs"), "--length", "600", "--tgt_len", "256", "--write", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    assert "## Long documents: why the memory matters" in text
    for name, memory in (("with memory", "768 \\(whole document\\)"), ("without memory", "none")):
        assert re.search(rf"^\| {name} \| random \| {memory} \|( \d+\.\d% \|){{3}} \d+ s \|$", text, re.M), name
    assert re.search(r"^\| with memory \| pre-trained LM \|", text, re.M)
    runs = tmp_path / "runs"
    assert (runs / "nomem-scratch-smoke" / "finetune.json").is_file() and (runs / "lm" / "metrics.jsonl").exists()


def long_range_corpus(folder, seed: int = 0):
    """Python-like documents whose names are defined at the top and used again far below, each ending with the
    form-feed line that `txl data get sympy` writes."""
    import random

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 30), ("valid", 4), ("test", 4)):
        docs = []
        for _ in range(n):
            names = ["".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(4)]
            lines = [f"from lib import {n}" for n in names]
            lines += [f"    x = {rng.choice(names)}(x) + {rng.randint(0, 9)}" for _ in range(rng.randint(40, 120))]
            docs.append("\n".join(lines) + "\n\f\n")
        (folder / f"{split}.txt").write_text("".join(docs))
    return folder


@pytest.mark.slow
def test_long_range_experiment_quick_mode(tmp_path):
    """experiments/long_range.py, quick budget, on a long-range corpus the test makes: three rows with the same
    parameters (within 2%), the memory sweep of the relative rows, bpc by position, RECL of the three at three
    ratios, attention reach, the verdict lines computed from them; the section replaces itself when written again."""
    data = long_range_corpus(tmp_path / "data")
    out = tmp_path / "paper.md"
    out.write_text("# The paper's experiments with txl\n")
    cmd = [sys.executable, str(ROOT / "experiments" / "long_range.py"), "--budget", "quick", "--steps", "8"]
    cmd += ["--data", str(data), "--runs", str(tmp_path / "runs"), "--cache_dir", str(tmp_path / "cache")]
    cmd += ["--write", str(out)]
    for _ in range(2):  # (the second run reuses the trained rows and their scores, and rewrites the section)
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    assert text.count("## Beyond a fixed-length context: a long-range corpus") == 1
    record = json.loads((tmp_path / "runs" / "long_range.json").read_text())
    results = record["results"]
    assert set(results) == {"xl", "xl-norec", "vanilla"}
    params = [r["params"] for r in results.values()]
    assert max(params) - min(params) <= 0.02 * max(params)
    for name in ("xl", "xl-norec"):
        sweep = results[name]["sweep"]
        assert sorted(map(int, sweep)) == [0, 32, 64, 128]
        assert all(0 < s["bpc"] < 12 and len(s["positions"]) == 5 for s in sweep.values())
    assert 0 < results["vanilla"]["window"]["bpc"] < 12 and not results["vanilla"]["sweep"]
    assert set(record["recl"]) == {"0.1", "0.5", "1.0"}
    assert all(v in (32, 64, 96, 128) for r in record["recl"].values() for v in r["recl"].values())
    # the vanilla model reads no further than its 32 learned positions: no gain past the first length
    assert all(r["recl"]["vanilla"] == 32 and r["reached"]["vanilla"] for r in record["recl"].values())
    assert record["reach"] and all(0 <= h["beyond_128"] <= 1 for h in record["reach"].values())
    assert re.search(r"^\| xl \| [\d,]+ \| \d\.\d{4} \| \d\.\d{4} \| \d\.\d{4} \| \d\.\d{4} \|$", text, re.M)
    assert "- XL at the longest memory (128) against its training memory (32):" in text
    assert (tmp_path / "long_range.png").stat().st_size > 1000


@pytest.mark.slow
def test_long_range_levers_screen(tmp_path):
    """experiments/long_range_levers.py on a corpus the test makes: one row per lever, each scored at its own
    training memory (the doubled memory at 64) and the longest; the evaluation-only lever reuses the baseline's run
    with its own clamp; the growing memory's run was trained with the schedule ending at the recipe's memory."""
    data = long_range_corpus(tmp_path / "data")
    out = tmp_path / "paper.md"
    out.write_text("# The paper's experiments with txl\n")
    model = '{"n_layer": 2, "d_model": 64, "n_head": 2, "d_head": 32, "d_inner": 128, "mem_len": 32}'
    cmd = [sys.executable, str(ROOT / "experiments" / "long_range_levers.py"), "--steps", "6", "--docs", "2"]
    cmd += ["--memories", "128", "--model", model, "--tgt_len", "32", "--batch", "4", "--data", str(data)]
    cmd += ["--runs", str(tmp_path / "runs"), "--cache_dir", str(tmp_path / "cache"), "--write", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    assert text.count("## Beyond a fixed-length context: levers screened on valid") == 1
    for name, memory in [("baseline", 32), ("eval clamp", 32), ("clamp at memory", 32), ("half loss", 32),
                         ("memory x2", 64), ("growing memory", 32), ("same length", 32), ("segment / 2", 32),
                         ("steps x2", 32), ("deeper", 32)]:  # fmt: skip
        assert re.search(
            rf"^\| {name} \| .+ \| \d\.\d{{4}} \(memory {memory}\) \| \d\.\d{{4}} \| [+-]\d+\.\d\d% \|", text, re.M
        ), name
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["baseline", "clamp-at-memory", "deeper", "growing-memory",
                                                     "half-loss", "memory-x2", "same-length", "segment-2",
                                                     "steps-x2"]  # fmt: skip
    assert sorted(p.name for p in (runs / "baseline").glob("levers_*.json")) == ["levers_-1.json", "levers_63.json"]
    assert "the memory grows: [[0, 8], [2, 16], [4, 32]]" in (runs / "growing-memory" / "train.log").read_text()
    for run, field, value in [
        ("steps-x2", "max_steps", 12),
        ("segment-2", "tgt_len", 16),
        ("segment-2", "batch_size", 8),
    ]:
        assert yaml.safe_load((runs / run / "config.yaml").read_text())["train"][field] == value
    assert yaml.safe_load((runs / "deeper" / "config.yaml").read_text())["model"]["n_layer"] == 4
    assert yaml.safe_load((runs / "same-length" / "config.yaml").read_text())["model"]["same_length"] is True
    saved = json.loads((runs / "clamp-at-memory" / "levers_32.json").read_text())
    assert sorted(saved["sweep"], key=int) == ["32", "128"]


@pytest.mark.slow
def test_compressive_experiment_quick_mode(tmp_path):
    """experiments/compressive.py, quick budget, on a long-range corpus the test makes: the equal-cost rows, every
    compression function, the reach task, and a page whose section replaces itself when written again."""
    data = long_range_corpus(tmp_path / "data")
    out = tmp_path / "compressive.md"
    cmd = [sys.executable, str(ROOT / "experiments" / "compressive.py"), "--budget", "quick", "--data", str(data)]
    cmd += ["--runs", str(tmp_path / "runs"), "--write", str(out)]
    for _ in range(2):  # (the second run reuses the trained rows and rewrites the section)
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    text = out.read_text()
    assert text.count("## The Compressive Transformer at CPU scale") == 1
    assert re.search(r"^\| compressive \| mem_len 16 \+ 16 slots of c = 4 \| 80 \| \d+\.\d{3} \|", text, re.M)
    assert all(f"| {k} | " in text for k in ("max", "mean", "conv", "dilated_conv", "most_used"))
    assert re.search(r"^\| xl \| \d+\.\d\d \| \d+\.\d\d \|$", text, re.M), text
