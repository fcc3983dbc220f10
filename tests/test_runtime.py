"""Process settings chosen at start-up: the fp32 GEMM route is chosen only if a self-check shows it exact (and it is
faster), sets nothing process-wide, and under CheckedRoute computes only the kinds of product it was seen to compute
exactly; the allocator is tuned on Linux, and bf16 without hardware support falls back to fp32 with a note."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from txl.kernels import runtime, timing


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
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"  # nothing set


def test_an_exact_route_is_chosen_only_if_it_pays_and_nothing_is_set_process_wide():
    choice = runtime.choose_fp32_matmul(measure=False)  # not measured: speed-up 1.0 < MIN_GAIN
    assert not choice.enabled
    choice = runtime.choose_fp32_matmul()
    assert choice.enabled == (choice.exact and choice.speedup >= runtime.MIN_GAIN)
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"  # (importing or choosing changes no setting)


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


def test_auto_precision_is_bf16_where_the_device_computes_it(monkeypatch, tmp_path, capsys):
    """The paper's recipes say ``precision: auto``: bf16 on a GPU (or a CPU with bf16 in hardware), fp32 elsewhere,
    and txl train says which it took."""
    cpu = torch.device("cpu")
    for native, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(runtime, "native_bf16", lambda device, native=native: native)
        precision, note = runtime.effective_precision(cpu, "auto")
        assert precision == expected and expected in note
    from train_helpers import run_inprocess

    monkeypatch.setattr(runtime, "native_bf16", lambda device: False)
    run_inprocess(tmp_path, train__max_steps=1, train__eval_interval=0, train__precision="auto")
    out = capsys.readouterr().out
    assert "note: train.precision = auto: fp32 (cpu has no native bf16)" in out
    assert "runtime: training on cpu (fp32)" in out


def test_an_earlier_choice_is_kept_without_measuring_where_the_route_is_exact(monkeypatch):
    """A resumed run keeps the route its checkpoint used (the two paths round differently): no new measurement,
    which is noisy enough to choose the other way; a route that is not exact here is still refused."""

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(runtime, "paired", no_timing)
    exact_here = runtime.choose_fp32_matmul(measure=False).exact
    on = runtime.choose_fp32_matmul(earlier=True)
    assert on.enabled == exact_here and on.earlier is True
    assert "as in the run being resumed" in on.describe() or not exact_here
    off = runtime.choose_fp32_matmul(earlier=False)
    assert not off.enabled
    refused = runtime.choose_fp32_matmul(routed_matmul=bf16_matmul, earlier=True)
    assert not refused.enabled and "not exact here" in refused.describe()


def test_the_speed_check_is_the_packages_one_paired_timer(monkeypatch):
    """The route's speed check is txl.kernels.timing.paired (the one timer: a warm-up call of each, then rounds
    that alternate which goes first): the route's products against the default path's, the median of their ratios."""

    t = [0.0]
    seen = []

    def clock() -> float:
        return t[0]

    real_matmul = torch.Tensor.__matmul__

    def timed(a, b):  # (the route: 1 unit per product; the default path: 1.3)
        routed = torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        seen.append(routed)
        t[0] += 1.0 if routed else 1.3
        return real_matmul(a, b)

    monkeypatch.setattr(timing, "timer", clock)
    monkeypatch.setattr(torch.Tensor, "__matmul__", timed)
    speedup = runtime._route_speedup()
    n = 3 * len(runtime.ROUTE_SHAPES)  # (products per call)
    assert len(seen) == 2 * n * (runtime.ROUTE_ROUNDS + 1)
    firsts = [seen[r * 2 * n] for r in range(1, runtime.ROUTE_ROUNDS + 1)]
    assert firsts == [r % 2 == 0 for r in range(runtime.ROUTE_ROUNDS)]  # the route first, then alternating
    assert speedup == pytest.approx(1.3)


def bf16_when_large(func, args, kwargs):
    """A stand-in route that computes in bf16 on products of 64 rows or more (as oneDNN's choice of kernel can
    depend on the shape) and exactly, on torch's default path, below."""
    mats = [a for a in args if isinstance(a, torch.Tensor)]
    if mats[-2].shape[-2] >= 64:
        return func(*[a.bfloat16().float() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    return func(*args, **kwargs)


class Everything(runtime.CheckedRoute):
    """The route without its checks: every fp32 product routed."""

    def _exact(self, func, args, kwargs):
        return True


def tiny_model():
    from txl import TransformerXLConfig, TransformerXLLM

    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=50, d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64, n_layer=2,
                              mem_len=16, dropout=0.1)  # fmt: skip
    return TransformerXLLM(cfg)


def gradients(mode) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of two training segments (the second with memory; rows 8 and 64: products of both
    sizes), under ``mode`` (None: the default path), from the same seed."""
    model = tiny_model()
    torch.manual_seed(1)
    x = torch.randint(50, (4, 16))
    with mode or contextlib.nullcontext():
        out = model(x, x)
        out = model(x, x, mems=out.mems)
        out.loss.backward()
    return float(out.loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def test_the_checked_route_routes_only_the_kinds_of_product_it_saw_exact():
    plain_loss, plain = gradients(None)
    checked = runtime.CheckedRoute(call=bf16_when_large)
    loss, grads = gradients(checked)
    assert checked.routed > 0 and checked.refused > 0  # small products routed, large ones kept on the default path
    assert loss == plain_loss and all(torch.equal(grads[n], plain[n]) for n in plain)  # bit for bit
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"
    unchecked_loss, unchecked = gradients(Everything(call=bf16_when_large))  # (what the check prevents)
    assert unchecked_loss != plain_loss or any(not torch.equal(unchecked[n], plain[n]) for n in plain)


def test_the_real_route_stays_fp32_accurate_under_the_check():
    """oneDNN's own route (which computes in bf16 on AMX CPUs) under the checks: fp32 results whatever this CPU."""
    plain_loss, plain = gradients(None)
    checked = runtime.CheckedRoute()
    loss, grads = gradients(checked)
    assert len(checked.verdicts) >= 4  # (mm / addmm / bmm kinds of the forward and the backward)
    assert abs(loss - plain_loss) <= 1e-5 * abs(plain_loss)
    for n in plain:
        assert torch.allclose(grads[n], plain[n], rtol=1e-4, atol=1e-6), n


def test_the_checks_leave_the_random_stream_and_other_products_alone():
    checked = runtime.CheckedRoute(call=bf16_when_large)
    a = torch.randn(70, 8)
    before = torch.get_rng_state()
    with checked:
        a @ a.T  # a first sight: checked on random operands of its own generator
        (a.bfloat16() @ a.bfloat16().T).float()  # not fp32: not the route's
        a.double() @ a.double().T
    assert torch.equal(torch.get_rng_state(), before)
    assert len(checked.verdicts) == 1 and checked.refused == 1
