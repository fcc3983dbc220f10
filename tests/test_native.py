"""The native decoding step (txl.kernels.native, decode.c): a cached one-token step of every layer in one C call. It
must
compute what the PyTorch path computes (to fp32 rounding: at least as close to a float64 run), on shapes that use
its vector code and its scalar tails, with padding, same_length, pre-LN, untied biases and a sliding window; not
depend on the number of threads; read weights that moved; keep NaN; and leave the PyTorch path in place where it
cannot be built."""

from __future__ import annotations

import copy
import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import debug_config
from train_helpers import run_inprocess
from txl import TransformerXLLM
from txl.cli import main
from txl.infer.evaluate import NonFiniteError
from txl.infer.generation import generate
from txl.kernels import admission, native
from txl.kernels.backends import set_backends
from txl.model.modeling import KVCache

ROOT = Path(__file__).resolve().parents[1]

needs_lib = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.status()}")

SHAPES = {
    # d_head 32 and 16: whole vectors (16 keys at a time); 12, 48 and d_model 20: the scalar tails
    "dh32": dict(d_model=64, n_head=2, d_head=32, d_inner=96),
    "dh12_pre_lnorm": dict(d_model=20, n_head=3, d_head=12, d_inner=40, pre_lnorm=True),
    "dh16_same_length_clamp": dict(d_model=48, n_head=4, d_head=16, d_inner=64, same_length=True, clamp_len=9),
    "dh48_untie_r": dict(d_model=32, n_head=1, d_head=48, d_inner=33, untie_r=True),
}


class Calls:
    """Counts the native kernel's runs (``native.decode_step`` returning a result)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = native.decode_step

        def counted(*args):
            out = real(*args)
            self.n += out is not None and not admission.checking()  # (a first call's check runs it once more)
            return out

        monkeypatch.setattr(native, "decode_step", counted)


def steps(model, prompt, padding, ids, mem_len, native_on: bool):
    """The prompt, then one token per step from ``ids`` [B, N]: the log-probs [N + 1, B, V] and the cache."""
    set_backends(native_decode=native_on)
    try:
        cache = KVCache(model.config, prompt.shape[0], mem_len, prompt.shape[1], dtype=next(model.parameters()).dtype)
        out = [model(prompt, cache=cache, padding=padding, return_log_probs=True).log_probs[:, -1]]
        for t in range(ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, return_log_probs=True).log_probs[:, -1])
        return torch.stack(out), cache
    finally:
        set_backends(native_decode=True)


@needs_lib
@pytest.mark.parametrize("shape", SHAPES)
def test_native_step_is_as_exact_as_the_pytorch_path(shape, monkeypatch):
    """Over 70 steps of a 40-position window (it slides), three rows with a left-padded prompt: the native step's
    log-probs are as close to a float64 run as the PyTorch fp32 step's, and equal to them within 1e-4 (relative:
    this sharp model's fp32 rounding); the cached keys and values agree too."""
    model = TransformerXLLM(debug_config(mem_len=40, **SHAPES[shape])).eval()
    prompt, ids = torch.randint(0, 97, (3, 21)), torch.randint(0, 97, (3, 70))
    padding = torch.zeros(3, 21, dtype=torch.bool)
    padding[0, :9] = True
    calls = Calls(monkeypatch)
    with torch.no_grad():
        fast, fast_cache = steps(model, prompt, padding, ids, 40, True)
        assert calls.n == 70  # every one-token step ran the kernel
        slow, slow_cache = steps(model, prompt, padding, ids, 40, False)
        assert calls.n == 70
        exact, _ = steps(copy.deepcopy(model).double(), prompt, padding, ids, 40, True)
    assert calls.n == 70  # (float64 takes the PyTorch path)
    assert fast_cache.start > 0  # the window slid
    err_fast, err_slow = (fast.double() - exact).abs().max(), (slow.double() - exact).abs().max()
    assert err_fast <= 2 * err_slow + 2e-6, (err_fast, err_slow)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
    for a, b in ((fast_cache.k, slow_cache.k), (fast_cache.v, slow_cache.v)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@needs_lib
@pytest.mark.parametrize("shape, rows", [("dh32", 2), ("dh12_pre_lnorm", 6)])  # (6 rows: 16 outputs at a time)
def test_native_step_does_not_depend_on_the_number_of_threads(shape, rows, monkeypatch):
    """Each value is computed by one thread with the same code: the kernel run with 1 and 2 threads gives the same
    bits. (PyTorch's own products run with 1 thread on both sides: oneDNN's fp32 GEMMs of 6 rows or more sum in
    another order with 2.)"""
    model = TransformerXLLM(debug_config(mem_len=40, **SHAPES[shape])).eval()
    prompt, ids = torch.randint(0, 97, (rows, 9)), torch.randint(0, 97, (rows, 50))
    threads = torch.get_num_threads()
    out = {}
    try:
        torch.set_num_threads(1)
        for n in (1, 2):
            monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)  # (what the kernels are given)
            with torch.no_grad():
                out[n], _ = steps(model, prompt, None, ids, 40, True)
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)
    assert torch.equal(out[1], out[2])


