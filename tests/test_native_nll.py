"""The native softmax NLL (txl.kernels.native.nll, nll.c): -log_softmax(x)[target] per row and its gradient straight
from
the logits. It must equal float64's log-softmax and gather (and their gradient) to fp32 rounding for any width,
ignore -100 targets, give -inf columns no probability and NaN rows NaN, not depend on the thread count, and be what
the adaptive softmax runs in `txl train` and `txl eval` (with the PyTorch path's losses)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from train_helpers import losses, run_inprocess
from txl.cli import main
from txl.kernels import native
from txl.kernels.backends import set_backends
from txl.kernels.linear import weight_copies
from txl.model import modeling
from txl.model.modeling import TransformerXLConfig, TransformerXLLM

needs_lib = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.status()}")


def reference(x: torch.Tensor, target: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 NLL (0 where target < 0) and the gradient of sum(grad * nll)."""
    x64 = x.double().requires_grad_()
    valid = target >= 0
    nll = -F.log_softmax(x64, dim=-1).gather(1, target.clamp(min=0)[:, None]).squeeze(1) * valid
    (nll * grad.double()).sum().backward()
    return nll.detach(), x64.grad


@needs_lib
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (5, 16), (7, 17), (64, 100), (33, 4008), (9, 16_000)])
def test_nll_and_its_gradient_equal_float64_log_softmax_and_gather(shape):
    n, v = shape
    g = torch.Generator().manual_seed(n * 1000 + v)
    x = torch.randn(n, v, generator=g) * 4
    target = torch.randint(0, v, (n,), generator=g)
    target[n // 2] = -100 if n > 1 else target[0]
    grad = torch.rand(n, generator=g) + 0.5
    nll, lse = native.nll(x, target)
    ref, ref_grad = reference(x, target, grad)
    assert (nll.double() - ref).abs().max() <= 2e-6 * max(1.0, float(ref.abs().max()))
    assert torch.allclose(lse.double(), torch.logsumexp(x.double(), -1), atol=2e-6, rtol=1e-6)
    dx = native.nll_backward(x, target, lse, grad)
    assert (dx.double() - ref_grad).abs().max() <= 1e-6
    if n > 1:
        assert nll[n // 2] == 0 and dx[n // 2].eq(0).all()  # (the ignored row)


@needs_lib
def test_minus_infinity_columns_take_no_probability_and_nan_rows_stay_nan():
    x = torch.randn(4, 40)
    x[:, 33:] = float("-inf")  # (the head's padding columns)
    target = torch.tensor([0, 5, 32, 7])
    x[3, 10] = float("nan")
    nll, lse = native.nll(x, target)
    ref, _ = reference(x[:3, :33], target[:3], torch.ones(3))
    assert torch.allclose(nll[:3].double(), ref, atol=1e-6) and nll[3].isnan() and lse[3].isnan()
    dx = native.nll_backward(x, target, lse, torch.ones(4))
    assert dx[:3, 33:].eq(0).all() and torch.allclose(dx[:3].sum(1), torch.zeros(3), atol=1e-6)


@needs_lib
def test_the_results_do_not_depend_on_the_thread_count():
    x = torch.randn(300, 1000)
    target = torch.randint(0, 1000, (300,))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.nll(x, target)
        one_dx = native.nll_backward(x, target, one[1], torch.ones(300))
        torch.set_num_threads(2)
        two = native.nll(x, target)
        two_dx = native.nll_backward(x, target, two[1], torch.ones(300))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1]) and torch.equal(one_dx, two_dx)


def adaptive_lm(cutoffs: list[int], div_val: int = 2) -> TransformerXLLM:
    torch.manual_seed(0)
    cfg = TransformerXLConfig(
        n_token=300, cutoffs=cutoffs, div_val=div_val, d_model=32, d_embed=32, n_layer=2, n_head=2, d_head=16,
        d_inner=64, dropout=0.0, dropatt=0.0, mem_len=8,
    )  # fmt: skip
    model = TransformerXLLM(cfg)
    for p in model.parameters():  # (larger weights: logits far from uniform)
        p.data.normal_(0, 0.3)
    return model


