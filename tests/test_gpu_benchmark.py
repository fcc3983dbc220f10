"""The GPU benchmark script runs end to end on the CPU (its smallest configuration), writes the rows that later
runs compare with (benchmarks/results/gpu.json's format), keeps other configurations' rows with --append, and its
loss comparison reports each variant's gap from the reference; the committed results file has that format."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"config", "case", "impl", "device", "torch", "tokens_per_s", "mfu", "commit"}


def tree_digest(root: Path) -> str:
    """benchmarks/_report.py's tree_digest (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location("_report", ROOT / "benchmarks" / "_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tree_digest(root)


@pytest.mark.slow  # (the GPU scripts on the CPU, processes of their own; CI runs them)
def test_gpu_paper_runs_and_writes_its_rows(tmp_path):
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps([{"config": "other", "case": "train-bf16", "impl": "txl", "tokens_per_s": 1.0}]))
    cmd = [sys.executable, "gpu_paper.py", "--device", "cpu", "--configs", "tiny", "--impls", "txl", "txl-eager",
           "--precisions", "fp32", "--steps", "2", "--warmup", "1", "--track", "21", "--track_deterministic",
           "--track_variants", "txl:fp32", "txl:fp32:2", "--json", str(out), "--append"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert rows[0]["config"] == "other"  # (--append kept it)
    ours = rows[1:]
    assert {(r["case"], r["impl"]) for r in ours} == {
        ("train-fp32", "txl"),
        ("train-fp32", "txl-eager"),
        ("eval-fp32", "txl"),
        ("eval-fp32", "txl-eager"),
    }
    eager_eval = next(r for r in ours if r["case"] == "eval-fp32" and r["impl"] == "txl-eager")
    assert eager_eval["max_dloss_vs_txl"] < 1e-5  # (the same segments' losses, step by step)
    for r in ours:
        assert KEYS <= r.keys() and r["tokens_per_s"] > 0 and r["device"] == "cpu"
        assert r["commit"].endswith(f"(tree {tree_digest(ROOT)})")  # (the code by content, whatever git says)
    track = json.loads((tmp_path / "gpu_track.json").read_text())
    assert set(track["gaps"]) == {"txl-reference:fp32", "txl:fp32", "txl:fp32:2"} and track["gaps"]["txl:fp32"] < 0.01
    assert track["deterministic"]["on"] and track["deterministic"]["inductor"]  # (--track_deterministic)
    assert track["repeats"] == {"txl:fp32": 0.0} and track["curves"]["txl:fp32:2"] == track["curves"]["txl:fp32"]
    assert "| tiny | train-fp32 | txl |" in run.stdout


def test_a_deterministic_track_that_fails_goes_on_without_it(monkeypatch):
    """A torch whose deterministic mode fails on some kernel must not cost a GPU session's one track run: the failing
    variant runs again without deterministic kernels, as do the following ones, and the result says where; the result
    so far is saved after each variant (a run cut short by its time limit keeps it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import torch

    import gpu_paper

    step = gpu_paper.Trainer.step

    def failing(self, clip=0.0):
        if torch.are_deterministic_algorithms_enabled() and self.precision == "bf16":
            raise RuntimeError("In the deterministic mode of Inductor, we will avoid those benchmarkings")
        return step(self, clip)

    monkeypatch.setattr(gpu_paper.Trainer, "step", failing)
    args = argparse.Namespace(track=21, track_deterministic=True, track_dropout=None, track_reference="txl:fp32",
                              track_variants=["txl:bf16", "txl:fp32:2"])  # fmt: skip
    lines, saved = [], []
    try:
        out = gpu_paper.track("tiny", args, torch.device("cpu"), lines.append, lambda r: saved.append(dict(r["gaps"])))
    finally:
        torch.use_deterministic_algorithms(False)
        torch._inductor.config.deterministic = False
        torch.utils.deterministic.fill_uninitialized_memory = True
    assert out["deterministic"]["on"] is False and out["deterministic"]["off_from"] == "txl:bf16"
    assert set(out["curves"]) == {"txl:fp32", "txl:bf16", "txl:fp32:2"} and out["gaps"]["txl:bf16"] < 0.01
    assert any("failed with deterministic kernels" in line for line in lines)
    assert [len(g) for g in saved] == [1, 2, 3]  # (the result so far, saved as each variant ends)


def test_a_deterministic_track_names_the_ops_that_had_no_deterministic_version(monkeypatch):
    """Where a repeat is not 0 on the GPU, the result says why: the ops torch ran without a deterministic version
    (warn_only=True) are recorded per variant, once each, and logged; other warnings go to the log."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import warnings

    import torch
    from torch._prims_common import alert_not_deterministic

    import gpu_paper

    step = gpu_paper.Trainer.step

    def warning(self, clip=0.0):
        if self.precision == "bf16":
            alert_not_deterministic("scatter_add_cuda_kernel")  # (each step: recorded once)
            warnings.warn("something else", UserWarning, stacklevel=1)
        return step(self, clip)

    monkeypatch.setattr(gpu_paper.Trainer, "step", warning)
    args = argparse.Namespace(track=21, track_deterministic=True, track_dropout=None, track_reference="txl:fp32",
                              track_variants=["txl:bf16"])  # fmt: skip
    lines = []
    try:
        out = gpu_paper.track("tiny", args, torch.device("cpu"), lines.append)
    finally:
        torch.use_deterministic_algorithms(False)
        torch._inductor.config.deterministic = False
        torch.utils.deterministic.fill_uninitialized_memory = True
    assert out["deterministic"]["on"]
    assert out["deterministic"]["nondeterministic"] == {"txl:fp32": [], "txl:bf16": ["scatter_add_cuda_kernel"]}
    assert "track txl:bf16: ran without a deterministic version: scatter_add_cuda_kernel" in lines
    assert lines.count("track txl:bf16: warning: something else") == 1


def test_a_text_becomes_word_ids_numbered_by_frequency_in_columns(tmp_path, monkeypatch):
    """--track_text's stream: words numbered by frequency (ties by first appearance), words past the vocabulary
    sharing its last id, cut into equal columns as batchify does."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_paper

    text = tmp_path / "t.txt"
    text.write_text("b a a c b a\nd e f\n")  # a: 3, b: 2, then c, d, e, f once each (in that order)
    stream = gpu_paper.text_stream(text, 5, 2)  # (a vocabulary of 5: e and f share id 4)
    assert stream.tolist() == [[1, 0, 0, 2], [1, 0, 3, 4]]  # (9 words: 2 columns of 4, the last word dropped)


def test_the_tree_digest_names_the_code_and_nothing_else(tmp_path):
    """A result's code is named by content (a copied tree may carry another commit's git metadata): a changed source
    file changes the digest; results, caches and other folders do not."""
    for rel in ("src/txl/model/a.py", "benchmarks/b.py", "benchmarks/results/gpu.json", "docs/x.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("1\n")
    first = tree_digest(tmp_path)
    (tmp_path / "benchmarks/results/gpu.json").write_text("2\n")
    (tmp_path / "docs/x.md").write_text("2\n")
    assert tree_digest(tmp_path) == first and len(first) == 12
    (tmp_path / "src/txl/model/a.py").write_text("2\n")
    assert tree_digest(tmp_path) != first
    (tmp_path / "src/txl/model/a.py").write_text("1\n")
    (tmp_path / "src/txl/model/a.py").rename(tmp_path / "src/txl/model/c.py")  # (the same bytes, another file)
    assert tree_digest(tmp_path) != first


def test_the_committed_gpu_results_have_the_format():
    rows = json.loads((ROOT / "benchmarks" / "results" / "gpu.json").read_text())
    assert rows and all(KEYS <= r.keys() for r in rows)
    base = {(r["case"], r["impl"]): r for r in rows if r["config"] == "wt103-base-nvidia"}
    assert {"train-bf16", "train-fp32", "eval-fp32"} <= {c for c, _ in base}


@pytest.mark.slow
def test_the_gpu_end_to_end_script_runs_the_users_commands_on_the_cpu(tmp_path):
    """benchmarks/gpu_e2e.sh's smoke mode: txl train with the WT103 base recipe on a synthetic corpus, then txl eval of
    its checkpoint in bf16 and fp32 (the same commands as on a GPU, a small model), with the policy change it passes
    on (E2E_FAST_PATHS, as a GPU run turns on the fused attention)."""
    env = {**os.environ, "E2E_SMALL": "1", "E2E_DIR": str(tmp_path), "PYTHON": sys.executable,
           "E2E_FAST_PATHS": "{native_relu_dropout: false}"}  # fmt: skip
    run = subprocess.run(["bash", "benchmarks/gpu_e2e.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:] + run.stdout[-2000:]
    assert "stopped at step 6 (max_steps 6)" in run.stdout
    assert "fast paths: off: native_relu_dropout" in run.stdout
    assert run.stdout.count("valid: loss") == 2 and "tgt_len 64, mem_len 640, clamp_len 400" in run.stdout


def test_the_fused_attention_tile_sweep_runs_on_the_cpu():
    """benchmarks/gpu_fused_attention.py's smoke run (Triton's interpreter): the written-out attention and the fused
    kernel timed side by side, the kernel's output compared with the written-out one."""
    cmd = [sys.executable, "gpu_fused_attention.py", "--device", "cpu", "--smoke"]
    run = subprocess.run(cmd, cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    diffs = [float(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines() if "largest difference" in line]
    assert len(diffs) == 2 and max(diffs) < 0.1, run.stdout  # (bf16 outputs of size ~1)
    assert run.stdout.count("written out, compiled") == 2


@pytest.mark.slow
def test_every_command_of_the_gpu_suite_runs_in_its_smoke_mode(tmp_path):
    """benchmarks/gpu_suite.sh's steps with GPU_SUITE_SMOKE=1: the same command lines on the CPU at the smallest
    configuration, so that a GPU session's one run is not lost to a wrong option. The track step's runs report every
    variant's gap with deterministic kernels (the repeated bf16 run equal to the first); generation needs CUDA and
    says so after reading its options."""
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{i % 97} w{i % 13}" for i in range(3000)))
    steps = "tests profile base track track-text track-logits others generation rl e2e tiles"
    env = {**os.environ, "GPU_SUITE_SMOKE": "1", "PYTHON": sys.executable, "GPU_SUITE_TEXT": str(text),
           "GPU_SUITE_STEPS": steps}  # fmt: skip
    run = subprocess.run(["bash", "benchmarks/gpu_suite.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for step in ("profile", "base", "track", "track-no-dropout", "track-text", "track-logits", "others", "rl", "e2e",
                 "tiles"):  # fmt: skip
        assert f"[gpu_suite] {step}: exit 0 after" in run.stdout, run.stdout[-3000:]
    assert "needs a CUDA device" in (tmp_path / "log_generation.txt").read_text()
    base = (tmp_path / "log_base.txt").read_text()
    assert all(re.search(rf"train-{p} +txl-fused ", base) for p in ("bf16", "fp32"))
    assert (tmp_path / "profiles.tar").is_file()
    track = json.loads((tmp_path / "track_track.json").read_text())
    assert set(track["gaps"]) == {"txl:fp32", "txl:bf16", "txl:bf16:2", "txl-reference:fp32"}
    assert track["deterministic"]["on"] and track["repeats"] == {"txl:bf16": 0.0}
    no_dropout = json.loads((tmp_path / "track0_track.json").read_text())
    assert set(no_dropout["gaps"]) == {"txl-reference:fp32", "txl:bf16"} and no_dropout["largest_gap"] < 0.01
    logits = json.loads((tmp_path / "track_logits_track.json").read_text())
    assert set(logits["gaps"]) == {"txl:fp32", "txl:bf16", "txl-fp32-logits:bf16"}
    profiled = json.loads((tmp_path / "profile_wt103_base_bf16.json").read_text())
    assert {"tiny train-bf16 txl", "tiny train-bf16 txl-fused"} <= set(profiled["summaries"]) and profiled["commit"]
    assert all(s["top_kernels"] and s["kinds_ms_per_step"] for s in profiled["summaries"].values())
    rl = json.loads((tmp_path / "rl_gpu.json").read_text())
    assert [r["memory"] for r in rl] == ["GTrXL (graph)", "GTrXL (kernel by kernel)", "GRU (128)"]
    assert all(r["device"] and r["torch"] and r["commit"] for r in rl)
    on_text = json.loads((tmp_path / "track_text_track.json").read_text())
    assert on_text["data"] == str(text) and set(on_text["gaps"]) == {"txl:fp32", "txl:bf16", "txl-reference:fp32"}


def test_the_profile_summary_reads_a_gpu_trace():
    """benchmarks/gpu_profile.py's summary of a GPU profile (made-up kernel events, as Kineto gives them: device
    events beside the host's runtime calls): kernels merged across streams into busy periods, the idle gaps between
    them with the kernels on each side, the time per kind of kernel, host syncs and launches per step."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def event(name, start, end, device=DeviceType.CUDA, cpu_us=0.0):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(
            start=start, end=end, elapsed_us=lambda: end - start), cpu_time_total=cpu_us, self_cpu_time_total=cpu_us,
            cpu_parent=None)  # fmt: skip

    events = [  # two steps of 50 us of kernels each, one kernel on a second stream overlapping, a 100 us gap
        event("sm90_xmma_gemm_bf16bf16_tn", 0, 30), event("triton_poi_fused_add_mul_0", 30, 40),
        event("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>", 35, 50),
        event("sm90_xmma_gemm_bf16bf16_tn", 150, 180), event("multi_tensor_apply_kernel<FusedAdam>", 180, 200),
        event("cudaLaunchKernel", 0, 5, DeviceType.CPU, 5.0), event("cudaLaunchKernel", 6, 9, DeviceType.CPU, 3.0),
        event("cudaStreamSynchronize", 200, 210, DeviceType.CPU, 10.0),
    ]  # fmt: skip
    s = gpu_profile.summarise(SimpleNamespace(events=lambda: events), 2, __import__("torch").device("cuda"))
    assert s["device_time_per_step_ms"] == pytest.approx((30 + 10 + 15 + 30 + 20) / 2 / 1e3)
    assert s["wall_span_per_step_ms"] == pytest.approx(200 / 2 / 1e3)
    assert s["idle_per_step_ms"] == pytest.approx(100 / 2 / 1e3) and s["busy_fraction"] == pytest.approx(0.5)
    assert s["largest_gaps"] == [{"us": 100.0, "after": events[2].name, "before": "sm90_xmma_gemm_bf16bf16_tn"}]
    assert s["kinds_ms_per_step"] == pytest.approx({"matrix products": 0.03, "compiled pointwise (Triton)": 0.005,
                                                    "elementwise": 0.0075, "optimizer": 0.01})  # fmt: skip
    assert s["top_kernels"][0] == {"name": "sm90_xmma_gemm_bf16bf16_tn", "kind": "matrix products",
                                   "calls_per_step": 1.0, "ms_per_step": 0.03, "share": 60 / 105}  # fmt: skip
    assert s["host"] == {"cudaLaunchKernel": {"calls_per_step": 1.0, "ms_per_step": 0.004},
                         "cudaStreamSynchronize": {"calls_per_step": 0.5, "ms_per_step": 0.005}}  # fmt: skip
    assert "| matrix products | 0.030 |" in gpu_profile.markdown("x", s)
