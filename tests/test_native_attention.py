"""The native attention (txl.kernels.native, attention.c and attention_grad.c): the (b)+(d) product, Appendix B's
shift, the
mask, the softmax and the value sum of attn_type 0 in one call per head, and in training its backward (with dropatt).
It must compute what the PyTorch path computes (to fp32 rounding: as close to a float64 run), outputs and gradients,
on shapes that use its vector code and its scalar tails (d_head, keys, queries not multiples of 16 or 8), with
padding and same_length masks; not depend on the number of threads; keep NaN; and be what `txl eval` and `txl train`
run, with the same results."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from train_helpers import losses, run_inprocess
from txl.cli import main
from txl.kernels import admission, native
from txl.kernels.backends import set_backends
from txl.model import modeling
from txl.model.modeling import causal_mask, rel_shift

needs_lib = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.status()}")


def inputs(B, H, T, M, Dh, extra=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = M + T
    q = torch.randn(B, T, H, Dh, generator=g).transpose(1, 2)  # [B, H, T, Dh], the model's layout
    qv = torch.randn(B, T, H, Dh, generator=g).transpose(1, 2)
    k, v = torch.randn(B, K, 2, H, Dh, generator=g).permute(2, 0, 3, 1, 4)  # [B, H, K, Dh] each, strided
    r = torch.randn(H, Dh, K + extra, generator=g)  # W_kR R for the distances K-1 .. 0 (and zero-padding columns)
    return q, qv, k, v, r


def reference(q, qv, k, v, r, mask, dtype):
    """The PyTorch path's computation: (b)+(d) by distance, the shift, the mask, SDPA."""
    B, H, T, _ = q.shape
    K = k.shape[2]
    bd = rel_shift(torch.einsum("bhtd,hdc->bhtc", qv.to(dtype), r[..., :K].to(dtype)).contiguous(), K)
    bias = bd.masked_fill(causal_mask(T, K - T, False, 0) if mask is None else mask, float("-inf"))
    out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=bias, scale=1.0)
    return out.transpose(1, 2).reshape(B, T, -1)


def padding_mask(B, T, M):
    causal = causal_mask(T, M, False, 0)
    padded = torch.zeros(B, M + T, dtype=torch.bool)
    padded[0, :3] = True  # row 0 left-padded
    return (causal | (padded[:, None, :] & ~padded[:, -T:, None]))[:, None]  # [B, 1, T, K]


@needs_lib
@pytest.mark.parametrize(
    "B, H, T, M, Dh, extra, pad",
    [
        (2, 3, 5, 4, 12, 0, False),  # d_head 12: the scalar tails everywhere
        (2, 2, 20, 20, 32, 3, False),  # the bench d_head, blocks of 8 queries with a partial last one
        (1, 2, 17, 16, 48, 8, False),  # 3 vector chunks of d_head
        (3, 1, 8, 0, 16, 0, False),  # no memory
        (2, 2, 9, 61, 64, 1, True),  # keys not a multiple of 16, padding
        (1, 1, 3, 0, 80, 0, False),  # 5 chunks (4 + 1)
        (2, 2, 33, 40, 32, 0, True),
        (1, 3, 1, 10, 32, 0, False),  # one query (a prompt of one token; attention_rows from here on)
        (3, 4, 1, 64, 16, 0, True),  # an agent's acting step: d_head 16, 65 keys, padding
        (2, 2, 1, 40, 12, 2, True),  # one query, d_head 12: the scalar products
        (4, 2, 1, 256, 16, 0, False),  # a long memory
        (2, 1, 1, 0, 32, 0, False),  # one key
    ],
)
def test_native_attention_is_as_exact_as_the_pytorch_path(B, H, T, M, Dh, extra, pad):
    q, qv, k, v, r = inputs(B, H, T, M, Dh, extra)
    mask = padding_mask(B, T, M) if pad else causal_mask(T, M, False, 0)
    out = native.attention(q, k, v, qv=qv, r=r, mask=mask)
    exact = reference(q, qv, k, v, r, mask, torch.float64)
    fp32 = reference(q, qv, k, v, r, mask, torch.float32)
    assert out.shape == (B, T, H * Dh)
    assert (out.double() - exact).abs().max() <= 2 * (fp32.double() - exact).abs().max() + 1e-6
    bias = torch.randn(B, H, T, M + T, generator=torch.Generator().manual_seed(1)).masked_fill(mask, float("-inf"))
    plain = native.attention(q, k, v, bias=bias)  # (the bias form: no positional term)
    sdpa = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double(), scale=1.0)
    assert (plain.double() - sdpa.transpose(1, 2).reshape(B, T, -1)).abs().max() <= 1e-5