@needs_lib
@pytest.mark.parametrize("cutoffs", [[50, 130], [], [47]], ids=["two-tails", "plain", "pad"])
def test_the_adaptive_softmax_gives_the_pytorch_paths_losses_and_gradients(cutoffs, monkeypatch):
    """Losses (ignored targets included) and every parameter's gradient, with and without the kernel; the kernel
    ran (one call per cluster with targets in it)."""
    model = adaptive_lm(cutoffs, div_val=2 if len(cutoffs) > 1 else 1)
    x = torch.randint(0, 300, (3, 12))
    y = torch.randint(0, 300, (3, 12))
    y[0, 4] = y[2, 0] = -100
    calls = []
    real = native.nll
    monkeypatch.setattr(native, "nll", lambda *a: calls.append(1) or real(*a))
    results = {}
    for flag in (True, False):
        set_backends(native_nll=flag)
        model.zero_grad()
        out = model(x, y)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[flag] = out.losses.detach(), grads
    assert len(calls) == len(cutoffs) + 1
    (a, ga), (b, gb) = results[True], results[False]
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-5) and a[0, 4] == 0 and a[2, 0] == 0
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-6), n


@needs_lib
def test_log_probs_and_other_devices_keep_the_pytorch_path(monkeypatch):
    """Asking for the log-probabilities (or bf16 logits) does not run the kernel."""
    model = adaptive_lm([50, 130])
    called = []
    monkeypatch.setattr(native, "nll", lambda *a: called.append(1))
    x, y = torch.randint(0, 300, (2, 6)), torch.randint(0, 300, (2, 6))
    out = model(x, y, return_log_probs=True)
    nll = -out.log_probs.gather(-1, y[..., None]).squeeze(-1)
    assert not called and torch.allclose(out.losses, nll, atol=1e-5)
    assert not native.nll_applies(torch.zeros(2, 3, dtype=torch.bfloat16))


@needs_lib
def test_txl_train_and_eval_run_the_kernels_with_the_pytorch_paths_losses(tmp_path, monkeypatch, capsys):
    """`txl train` with an adaptive softmax (the debug preset with two tail clusters) and `txl eval` of its model:
    training runs ``nll`` and validation ``nll_linear``, and the training and validation losses, and `txl eval`'s,
    equal those of the PyTorch path to fp32 rounding."""
    calls = {"nll": 0, "nll_linear": 0}
    for name in calls:
        real = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *a, name=name, real=real: calls.__setitem__(name, calls[name] + 1) or real(*a)
        )
    run = dict(
        train__log_interval=1, train__eval_interval=3, train__max_steps=6, model__cutoffs="[10, 20]",
        model__div_val=2, model__dropout=0.0, model__dropatt=0.0,
    )  # fmt: skip
    fast = run_inprocess(tmp_path, "fast", **run)
    assert calls["nll"] > 0 and calls["nll_linear"] > 0
    capsys.readouterr()
    evaluate = ["eval", "--model", str(fast), "--max_batches", "4", "--json"]
    calls.update(nll=0, nll_linear=0)
    main(evaluate)
    fast_eval = json.loads(capsys.readouterr().out)["loss"]
    assert calls["nll_linear"] > 0 and calls["nll"] == 0  # (`txl eval` scores without logits)
    set_backends(native_nll=False)
    calls.update(nll=0, nll_linear=0)
    slow = run_inprocess(tmp_path, "slow", **run)
    capsys.readouterr()
    main(evaluate)
    slow_eval = json.loads(capsys.readouterr().out)["loss"]
    assert calls == {"nll": 0, "nll_linear": 0}
    assert abs(fast_eval - slow_eval) <= 1e-5 * max(1.0, abs(slow_eval))
    for split in ("train", "valid"):
        a, b = losses(fast, split), losses(slow, split)
        assert len(a) == len(b) > 0 and [s for s, _ in a] == [s for s, _ in b]
        assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for (_, x), (_, y) in zip(a, b, strict=True)), (a, b)


