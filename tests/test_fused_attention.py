"""The fused Triton attention (txl.kernels.fused_attention), run on the CPU under Triton's interpreter: held to the
attention's definition, forward and backward, on odd shapes, a memory at every fill level, padding and same_length
masks, strided keys and values, a cache's wider W_kR R table, fp32 (1e-5), fp16 and bf16, with attention dropout
(given the kernel's own mask); registered as a torch.library op that torch.compile, export and opcheck see. The
model-level check (training, prompts, cached evaluation) is the backends' parametrized test
(tests/test_backends_exact.py, field fused_attention).

On a GPU the same tests run the compiled kernels: ``TRITON_INTERPRET=0 TXL_TEST_DEVICE=cuda pytest
tests/test_fused_attention.py`` (benchmarks/gpu_suite.sh does)."""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="the fused attention needs triton (extra 'triton')")

from txl.kernels import fused_attention  # noqa: E402
from txl.kernels.fused_attention import dropout_keep, fused_rel_attention  # noqa: E402
from txl.model.positions import causal_mask  # noqa: E402

DEVICE = os.environ.get("TXL_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not fused_attention.INTERPRETED, reason="needs TRITON_INTERPRET=1 (tests/conftest.py)"
)


def definition(q, u, v, k, vv, r, mask, scale, keep=None, p=0.0):
    """Sec. 3.3 written out: query i (position M+i) and key j score (q_i+u).k_j + (q_i+v).W_kR R_{M+i-j}, where
    column c of ``r`` holds distance K-1-c; masked keys -inf; softmax; dropout by ``keep``; the value sum. The products
    in the keys' dtype (as autocast's), the softmax in fp32."""
    B, T, H, Dh = q.shape
    K = k.shape[2]
    qu = ((q.float() + u) * scale).to(k.dtype).transpose(1, 2)  # [B, H, T, Dh]
    qv = ((q.float() + v) * scale).to(k.dtype)
    ac = (qu @ k.transpose(-1, -2)).float()  # [B, H, T, K]
    distance = (torch.arange(T, device=q.device)[:, None] + (K - T)) - torch.arange(K, device=q.device)[None, :]
    column = (K - 1 - distance).clamp(0, r.shape[-1] - 1)  # (future keys: any column, they are masked)
    bd = torch.einsum("bthd,hdc->bhtc", qv, r).float().gather(-1, column.expand(B, H, T, K))
    s = (ac + bd).masked_fill(mask, float("-inf"))
    prob = s.softmax(-1)
    if keep is not None:
        prob = prob * keep / (1 - p)
    return (prob.to(vv.dtype) @ vv).transpose(1, 2).reshape(B, T, H * Dh)


def operands(B, T, M, H, Dh, dtype, extra_columns=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = T + M
    q = torch.randn(B, T, H, Dh, generator=g).to(dtype)
    u = torch.randn(H, Dh, generator=g)
    v = torch.randn(H, Dh, generator=g)
    kv = torch.randn(2, B, H, K, Dh, generator=g).to(dtype)  # (k, v: strided views of one tensor)
    r = torch.randn(H, Dh, K + extra_columns, generator=g).to(dtype)
    if extra_columns:  # (a cache's table: zero columns after the K used)
        r[..., K:] = 0
    return tuple(t.detach().to(DEVICE).requires_grad_() for t in (q, u, v, kv, r))


def causal(T, M, same_length=False, window=0):
    return causal_mask(T, M, same_length, window, device=DEVICE)


def compare(q, u, v, kv, r, mask, tol, keep=None, p=0.0, seed=0):
    scale = 1 / math.sqrt(q.shape[-1])
    out = fused_rel_attention(q, u, v, kv[0], kv[1], r, mask, scale, p, seed)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, u, v, kv, r), grad)
    ref = definition(q, u, v, kv[0], kv[1], r, mask, scale, keep, p)
    want = torch.autograd.grad(ref, (q, u, v, kv, r), grad)
    torch.testing.assert_close(out, ref, **tol)
    for name, a, b in zip(("q", "u", "v", "kv", "r"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"d{name}: {m}")
    return out


FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [0, 1, 5, 16, 23])  # the memory's fill level (0: the first segment)
def test_fp32_forward_and_backward_at_every_fill_level(M):
    q, u, v, kv, r = operands(2, 7, M, 3, 12, torch.float32, seed=M)  # (3 heads of 12: Dh not a power of two)
    compare(q, u, v, kv, r, causal(7, M), FP32)