@needs_lib
@pytest.mark.parametrize("density", [0.02, 0.3])
def test_native_attention_masks_keys_anywhere_in_a_row(density):
    """A mask with keys masked at any column (the kernel skips runs of 8 unmasked mask bytes at a time): what the
    PyTorch path gives, in inference and in training's forward."""
    B, H, T, M, Dh = 2, 2, 21, 43, 32
    q, qv, k, v, r = inputs(B, H, T, M, Dh)
    scattered = torch.rand(B, 1, T, M + T, generator=torch.Generator().manual_seed(2)) < density
    scattered[..., torch.arange(T), M + torch.arange(T)] = False  # (each query keeps its own key)
    mask = causal_mask(T, M, False, 0) | scattered  # [B, 1, T, K]
    exact = reference(q, qv, k, v, r, mask, torch.float64)
    fp32 = reference(q, qv, k, v, r, mask, torch.float32)
    for out in (native.attention(q, k, v, qv=qv, r=r, mask=mask), native.attention_train(q, k, v, qv, r, mask)[0]):
        assert (out.double() - exact).abs().max() <= 2 * (fp32.double() - exact).abs().max() + 1e-6


@needs_lib
@pytest.mark.parametrize("T, row", [(19, 5), (1, 0)])  # (blocks of queries; one query per head)
def test_native_attention_does_not_depend_on_the_number_of_threads_and_keeps_nan(T, row):
    q, qv, k, v, r = inputs(4, 3, T, 30, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.attention(q, k, v, qv=qv, r=r, mask=causal_mask(T, 30, False, 0))
        torch.set_num_threads(2)
        two = native.attention(q, k, v, qv=qv, r=r, mask=causal_mask(T, 30, False, 0))
    finally:
        torch.set_num_threads(threads)
    assert one.equal(two)
    q = q.clone()
    q[1, 2, row, 0] = float("nan")
    out = native.attention(q, k, v, qv=qv, r=r, mask=causal_mask(T, 30, False, 0)).view(4, T, 3, 32)
    assert out[1, row, 2].isnan().all() and not out[1, row, [0, 1]].isnan().any() and not out[0].isnan().any()


@needs_lib
def test_txl_eval_runs_the_kernel_with_the_pytorch_paths_result(tmp_path, monkeypatch, capsys):
    """`txl eval` (K/V cache, memory longer than in training) calls the kernel, and its loss equals the PyTorch
    kernels' to fp32 rounding."""
    run = run_inprocess(tmp_path, train__max_steps=3, train__eval_interval=0)
    calls = []
    real = native.attention
    monkeypatch.setattr(native, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = ["eval", "--model", str(run), "--max_batches", "4", "--mem_len", "40", "--json"]
    capsys.readouterr()
    main(args)
    with_kernel = json.loads(capsys.readouterr().out)
    assert len(calls) >= 4 * 2  # (every layer of every segment)
    n = len(calls)
    set_backends(native_attention=False)
    main(args)
    without = json.loads(capsys.readouterr().out)
    assert len(calls) == n
    assert abs(with_kernel["loss"] - without["loss"]) <= 1e-5 and with_kernel["tokens"] == without["tokens"]


def reference_train(q, qv, kv, r, mask, dtype, factors=None):
    """The PyTorch path's training attention, differentiable: (b)+(d) by distance, the shift, the mask, the softmax,
    the dropout ``factors`` (0 or 1/(1-p) per probability), the value sum."""
    B, H, T, _ = q.shape
    k, v = kv.to(dtype)
    K = k.shape[2]
    bd = rel_shift(torch.einsum("bhtd,hdc->bhtc", qv.to(dtype), r[..., :K].to(dtype)).contiguous(), K)
    score = (q.to(dtype) @ k.transpose(-1, -2) + bd).masked_fill(mask, float("-inf"))
    prob = score.softmax(-1)
    prob = prob if factors is None else prob * factors.to(dtype)
    return (prob @ v).transpose(1, 2).reshape(B, T, -1)


def train_inputs(B, H, T, M, Dh, extra=0, seed=0):
    q, qv, k, v, r = inputs(B, H, T, M, Dh, extra, seed)
    kv = torch.stack([k, v], 2).permute(2, 0, 1, 3, 4).contiguous()  # [2, B, H, K, Dh]
    kv = kv.permute(1, 3, 0, 2, 4).contiguous().permute(2, 0, 3, 1, 4)  # (the projection's layout, [B, K, 2, H, Dh])
    return q, qv, kv, r


def train_mask(kind, B, T, M, mem_len=7):
    if kind == "padding":
        return padding_mask(B, T, M)
    return causal_mask(T, M, kind == "same_length", mem_len)


@needs_lib
@pytest.mark.parametrize(
    "B, H, T, M, Dh, extra, kind, dropatt",
    [
        (2, 3, 5, 4, 12, 0, "causal", 0.0),  # d_head 12: the scalar tails everywhere
        (2, 2, 20, 20, 32, 3, "causal", 0.0),  # the bench d_head, a partial last block, a wider W_kR R
        (1, 2, 17, 16, 48, 0, "causal", 0.3),  # 3 vector chunks of d_head (2 + 1 in the outer products), dropatt
        (3, 1, 8, 0, 16, 0, "causal", 0.0),  # no memory
        (2, 2, 9, 61, 64, 1, "padding", 0.1),  # keys not a multiple of 16, padding
        (2, 2, 33, 40, 32, 0, "same_length", 0.2),
        (1, 3, 1, 10, 32, 0, "causal", 0.0),  # one query
        (1, 2, 40, 40, 80, 0, "same_length", 0.0),  # 5 chunks of d_head
        (5, 4, 11, 13, 32, 0, "causal", 0.0),  # the backward's batch groups: 2, 2, 1 and an empty one per head
    ],
)
def test_training_attention_and_its_gradients_are_as_exact_as_the_pytorch_path(B, H, T, M, Dh, extra, kind, dropatt):
    q, qv, kv, r = train_inputs(B, H, T, M, Dh, extra)
    K = M + T
    mask = train_mask(kind, B, T, M)
    drop = (dropatt, 1234) if dropatt else None
    factors = native.dropout(torch.ones(B, H, T, K), *drop) if drop else None  # (Dropout's mask for that seed)
    grad = torch.randn(B, T, H * Dh, generator=torch.Generator().manual_seed(2))
    assert native.attention_applies(q, kv[0], kv[1], qv, r)
    out, prob = native.attention_train(q, kv[0], kv[1], qv, r, mask, drop)
    ours = (out, *native.attention_backward(q, kv[0], kv[1], qv, r, prob, grad, drop))
    runs = {}
    for dtype in (torch.float64, torch.float32):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, qv, kv, r)]
        y = reference_train(*leaves, mask, dtype, factors)
        y.backward(grad.to(dtype))
        runs[dtype] = (y.detach(), *(t.grad.transpose(1, 2) if i < 2 else t.grad for i, t in enumerate(leaves)))
    names = ("out", "dq", "dqv", "dkv", "dr")
    for name, a, exact, fp32 in zip(names, ours, runs[torch.float64], runs[torch.float32], strict=True):
        assert a.shape == exact.shape, name
        bound = 2 * (fp32.double() - exact).abs().max() + 2e-6 * exact.abs().max()
        assert (a.double() - exact).abs().max() <= bound, name
    assert (ours[4][..., K:] == 0).all()  # (W_kR R's padding columns get no gradient)
    expected = runs[torch.float64][0].new_zeros(B, H, T, K)
    assert prob.shape == expected.shape and (prob[mask.expand(B, H, T, K)] == 0).all()  # (kept before dropout)


