"""What the commands print: a streamed text is never cut by a log line."""

from __future__ import annotations


def test_a_fast_path_line_waits_for_the_end_of_a_streamed_text(tmp_path):
    """Round 6 (low): `make demo` printed "txl: measured native_decode ..." in the middle of its sample. The lines
    the txl logger writes while a text streams come after it."""
    import os
    import subprocess
    import sys

    from train_helpers import ROOT, run_inprocess

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    env = {
        **os.environ,
        "TXL_MEASURE": "1",
        "TXL_NATIVE_CACHE": str(tmp_path / "native"),
        "PYTHONPATH": str(ROOT / "src"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "txl", "generate", "--model", str(run), "--prompt", "Ab", "--max_new_tokens", "40",
         "--seed", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    measured = [i for i, line in enumerate(lines) if line.startswith("txl: measured")]
    assert measured, out.stdout  # (the first use of the native decoding step was measured)
    assert all(not line.startswith("txl: measured") for line in lines[: measured[0]] if "txl:" not in line)
    text_lines = [i for i, line in enumerate(lines) if not line.startswith("txl:")]
    assert max(text_lines) < min(measured), out.stdout


def test_generate_estimates_memory_as_the_run_reads(tmp_path, monkeypatch, capsys):
    """Issue 75 (9): `txl generate --same_length false` on a model whose run reads with same_length estimated the
    prompt's pass as same_length reads it (a window of mem_len), under-estimating a long prompt's. The estimate now
    follows how this run reads."""
    from train_helpers import run_inprocess
    from txl.cli import main
    from txl.kernels import runtime

    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)  # (debug recipe: eval.same_length)
    asked = []
    real = runtime.check_fits

    def recorded(needed: int, what: str, advice: str) -> None:
        if what.startswith("txl generate"):  # (the generation's estimate; the weights' check comes first)
            asked.append(needed)
        real(needed, what, advice)

    monkeypatch.setattr(runtime, "check_fits", recorded)
    prompt = "Ab cd. " * 400  # (2,800 characters: read in pieces of 1,024)
    for same in ("true", "false"):
        main(["generate", "--model", str(run), "--prompt", prompt, "--max_new_tokens", "1", "--same_length", same,
              "--json", "true"])  # fmt: skip
    capsys.readouterr()
    assert len(asked) == 2 and asked[1] > asked[0], asked  # (without same_length the last piece sees the whole prompt)
