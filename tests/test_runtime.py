"""Process settings chosen at start-up: the fp32 GEMM route is taken only if a self-check shows it exact (and it is
faster), the allocator is tuned on Linux, and bf16 without hardware support falls back to fp32 with a note."""

from __future__ import annotations

import sys

import pytest
import torch

from txl import runtime


@pytest.fixture(autouse=True)
def _keep_route():
    before = torch.backends.mkldnn.matmul.fp32_precision
    yield
    torch.backends.mkldnn.matmul.fp32_precision = before


def bf16_matmul(a, b):
    return (a.bfloat16() @ b.bfloat16()).float()


def test_the_self_check_refuses_a_route_that_is_not_exact():
    assert runtime.is_fp32_exact(lambda a, b: (a.double() @ b.double()).float())
    assert runtime.matmul_error(bf16_matmul) > 1e-4 and not runtime.is_fp32_exact(bf16_matmul)
    choice = runtime.choose_fp32_matmul(measure=False, routed_matmul=bf16_matmul)
    assert not choice.exact and not choice.enabled and "not exact" in choice.describe()
    assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"  # the default path stays


def test_an_exact_route_is_taken_only_if_it_pays():
    choice = runtime.choose_fp32_matmul(measure=False)  # not measured: speed-up 1.0 < MIN_GAIN
    assert not choice.enabled and torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    choice = runtime.choose_fp32_matmul()
    assert choice.enabled == (choice.exact and choice.speedup >= runtime.MIN_GAIN)
    expected = "bf16" if choice.enabled else "ieee"
    assert torch.backends.mkldnn.matmul.fp32_precision == expected
    if choice.enabled:  # whatever the route, products stay fp32-accurate
        assert runtime.is_fp32_exact(torch.matmul)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_allocator_is_tuned_on_linux():
    assert runtime.configure_allocator()


def test_bf16_falls_back_to_fp32_only_without_hardware_bf16(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime, "native_bf16", lambda device: False)
    precision, note = runtime.effective_precision(cpu, "bf16")
    assert precision == "fp32" and "no native bf16" in note
    assert runtime.effective_precision(cpu, "fp32") == ("fp32", None)
    monkeypatch.setattr(runtime, "native_bf16", lambda device: True)
    assert runtime.effective_precision(cpu, "bf16") == ("bf16", None)


def test_an_earlier_choice_is_kept_without_measuring_where_the_route_is_exact(monkeypatch):
    """A resumed run keeps the route its checkpoint used (the two paths round differently): no new measurement,
    which is noisy enough to choose the other way; a route that is not exact here is still refused."""

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(runtime, "median_time", no_timing)
    exact_here = runtime.choose_fp32_matmul(measure=False).exact
    on = runtime.choose_fp32_matmul(earlier=True)
    assert on.enabled == exact_here and on.earlier is True
    assert torch.backends.mkldnn.matmul.fp32_precision == ("bf16" if exact_here else "ieee")
    assert "as in the run being resumed" in on.describe() or not exact_here
    off = runtime.choose_fp32_matmul(earlier=False)
    assert not off.enabled and torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    refused = runtime.choose_fp32_matmul(routed_matmul=bf16_matmul, earlier=True)
    assert not refused.enabled and "not exact here" in refused.describe()


def test_the_speed_check_is_the_median_of_paired_rounds_after_a_warm_up(monkeypatch):
    """Each round times both paths (which goes first alternates); the first round, slow while both warm up, is
    dropped, and a stalled round does not move the median."""
    n = len(runtime.ROUTE_SHAPES)
    calls = []

    def fake_median_time(fn, repeats=5):  # one call per shape; a round is 2 * n calls
        i = len(calls) // (2 * n)
        routed = torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        calls.append(routed)
        if routed:
            return (20.0 if i == 3 else 1.0) / n  # round 3 stalls on the route
        return (5.0 if i == 0 else 1.0 + 0.1 * i) / n  # round 0 warms up; then ratios 1.1, 1.2, ..., 1.8

    monkeypatch.setattr(runtime, "median_time", fake_median_time)
    speedup = runtime._route_speedup()
    assert len(calls) == 2 * n * (runtime.ROUTE_ROUNDS + 1)
    firsts = [calls[r * 2 * n] for r in range(runtime.ROUTE_ROUNDS + 1)]
    assert firsts == [r % 2 == 0 for r in range(runtime.ROUTE_ROUNDS + 1)]  # the route first, then alternating
    assert speedup == pytest.approx(1.45)  # median of 1.1, 1.2, 1.3/20, 1.4, ..., 1.8 (the warm-up's 5.0 dropped)
