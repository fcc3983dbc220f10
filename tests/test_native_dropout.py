"""The native dropout (txl.kernels.native, dropout.c): one pass, a Philox4x32-10 stream keyed by a seed drawn from
torch's
generator. It must be Philox (the published known answers), drop exactly the elements its stream says at the rate
p, compute PyTorch's products (fp32 and bf16, NaN and infinity included), not depend on the thread count, give the
backward the forward's mask, follow torch.manual_seed, and be what `txl train` runs. The feed-forward's relu and
dropout in one pass must give what relu then dropout give, values and gradients, bit for bit."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from train_helpers import losses, run_inprocess, train_args, txl_process
from txl.kernels import native, philox
from txl.kernels.backends import set_backends
from txl.model import modeling
from txl.model.modeling import Dropout
from txl.train.checkpoint import latest_checkpoint, read_metadata

needs_lib = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.status()}")


def threshold(p: float) -> int:
    return min(round(p * 2.0**32), 2**32 - 1)


@needs_lib
def test_the_stream_is_philox4x32_10():
    """Random123's known answer for counter 0, key 0: {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}, the four
    words of block 0, which elements 0, 16, 32 and 48 take."""
    words = native.dropout_words(0, 64)
    assert [int(words[i]) for i in (0, 16, 32, 48)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert len(set(native.dropout_words(0, 4096).tolist())) == 4096  # (distinct words: every block is used once)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 40_001])
def test_dropout_drops_what_its_stream_says_with_pytorchs_products(dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen).to(dtype)
    x[:: max(n // 5, 1)] = float("inf")
    x[1 :: max(n // 7, 1)] = float("nan")
    for p, seed in ((0.1, 7), (0.5, 2**64 - 3), (0.9, 12345)):
        keep = native.dropout_words(seed, n).ge(threshold(p))
        y = native.dropout(x, p, seed)
        assert y.dtype == dtype and y.shape == x.shape
        expected = x.mul(keep).mul_(1.0 / (1.0 - p))  # what the PyTorch mask computes (a dropped inf gives NaN)
        assert torch.equal(y.isnan(), expected.isnan())
        assert torch.equal(y.nan_to_num(), expected.nan_to_num())
        again = native.dropout(x.view(1, -1)[:, :n], p, seed)  # (any shape)
        assert torch.equal(again.view(-1).nan_to_num(), y.nan_to_num())


@needs_lib
def test_dropout_rate_and_independence_from_the_thread_count():
    x = torch.ones(1 << 20)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.dropout(x, 0.3, 99)
        torch.set_num_threads(2)
        two = native.dropout(x, 0.3, 99)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    kept = float(two.ne(0).double().mean())
    assert abs(kept - 0.7) < 4 * math.sqrt(0.7 * 0.3 / x.numel())
    assert torch.equal(two.unique(), torch.tensor([0.0, 1.0 / 0.7], dtype=torch.float32))
    assert not torch.equal(two, native.dropout(x, 0.3, 100))  # another seed, another mask
    halves = [native.dropout_words(5, 1 << 16)[i::2].ge(1 << 31).double().mean() for i in (0, 1)]
    assert all(abs(h - 0.5) < 0.02 for h in halves)  # (no bias between neighbours)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_module_uses_the_kernel_follows_the_seed_and_its_backward_has_the_same_mask(dtype, monkeypatch):
    calls = []
    real = native.dropout
    monkeypatch.setattr(native, "dropout", lambda *a: calls.append(a[1:]) or real(*a))
    drop = Dropout(0.25).train()
    x = torch.randn(6, 50, 33).to(dtype).requires_grad_()
    drop(x)  # (the first call of a kind is also checked against the reference: a call more)
    calls.clear()
    torch.manual_seed(3)
    y = drop(x)
    torch.manual_seed(3)
    assert torch.equal(drop(x), y)
    assert not torch.equal(drop(x), y)  # (the generator moved on)
    g = torch.randn(y.shape).to(dtype)
    y.backward(g)
    kept = y.detach().ne(0) | x.detach().eq(0)
    assert torch.equal(x.grad, g.mul(kept).mul_(1.0 / 0.75))
    assert len(calls) == 4 and calls[0] == calls[1] == calls[3]  # forward, forward again, ..., backward (its seed)
    assert torch.equal(drop.eval()(x), x)


@needs_lib
def test_without_the_kernel_the_pytorch_mask_is_used(monkeypatch):
    x = torch.ones(4096)
    set_backends(native_dropout=False)
    calls = []
    monkeypatch.setattr(native, "dropout", lambda *a: calls.append(a))
    torch.manual_seed(0)
    y = Dropout(0.5).train()(x)
    assert not calls and 0.45 < float(y.ne(0).float().mean()) < 0.55 and set(y.unique().tolist()) == {0.0, 2.0}
    set_backends(native_dropout=True)
    monkeypatch.setattr(native, "_LIB", {"lib": None, "why": "test", "path": None})
    torch.manual_seed(0)
    assert torch.equal(Dropout(0.5).train()(x), y) and not calls


@needs_lib
def test_txl_train_runs_the_kernel_and_resumes_exactly(tmp_path, monkeypatch):
    """Through `txl train` (the debug preset has dropout 0.1): the kernel runs, and a run stopped and resumed
    computes the uninterrupted run's losses (the masks' seeds come from torch's generator, which checkpoints
    keep)."""
    calls = [0]
    real = native.dropout

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(native, "dropout", counted)
    run = dict(train__log_interval=1, train__eval_interval=0, train__checkpoint_interval=3, train__max_steps=6)
    full = run_inprocess(tmp_path, "full", **run)
    assert calls[0] > 0
    part = run_inprocess(tmp_path, "part", **run, train__max_tokens=3 * 4 * 16)  # (debug preset: 4 x 16 per step)
    run_inprocess(tmp_path, "part", **run)  # --resume auto
    assert losses(part) == losses(full) and len(losses(full)) == 6
    set_backends(native_dropout=False)
    try:
        other = run_inprocess(tmp_path, "torch_mask", **run)
    finally:
        set_backends(native_dropout=True)
    assert losses(other)[0] != losses(full)[0]  # (the step's masks came from the kernel)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 64, 100, 40_001])
def test_relu_and_dropout_in_one_pass_equal_relu_then_dropout(dtype, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[:: max(1, n // 7)] = 0.0
    if n > 2:
        x[1], x[2] = float("nan"), float("-inf")
    y = native.dropout(x, 0.3, 5, relu=True)
    assert torch.equal(y.nan_to_num(7.0), native.dropout(torch.relu(x), 0.3, 5).nan_to_num(7.0))
    assert y[1].isnan().item() if n > 2 else True  # (relu keeps NaN, as torch's)
    g = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    through_both = torch.where(torch.relu(x) > 0, native.dropout(g, 0.3, 5), torch.zeros_like(g))  # (finite x)
    finite = ~x.isnan()
    assert torch.equal(native.relu_dropout_backward(g, y, 0.3)[finite], through_both[finite])


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_feed_forward_runs_relu_and_dropout_in_one_pass_with_the_same_values_and_gradients(dtype, monkeypatch):
    """A training forward and backward of the feed-forward: one native pass each way, the same output and input
    gradient as relu then Dropout (the same seed, so the same mask)."""
    torch.manual_seed(0)
    config = modeling.TransformerXLConfig(n_token=20, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=40)
    ff = modeling.PositionwiseFF(config).to(dtype).train()
    x = torch.randn(3, 9, 16).to(dtype)
    calls = []
    real = native.relu_dropout_backward
    monkeypatch.setattr(native, "relu_dropout_backward", lambda *a: calls.append(1) or real(*a))
    results = {}
    for fused in (True, False):
        set_backends(native_relu_dropout=fused)
        leaf = x.clone().requires_grad_()
        torch.manual_seed(1)
        y = ff(leaf)
        y.backward(torch.ones_like(y))
        results[fused] = (y.detach(), leaf.grad, {n: p.grad.clone() for n, p in ff.named_parameters()})
        ff.zero_grad()
    assert calls == [1]
    (y1, g1, w1), (y2, g2, w2) = results[True], results[False]
    assert torch.equal(y1, y2) and torch.equal(g1, g2) and all(torch.equal(w1[n], w2[n]) for n in w1)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_pytorch_philox_is_the_kernels_stream_bit_for_bit(dtype):
    """txl.kernels.philox, the native dropout's reference: the same words, the same masks and values (any dtype)."""
    for seed in (0, 5, 2**63 - 1, 0x1234_5678_9ABC_DEF0):
        assert torch.equal(philox.words(seed, 1000), native.dropout_words(seed, 1000))
    x = torch.randn(3, 77, 29).to(dtype)
    for relu in (False, True):
        for p in (0.1, 0.5, 0.999):
            ref = philox.dropout(x, p, 77, relu)
            if dtype != torch.float64:
                assert torch.equal(native.dropout(x, p, 77, relu), ref)
            kept = float(ref.ne(0).double().mean()) if not relu else None
            assert kept is None or abs(kept - (1 - p)) < 0.05


