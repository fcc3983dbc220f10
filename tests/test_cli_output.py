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
