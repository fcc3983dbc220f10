"""The native inference attention (txl.native, attention.c): the (b)+(d) product, Appendix B's shift, the mask, the
softmax and the value sum of attn_type 0 in one call per head. It must compute what the PyTorch path computes (to
fp32 rounding: as close to a float64 run), on shapes that use its vector code and its scalar tails (d_head, keys,
queries not multiples of 16 or 8), with padding; not depend on the number of threads; keep NaN; and be what
`txl eval` runs, with the same result."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from train_helpers import run_inprocess
from txl import modeling, native
from txl.cli import main
from txl.modeling import attention_mask, rel_shift

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
    bias = bd.masked_fill(attention_mask(T, K - T, False, 0) if mask is None else mask, float("-inf"))
    out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=bias, scale=1.0)
    return out.transpose(1, 2).reshape(B, T, -1)


def padding_mask(B, T, M):
    causal = attention_mask(T, M, False, 0)
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
        (1, 3, 1, 10, 32, 0, False),  # one query (a prompt of one token)
    ],
)
def test_native_attention_is_as_exact_as_the_pytorch_path(B, H, T, M, Dh, extra, pad):
    q, qv, k, v, r = inputs(B, H, T, M, Dh, extra)
    mask = padding_mask(B, T, M) if pad else attention_mask(T, M, False, 0)
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
def test_native_attention_does_not_depend_on_the_number_of_threads_and_keeps_nan():
    q, qv, k, v, r = inputs(4, 3, 19, 30, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.attention(q, k, v, qv=qv, r=r, mask=attention_mask(19, 30, False, 0))
        torch.set_num_threads(2)
        two = native.attention(q, k, v, qv=qv, r=r, mask=attention_mask(19, 30, False, 0))
    finally:
        torch.set_num_threads(threads)
    assert one.equal(two)
    q = q.clone()
    q[1, 2, 5, 0] = float("nan")
    out = native.attention(q, k, v, qv=qv, r=r, mask=attention_mask(19, 30, False, 0)).view(4, 19, 3, 32)
    assert out[1, 5, 2].isnan().all() and not out[1, 5, [0, 1]].isnan().any() and not out[0].isnan().any()


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
    monkeypatch.setattr(modeling, "NATIVE_ATTENTION", False)
    main(args)
    without = json.loads(capsys.readouterr().out)
    assert len(calls) == n
    assert abs(with_kernel["loss"] - without["loss"]) <= 1e-5 and with_kernel["tokens"] == without["tokens"]