@needs_lib
def test_a_run_resumed_without_the_native_kernels_keeps_its_masks_and_losses(tmp_path):
    """Trained with every native kernel (Philox masks), stopped at step 3 and resumed with TXL_NATIVE=0 (as a user's
    process: no native kernel at all): the resumed run keeps the Philox stream (its checkpoint says so), drawn in
    PyTorch operations, and its losses are the uninterrupted run's within the two kernels' fp32 rounding (the native
    attention and NLL sum in another order: ~1e-6 relative per step, here under 2e-5 after 3 steps). A run begun with
    TXL_NATIVE=0 takes torch's stream instead, and says so in its checkpoint."""
    run = dict(train__log_interval=1, train__eval_interval=0, train__checkpoint_interval=3, train__max_steps=6)
    full = run_inprocess(tmp_path, "full", **run)
    part = run_inprocess(tmp_path, "part", **run, train__max_tokens=3 * 4 * 16)  # (debug preset: 4 x 16 per step)
    assert read_metadata(latest_checkpoint(part))["dropout_masks"] == "philox"
    env = {"TXL_NATIVE": "0"}
    resumed = txl_process(
        train_args(tmp_path, "part", **run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    out = resumed.communicate(timeout=300)[0].decode()
    assert resumed.returncode == 0, out
    assert "dropout masks from the philox stream (kept from the run being resumed)" in out
    got, want = dict(losses(part)), dict(losses(full))
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert all(got[s] == want[s] for s in (1, 2, 3))
    assert all(abs(got[s] - want[s]) <= 2e-5 * abs(want[s]) for s in (4, 5, 6)), (got, want)
    fresh = txl_process(train_args(tmp_path, "fresh", **run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert fresh.wait(timeout=300) == 0
    assert read_metadata(latest_checkpoint(tmp_path / "fresh"))["dropout_masks"] == "torch"


@needs_lib
def test_choosing_a_runs_stream_leaves_torchs_random_stream_as_it_was(monkeypatch):
    """The first Dropout call of a process measures which stream a run takes: its operand is drawn from a generator
    of its own, so the masks after it are those of a process that had chosen already."""
    from txl.kernels import dropout as dropout_module

    monkeypatch.setattr(dropout_module, "_STREAM_FASTER", {})
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    dropout_module.default_masks()
    assert torch.equal(torch.rand(4), expected)