@needs_lib
@pytest.mark.parametrize(
    "n, d, v", [(1, 1, 1), (9, 5, 33), (8, 16, 16_000), (13, 64, 1000), (40, 100, 600), (17, 256, 4008)]
)
def test_nll_of_a_linear_layer_equals_float64_without_the_logits(n, d, v):
    """:func:`txl.kernels.native.nll_linear` (the product, maximum and sum in one kernel) against float64, for inputs
    of 1
    to 256 values, widths that are not multiples of the kernel's 32 columns or 512-column chunks, ignored rows, and
    a row with a NaN input (NaN)."""
    g = torch.Generator().manual_seed(n * d + v)
    h, w, b = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) * 0.3, torch.randn(v, generator=g)
    target = torch.randint(0, v, (n,), generator=g)
    target[n // 3] = -100 if n > 2 else target[n // 3]
    ref, _ = reference(F.linear(h.double(), w.double(), b.double()), target, torch.ones(n))
    packed = native.pack_linear(w, b)
    assert packed[0].shape == (d, -(-v // 32) * 32) and packed[1][v:].eq(float("-inf")).all()
    out = native.nll_linear(h, packed, target)
    assert (out.double() - ref).abs().max() <= 2e-6 * max(1.0, float(ref.abs().max()))
    no_bias = native.nll_linear(h, native.pack_linear(w, None), target)
    ref_no_bias, _ = reference(F.linear(h.double(), w.double()), target, torch.ones(n))
    assert (no_bias.double() - ref_no_bias).abs().max() <= 2e-6 * max(1.0, float(ref_no_bias.abs().max()))
    if n > 2:
        h[n - 1, d // 2] = float("nan")
        out = native.nll_linear(h, packed, target)
        assert out[n // 3] == 0 and out[n - 1].isnan() and not out[: n - 1].isnan().any()


@needs_lib
def test_nll_of_a_linear_layer_keeps_the_thread_count_out_and_refuses_what_it_cannot_run():
    h, w = torch.randn(200, 64), torch.randn(3000, 64)
    target = torch.randint(0, 3000, (200,))
    packed = native.pack_linear(w, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.nll_linear(h, packed, target)
        torch.set_num_threads(2)
        two = native.nll_linear(h, packed, target)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    wide = native.pack_linear(torch.randn(10, native.LINEAR_MAX_DIM + 1), None)
    assert native.nll_linear(torch.randn(2, native.LINEAR_MAX_DIM + 1), wide, torch.zeros(2)) is None
    assert native.nll_linear(h.to(torch.bfloat16), packed, target) is None


@needs_lib
def test_evaluation_scores_without_logits_from_packs_kept_while_the_weights_are_unchanged(monkeypatch):
    """Inside ``transposed_weights()`` without a gradient (``txl.infer.evaluate``): each cluster's NLL comes from
    ``nll_linear`` with the PyTorch path's losses; the packed layers are made once, made again after an in-place
    change of a weight, and dropped when the scope closes; with a gradient the logits path runs."""
    model = adaptive_lm([50, 130]).eval()
    x, y = torch.randint(0, 300, (3, 12)), torch.randint(0, 300, (3, 12))
    y[1, 2] = -100
    calls, packs = [], []
    real_nll, real_pack = native.nll_linear, native.pack_linear
    monkeypatch.setattr(native, "nll_linear", lambda *a: calls.append(1) or real_nll(*a))
    monkeypatch.setattr(native, "pack_linear", lambda *a: packs.append(1) or real_pack(*a))
    with torch.no_grad():
        set_backends(native_nll=False)
        slow = model(x, y).losses
        set_backends(native_nll=True)
        with modeling.transposed_weights():
            copies = weight_copies()
            fast = model(x, y).losses
            assert len(calls) == 3 and len(packs) == 3
            model(x, y)
            assert len(calls) == 6 and len(packs) == 3  # (kept)
            model.crit.cluster_bias.add_(1.0)  # (the head's pack is made from it)
            changed = model(x, y).losses
            assert len(packs) == 4
        assert torch.allclose(fast, slow, rtol=1e-6, atol=1e-5) and fast[1, 2] == 0
        set_backends(native_nll=False)
        assert torch.allclose(changed, model(x, y).losses, rtol=1e-6, atol=1e-5)
        set_backends(native_nll=True)
    assert len(copies) == 0 and weight_copies() is None  # (dropped with the scope)
    with modeling.transposed_weights():
        model(x, y).loss.backward()  # (a gradient: from the logits)
    assert len(calls) == 9