@pytest.mark.parametrize(
    "T,M,H,Dh", [(1, 9, 2, 16), (17, 15, 2, 8), (33, 40, 1, 32), (20, 0, 2, 64), (9, 14, 1, 96), (5, 6, 1, 128)]
)  # (Dh 96 and 128: enwik8-large's heads, the largest tiles)
def test_fp32_odd_shapes_span_several_tiles(T, M, H, Dh):
    q, u, v, kv, r = operands(2, T, M, H, Dh, torch.float32, seed=T)
    compare(q, u, v, kv, r, causal(T, M, True, 11), FP32)  # (same_length: a window of 11 keys)


def test_padding_masks_per_row_and_a_caches_wider_table():
    T, M = 9, 12
    q, u, v, kv, r = operands(3, T, M, 2, 16, torch.float32, extra_columns=8, seed=3)
    padded = torch.zeros(3, T + M, dtype=torch.bool, device=DEVICE)
    padded[1, :5] = True  # (left padding of one row, as a batched prompt has)
    padded[2, :14] = True
    mask = (causal(T, M) | (padded[:, None, :] & ~padded[:, -T:, None]))[:, None]  # [B, 1, T, K]
    compare(q, u, v, kv, r, mask, FP32)


@pytest.mark.parametrize("dtype,Dh", [(torch.float16, 16), (torch.bfloat16, 16), (torch.bfloat16, 128)])
def test_half_precision_within_its_rounding(dtype, Dh):
    q, u, v, kv, r = operands(2, 18, 9, 2, Dh, dtype, seed=7)
    out = compare(q, u, v, kv, r, causal(18, 9), dict(rtol=3e-2, atol=3e-2))
    assert out.dtype == dtype


def test_attention_dropout_is_the_reference_with_the_kernels_mask():
    B, T, M, H, p = 2, 24, 16, 2, 0.25
    q, u, v, kv, r = operands(B, T, M, H, 16, torch.float32, seed=11)
    mask = causal(T, M)
    keep = dropout_keep(B, H, T, T + M, p, 1234, DEVICE)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.03
    out = compare(q, u, v, kv, r, mask, FP32, keep=keep, p=p, seed=1234)
    scale = 1 / math.sqrt(16)
    again = fused_rel_attention(q, u, v, kv[0], kv[1], r, mask, scale, p, 1234)
    other = fused_rel_attention(q, u, v, kv[0], kv[1], r, mask, scale, p, 4321)
    assert torch.equal(out, again) and not torch.allclose(out, other)


def test_a_broken_shift_is_caught():
    """The definition above is strict enough: the shift one column off (what a wrong Appendix-B shift gives) errs
    by O(1)."""
    q, u, v, kv, r = operands(2, 9, 6, 2, 16, torch.float32, seed=5)
    mask = causal(9, 6)
    with torch.no_grad():
        out = fused_rel_attention(q, u, v, kv[0], kv[1], r, mask, 0.25)
        wrong = definition(q, u, v, kv[0], kv[1], torch.roll(r, 1, -1), mask, 0.25)
    assert (out - wrong).abs().max() > 0.1


def test_registered_op_passes_opcheck_and_is_seen_by_compile_and_export():
    q, u, v, kv, r = operands(1, 5, 4, 2, 16, torch.float32, seed=2)
    mask = causal(5, 4)
    k, vv = kv[0].detach().contiguous(), kv[1].detach().contiguous()
    args = (q.detach(), u.detach(), v.detach(), k, vv, r.detach(), mask, 0.25, 0.0, None)
    torch.library.opcheck(torch.ops.txl.rel_attention.default, args)  # schema, fake tensors, autograd registration
    seed = torch.tensor([99], device=DEVICE)
    torch.library.opcheck(torch.ops.txl.rel_attention.default, (*args[:8], 0.2, seed))  # (with dropout)

    def attention(q, u, v, k, vv, r, mask):
        return fused_rel_attention(q, u, v, k, vv, r, mask, 0.25)

    eager = attention(*args[:7])
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")(*args[:7])  # (no graph break)
    torch.testing.assert_close(compiled, eager)

    class Attention(torch.nn.Module):
        def forward(self, q, u, v, k, vv, r, mask):
            return attention(q, u, v, k, vv, r, mask)

    exported = torch.export.export(Attention(), args[:7])
    assert "txl.rel_attention" in str(exported.graph)