@needs_lib
def test_training_attention_does_not_depend_on_the_number_of_threads():
    q, qv, kv, r = train_inputs(4, 3, 19, 30, 32)
    mask = causal_mask(19, 30, False, 0)
    grad = torch.randn(4, 19, 96, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, prob = native.attention_train(q, kv[0], kv[1], qv, r, mask, (0.2, 99))
            results.append((out, prob, *native.attention_backward(q, kv[0], kv[1], qv, r, prob, grad, (0.2, 99))))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(a.equal(b) for a, b in zip(results[0], other, strict=True))


@needs_lib
def test_the_kernels_form_the_query_terms_as_the_pytorch_path_does():
    """With the biases given (u, v, scale), the kernels take the raw queries and form (q + u) * scale and
    (q + v) * scale themselves, rounded as torch rounds the two operations: the same outputs and probabilities, bit
    for bit, as with the terms formed by torch; the backward gives the gradients of q + u and q + v (times the
    scale)."""
    B, H, T, M, Dh = 3, 2, 13, 9, 32
    q, _, k, v, r = inputs(B, H, T, M, Dh)
    g = torch.Generator().manual_seed(5)
    u, vb, scale = torch.randn(H, Dh, generator=g), torch.randn(H, Dh, generator=g), 1.0 / math.sqrt(Dh)
    rows = q.transpose(1, 2)  # [B, T, H, Dh], the model's layout of the raw queries
    qu, qv = ((rows + u) * scale).transpose(1, 2), ((rows + vb) * scale).transpose(1, 2)
    mask, drop, biases = causal_mask(T, M, False, 0), (0.2, 7), (u, vb, scale)
    formed = native.attention(qu, k, v, qv=qv, r=r, mask=mask)
    assert native.attention(q, k, v, qv=q, r=r, mask=mask, query_bias=biases).equal(formed)
    last = slice(T - 1, T)  # (one query per head: the single-row path forms them the same way)
    one = native.attention(q[:, :, last], k, v, qv=q[:, :, last], r=r, mask=mask[last], query_bias=biases)
    assert one.equal(native.attention(qu[:, :, last], k, v, qv=qv[:, :, last], r=r, mask=mask[last]))
    assert (one - formed[:, last]).abs().max() < 1e-5  # (the last query's row of the blocks' result)
    out, prob = native.attention_train(q, k, v, q, r, mask, drop, biases)
    out_formed, prob_formed = native.attention_train(qu, k, v, qv, r, mask, drop)
    assert out.equal(out_formed) and prob.equal(prob_formed)
    grad = torch.randn(B, T, H * Dh, generator=g)
    d_u, d_v, dkv, dr = native.attention_backward(q, k, v, q, r, prob, grad, drop, biases)
    dqu, dqv, dkv_formed, dr_formed = native.attention_backward(qu, k, v, qv, r, prob, grad, drop)
    assert d_u.equal(dqu * scale) and d_v.equal(dqv * scale) and dkv.equal(dkv_formed) and dr.equal(dr_formed)


def _training_run(model, x, y, seed):
    """Two segments (the second with the first's memory), the sum of their losses backpropagated: the second
    segment's losses and every parameter's gradient."""
    model.zero_grad()
    torch.manual_seed(seed)
    first = model(x, y)
    second = model(x, y, mems=first.mems)
    (first.loss.mean() + second.loss.mean()).backward()
    return second.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@needs_lib
@pytest.mark.parametrize("dropatt, same_length", [(0.0, False), (0.25, False), (0.1, True)])
def test_model_training_runs_the_kernels_with_the_pytorch_paths_losses_and_gradients(dropatt, same_length, monkeypatch):
    """A training step (dropout, dropatt with Dropout's mask, memory) gives the PyTorch kernels' losses and gradients,
    through the native forward and backward in every layer; what they do not cover stays on the PyTorch path."""
    config = modeling.TransformerXLConfig(
        n_token=50, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, dropout=0.1, dropatt=dropatt, mem_len=12,
        same_length=same_length,
    )  # fmt: skip
    model = modeling.TransformerXLLM(config).train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50, (3, 10), generator=g), torch.randint(0, 50, (3, 10), generator=g)
    calls = []
    real = native.attention_train
    # (its dropout; not the calls of the first call's check against the reference: txl.kernels.admission)
    monkeypatch.setattr(
        native, "attention_train", lambda *a: (admission.checking() or calls.append(a[6])) and 0 or real(*a)
    )
    loss, grads = _training_run(model, x, y, seed=5)
    assert len(calls) == 2 * 2 and all((c is None) == (dropatt == 0) for c in calls)
    set_backends(native_attention=False)
    loss_torch, grads_torch = _training_run(model, x, y, seed=5)
    assert len(calls) == 4
    assert (loss - loss_torch).abs().max() <= 1e-5 * loss_torch.abs().max()
    assert grads.keys() == grads_torch.keys()
    for name, grad in grads.items():
        assert (grad - grads_torch[name]).abs().max() <= 1e-5 * grads_torch[name].abs().max() + 1e-8, name
    set_backends(native_attention=True)
    if dropatt:  # (PyTorch's dropout mask: the PyTorch kernels)
        set_backends(native_dropout=False)
        _training_run(model, x, y, seed=5)
        assert len(calls) == 4
        set_backends(native_dropout=True)
    model.eval()  # (gradients in eval mode: the kernel without dropout)
    model(x, y).loss.mean().backward()
    assert len(calls) == 6 and calls[-1] is None
    model(x, y, output_attentions=True)  # (the probabilities asked for: the PyTorch kernels)
    assert len(calls) == 6