@needs_lib
def test_native_step_reads_weights_that_moved(monkeypatch):
    """Weights given new storage between two steps (``.data =``, as ``.to()`` does) are read from the new storage:
    the kernel's addresses are checked at every step."""
    model = TransformerXLLM(debug_config(mem_len=16, **SHAPES["dh16_same_length_clamp"])).eval()
    prompt, ids = torch.randint(0, 97, (2, 5)), torch.randint(0, 97, (2, 12))
    out = {}
    for native_on in (True, False):
        m = copy.deepcopy(model)
        set_backends(native_decode=native_on)
        try:
            cache = KVCache(m.config, 2, 16, 5)
            with torch.no_grad():
                m(prompt, cache=cache)
                logs = []
                for t in range(ids.shape[1]):
                    if t == 6:
                        for p in m.parameters():
                            p.data = p.data * 1.25  # new storage; the old one is freed
                    logs.append(m(ids[:, t : t + 1], cache=cache, return_log_probs=True).log_probs)
            out[native_on] = torch.cat(logs, 1)
        finally:
            set_backends(native_decode=True)
    torch.testing.assert_close(out[True], out[False], atol=1e-4, rtol=0)


@needs_lib
def test_a_nan_score_makes_generation_fail_as_without_the_kernel():
    """A NaN in u (r_w_bias) makes one head's scores NaN: the softmax must give NaN, not a number, so that
    generation stops with its error as the PyTorch path does."""
    model = TransformerXLLM(debug_config(mem_len=40, **SHAPES["dh32"])).eval()
    prompt = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        model.transformer.r_w_bias[0, 3] = float("nan")
    for native_on in (True, False):
        set_backends(native_decode=native_on)
        try:
            with pytest.raises(NonFiniteError):
                generate(model, prompt[:, :1], 20, temperature=0.0)
        finally:
            set_backends(native_decode=True)


@needs_lib
def test_the_softmax_exponential_is_as_accurate_as_expf():
    """The kernel's vectorised exp (the softmax's) against float64: within 2.5e-7 relative over [-87, 0]; below,
    where exp(x) is (near) subnormal, within 1.25e-38 (0 or the subnormal result, depending on the CPU's
    path); 0 below -104 and for -inf, NaN for NaN."""
    lib = native.library()
    low = torch.linspace(-103.9, -87.3, 1001)
    special = torch.tensor([-104.5, -1e30, -float("inf"), float("nan")])
    x = torch.cat([torch.linspace(-87.0, 0.0, 200_003), low, special])
    x = torch.cat([x, torch.zeros(16 - x.numel() % 16)])  # (whole vectors: the vector code for every value)
    y = torch.empty_like(x)
    lib.txl_exp(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), x.numel())
    n, m = 200_003, 200_003 + low.numel()
    rel = ((y[:n].double() - x[:n].double().exp()) / x[:n].double().exp()).abs().max()
    assert rel <= 2.5e-7, rel
    assert (y[n:m].double() - low.double().exp()).abs().max() <= 1.25e-38
    assert y[m : m + 3].tolist() == [0.0, 0.0, 0.0] and y[m + 3].isnan()


@needs_lib
def test_generation_through_the_cli_runs_the_kernel_and_matches_the_pytorch_path(tmp_path, monkeypatch, capsys):
    """``txl generate`` (greedy) gives the same tokens with and without the native step, and runs it."""
    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    args = ["generate", "--model", str(run), "--prompt", "Ab", "--max_new_tokens", "40", "--temperature", "0"]
    calls = Calls(monkeypatch)
    capsys.readouterr()
    main([*args, "--json"])
    assert calls.n == 39  # every token after the first came from a native step
    with_kernel = json.loads(capsys.readouterr().out)
    set_backends(native_kernels=False)
    main([*args, "--json"])
    assert calls.n == 39
    assert json.loads(capsys.readouterr().out) == with_kernel