@pytest.mark.slow  # (35-74 s: torch.compile of the layers; CI runs it)
def test_compiled_layers_call_the_fused_op_without_a_graph_break(monkeypatch):
    """The GPU's training configuration with the kernel on (layers compiled by Inductor, the attention the fused
    op): no graph break, and the loss and every gradient of two segments with the memory equal the reference
    path's (no dropout: the two paths' random streams differ)."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM, use_backends

    torch.manual_seed(0)
    cfg = debug_config(n_head=2, d_head=16, d_model=32, d_inner=48, mem_len=6, dropout=0.0, dropatt=0.0)
    model = TransformerXLLM(cfg).to(DEVICE).train()
    x = torch.randint(0, cfg.n_token, (2, 17), device=DEVICE)

    def two_segments(**policy):
        model.zero_grad(set_to_none=True)
        mems, total = None, 0.0
        with use_backends(**policy):
            for seg in (slice(0, 8), slice(8, 16)):
                out = model(x[:, seg], x[:, seg.start + 1 : seg.stop + 1], mems=mems)
                out.loss.backward()
                mems, total = out.mems, total + float(out.loss)
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = two_segments(native_kernels=False, compiled_layers=(), sdpa_training_devices=())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    calls, kernel = [], fused_attention.fused_rel_attention
    monkeypatch.setattr(fused_attention, "fused_rel_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    loss, grads = two_segments(fused_attention_training=(DEVICE,), compiled_layers=(DEVICE,), native_kernels=False)
    assert calls, "the fused kernel did not run"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # With dropatt the key of the kernel's mask is drawn on the device inside the graph: still no graph break.
    for layer in model.transformer.layers:
        layer.attn.dropatt.p = 0.3
    torch._dynamo.utils.counters.clear()
    calls.clear()
    dropped, _ = two_segments(fused_attention_training=(DEVICE,), compiled_layers=(DEVICE,), native_kernels=False)
    assert calls and math.isfinite(dropped) and dropped != loss
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_operands_it_does_not_take_are_refused_with_a_clear_error():
    """The model's backend asks applies() first (and runs the reference otherwise); a direct call with operands the
    kernels do not take gets one ValueError naming them, not a wrong result."""
    q, u, v, kv, r = operands(1, 6, 3, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="not the kernel's"):  # (T > 1 without a mask: the future keys are visible)
        fused_rel_attention(q, u, v, kv[0], kv[1], r, None, 0.25)
    with pytest.raises(ValueError, match="not the kernel's"):  # (R narrower than the keys)
        fused_rel_attention(q, u, v, kv[0], kv[1], r[..., :5], causal(6, 3), 0.25)
    with pytest.raises(ValueError, match="needs its seed"):
        torch.ops.txl.rel_attention(q, u, v, kv[0], kv[1], r, causal(6, 3), 0.25, 0.1, None)
    strided = torch.randn(1, 6, 2, 32, device=DEVICE)[..., ::2]  # (the head dimension not contiguous)
    assert fused_attention.applies(q, u, v, kv[0], kv[1], r, causal(6, 3))
    assert not fused_attention.applies(strided, u, v, kv[0], kv[1], r, causal(6, 3))
    assert not fused_attention.applies(q, u, v, kv[0], kv[1], r, causal(6, 3).float())  # (a float mask)


def test_an_exported_model_leaves_the_fused_op_out():
    """An exported graph (torch.export, the ONNX exporter's) must not need txl's library: where the policy would
    take the fused kernel, export traces the reference instead; an eager call of the same model takes the kernel."""
    from tests.conftest import debug_config
    from txl import Backends, TransformerXLLM, use_backends
    from txl.kernels.backends import traced_policy

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(n_head=2, d_head=16, d_model=32, d_inner=48)).to(DEVICE).eval()
    x = torch.randint(0, 97, (2, 6), device=DEVICE)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, ids):
            return self.lm(ids, return_log_probs=True).log_probs

    policy = Backends(native_kernels=False, fused_attention=(DEVICE,))
    previous = traced_policy(policy)  # (what code being traced reads)
    try:
        with torch.no_grad():
            exported = torch.export.export(Logits(), (x,))
    finally:
        traced_policy(previous)
    assert "rel_attention" not in str(exported.graph)
    calls, kernel = [], fused_attention.fused_rel_attention
    fused_attention.fused_rel_attention = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    try:
        with use_backends(policy), torch.no_grad():
            eager = Logits()(x)
    finally:
        fused_attention.fused_rel_attention = kernel
    assert calls  # (the same policy, eagerly: the kernel)
    torch.testing.assert_close(exported.module()(x), eager, rtol=1e-4, atol=1e-5)