@needs_lib
def test_txl_train_runs_the_native_attention_with_the_pytorch_paths_losses(tmp_path, monkeypatch):
    """`txl train` on the debug preset (dropatt 0.1): every layer of every step runs the native forward and backward,
    and the training and validation losses equal those of the PyTorch kernels to fp32 rounding."""
    counts = {"attention_train": 0, "attention_backward": 0}
    for name in counts:
        real = getattr(native, name)
        monkeypatch.setattr(
            native, name, lambda *a, name=name, real=real: counts.__setitem__(name, counts[name] + 1) or real(*a)
        )
    run = dict(train__log_interval=1, train__eval_interval=3, train__max_steps=6)
    fast = run_inprocess(tmp_path, "fast", **run)
    assert counts["attention_train"] >= 6 * 2 and counts["attention_backward"] == counts["attention_train"]
    set_backends(native_attention=False)
    slow = run_inprocess(tmp_path, "slow", **run)
    assert counts["attention_train"] == counts["attention_backward"] >= 12
    for split in ("train", "valid"):
        a, b = losses(fast, split), losses(slow, split)
        assert len(a) == len(b) > 0 and [s for s, _ in a] == [s for s, _ in b]
        assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for (_, x), (_, y) in zip(a, b, strict=True)), (a, b)