def test_without_a_compiler_the_pytorch_path_is_used(tmp_path, monkeypatch, capsys):
    """No C compiler, or one that fails: no library, a status line that says why, ``txl generate`` says so once on
    stderr, and generation gives the same tokens through the PyTorch path."""
    model = TransformerXLLM(debug_config(mem_len=16)).eval()
    prompt = torch.randint(0, 97, (1, 6))
    expected = generate(model, prompt, 30, temperature=0.0)
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path / "cache"))
    for cc, why in ((str(tmp_path / "no-such-cc"), "does not run"), ("false", "the build failed")):
        monkeypatch.setenv("CC", cc)
        monkeypatch.setattr(native, "_LIB", {})
        assert native.library() is None
        assert "not available" in native.status() and why in native.status()
        calls = Calls(monkeypatch)
        assert generate(model, prompt, 30, temperature=0.0).equal(expected)
        assert calls.n == 0
    run = run_inprocess(tmp_path, train__max_steps=2, train__eval_interval=0)
    capsys.readouterr()
    main(["generate", "--model", str(run), "--prompt", "Ab", "--max_new_tokens", "3", "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "txl: note: native kernels (decoding step, attention, dropout, softmax NLL): not available"
    ), err


@pytest.mark.slow  # (builds the library again: ~25-30 s; CI runs it)
@needs_lib
def test_the_library_is_built_once_per_source_and_machine(tmp_path, monkeypatch):
    """A second process finds the built library instead of compiling again; a changed source builds a new one."""
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is not None
    built = sorted(tmp_path.glob("txl-*.so"))
    assert len(built) == 1
    compiles = []
    real_run = native.subprocess.run

    def run(cmd, *a, **kw):
        compiles.extend(["-shared" in cmd])
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(native.subprocess, "run", run)
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is not None and not any(compiles)
    copies = tmp_path / "src"
    copies.mkdir()
    for path in (*native.SOURCES, *native.HEADERS):
        (copies / path.name).write_text(path.read_text() + ("\n/* changed */\n" if path.name == "decode.c" else ""))
    monkeypatch.setattr(native, "SOURCES", tuple(copies / p.name for p in native.SOURCES))
    monkeypatch.setattr(native, "HEADERS", tuple(copies / p.name for p in native.HEADERS))
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is not None and any(compiles)
    assert len(sorted(tmp_path.glob("txl-*.so"))) == 2


@pytest.mark.slow  # (builds the library again: ~25-30 s; CI runs it)
@needs_lib
def test_a_truncated_cached_library_is_built_again_not_loaded(tmp_path, monkeypatch):
    """probes.md n85: a cached library cut short (a full disk, a copy interrupted) used to kill every command with
    SIGBUS when loaded; its recorded sha256 no longer matches, so it is built again. Run in a child process: a
    wrong load would kill it, not the test run."""
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is not None
    (built,) = tmp_path.glob("txl-*.so")
    assert (tmp_path / f"{built.name}.sha256").is_file()
    cut = tmp_path / "cut.so"  # (a new file in its place: this process has the old one mapped, and cutting a
    cut.write_bytes(built.read_bytes()[:1000])  # mapped file short would raise SIGBUS here, later)
    os.replace(cut, built)
    code = "from txl.kernels import admission, native; print(native.status())"
    env = {**os.environ, "TXL_NATIVE_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and ": on (" in done.stdout, (done.returncode, done.stdout, done.stderr[-500:])
    assert built.stat().st_size > 1000  # (rebuilt whole)


def test_a_build_in_a_temporary_folder_leaves_no_folder_behind(tmp_path, monkeypatch):
    """Where the cache cannot be written, the library is built in a temporary folder, which is removed once the
    library is loaded (or the build failed): no txl-native-* folders pile up in $TMPDIR."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(native.tempfile, "tempdir", None)
    monkeypatch.setattr(native, "cache_dir", lambda: Path("/proc/no-such-folder"))  # (cannot be created)
    for cc in ("false", os.environ.get("CC") or "cc"):
        monkeypatch.setenv("CC", cc)
        monkeypatch.setattr(native, "_LIB", {})
        native.library()
        assert list(tmp_path.glob("txl-native-*")) == [], cc


@needs_lib
def test_compiler_flags_from_the_environment_replace_the_default_ones(tmp_path, monkeypatch):
    """``TXL_NATIVE_CFLAGS``: the library is compiled with those flags alone (no -march=native added) into a file of
    its own; flags the compiler refuses give no library and a status line with the compiler's complaint."""
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path))
    commands = []
    real_run = native.subprocess.run

    def run(cmd, *a, **kw):
        commands.extend([cmd] if "-shared" in cmd else [])
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(native.subprocess, "run", run)
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is not None
    monkeypatch.setenv("TXL_NATIVE_CFLAGS", "-O2  -fno-fast-math")
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is not None
    assert "-march=native" in commands[0] and "-O2" not in commands[0]
    assert commands[1][1:3] == ["-O2", "-fno-fast-math"] and "-march=native" not in commands[1]
    assert len(list(tmp_path.glob("txl-*.so"))) == 2
    monkeypatch.setenv("TXL_NATIVE_CFLAGS", "-O3 -fno-such-flag-at-all")
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is None and len(commands) == 3
    assert "the build failed" in native.status() and "fno-such-flag-at-all" in native.status()


# the kernels' tests that the vector code's other builds must pass (the portable exponential, narrower vectors)
KERNEL_TESTS = (
    "tests/test_native.py::test_the_softmax_exponential_is_as_accurate_as_expf",
    "tests/test_native.py::test_native_step_is_as_exact_as_the_pytorch_path",
    "tests/test_native_attention.py::test_native_attention_is_as_exact_as_the_pytorch_path",
    "tests/test_native_attention.py::test_native_attention_masks_keys_anywhere_in_a_row",
    "tests/test_native_attention.py::test_training_attention_and_its_gradients_are_as_exact_as_the_pytorch_path",
    "tests/test_native_attention.py::test_the_kernels_form_the_query_terms_as_the_pytorch_path_does",
    "tests/test_native_dropout.py::test_the_stream_is_philox4x32_10",
    "tests/test_native_dropout.py::test_dropout_drops_what_its_stream_says_with_pytorchs_products",
    "tests/test_native_dropout.py::test_relu_and_dropout_in_one_pass_equal_relu_then_dropout",
    "tests/test_native_nll.py::test_nll_and_its_gradient_equal_float64_log_softmax_and_gather",
    "tests/test_native_nll.py::test_minus_infinity_columns_take_no_probability_and_nan_rows_stay_nan",
    "tests/test_native_nll.py::test_nll_of_a_linear_layer_equals_float64_without_the_logits",
)


@needs_lib
@pytest.mark.slow  # (two more builds of the library and its tests in a process: ~30 s each; CI runs them)
@pytest.mark.parametrize("cflags", ["-O3 -fopenmp", "-O3 -march=x86-64-v3 -fopenmp"], ids=["baseline", "avx2"])
def test_builds_without_the_machines_vector_extensions_pass_the_kernel_tests(tmp_path, monkeypatch, cflags):
    """The library as a machine without AVX-512 builds it (the portable exponential, 16-float vectors as narrower
    registers): the kernels' tests pass against a library built with those flags, in a fresh process."""
    if "x86-64-v3" in cflags and (platform.machine() != "x86_64" or " avx2 " not in native._cpu_flags() + " "):
        pytest.skip("an AVX2 build runs only on an x86-64 CPU with AVX2")
    env = {**os.environ, "TXL_NATIVE_CFLAGS": cflags, "TXL_NATIVE_CACHE": str(tmp_path)}
    monkeypatch.setenv("TXL_NATIVE_CFLAGS", cflags)  # (built here first: the fresh process finds it)
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_LIB", {})
    if native.library() is None:  # (a compiler without OpenMP, or without that target)
        pytest.skip(f"this compiler does not build with {cflags!r}: {native.status()}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *KERNEL_TESTS]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]
    assert "skipped" not in done.stdout and "deselected" not in done.stdout
    assert len(list(tmp_path.glob("txl-*.so"))) == 1  # (built there, with those flags: the default one is elsewhere)


@needs_lib
def test_a_library_without_one_of_the_kernels_is_not_used(tmp_path, monkeypatch):
    """Sources that build but lack a kernel (an inconsistent install): no library, a status line that names the
    missing kernel, and the model on the PyTorch path (not an AttributeError from the loader)."""
    model = TransformerXLLM(debug_config(mem_len=16)).eval()
    prompt = torch.randint(0, 97, (1, 6))
    expected = generate(model, prompt, 12, temperature=0.0)
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path / "cache"))
    copies = tmp_path / "src"
    copies.mkdir()
    for path in (*native.SOURCES, *native.HEADERS):
        (copies / path.name).write_text(path.read_text().replace("void txl_nll_linear(", "void txl_nll_other("))
    monkeypatch.setattr(native, "SOURCES", tuple(copies / p.name for p in native.SOURCES))
    monkeypatch.setattr(native, "HEADERS", tuple(copies / p.name for p in native.HEADERS))
    monkeypatch.setattr(native, "_LIB", {})
    assert native.library() is None
    assert "not available" in native.status() and "lacks a kernel" in native.status()
    assert "txl_nll_linear" in native.status()
    calls = Calls(monkeypatch)
    assert generate(model, prompt, 12, temperature=0.0).equal(expected)
    assert calls.n == 0
