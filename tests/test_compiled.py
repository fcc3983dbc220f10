"""The GPU's training paths, checked on the CPU: the layers compiled by torch.compile (Inductor's CPU code stands in
for its Triton code) trace without a graph break, take the compiled path only where they should, and compute the
reference's values; the shift by pad-and-slice is the shift; the adaptive softmax's half-precision products keep an
fp32 loss. (tests/test_backends_exact.py holds both paths to the reference on the whole model.)"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM, use_backends
from txl.kernels import compiled
from txl.kernels.linear import logits_linear
from txl.model.positions import rel_shift, rel_shift_padded

CONFIG = dict(n_token=50, d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24, n_layer=2, mem_len=4, dropout=0.0)


def two_segments(model, x):
    model.zero_grad(set_to_none=True)
    a = model(x[:, :5], x[:, 1:6])
    b = model(x[:, 5:10], x[:, 6:11], mems=a.mems)
    (a.loss + b.loss).backward()
    return float(a.loss + b.loss), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # (64 s on 2 AVX2 cores: Inductor compiles every layer shape; CI runs it)
@pytest.mark.parametrize("graphs", [False, True])
def test_the_compiled_layers_trace_whole_and_compute_the_reference(graphs):
    """Also in Inductor's "reduce-overhead" mode (``compiled_layers_graphs``: CUDA graphs on a GPU; on the CPU the
    same compiled code without them): the graphed call is the one taken, and it computes the reference."""
    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(**CONFIG)).train()
    x = torch.randint(0, 50, (2, 11))
    with use_backends(native_kernels=False):
        loss_ref, grads_ref = two_segments(model, x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    calls = []
    real = compiled._compiled

    def spy(graphed: bool = False):
        calls.append(graphed)
        return real(graphed)

    compiled._compiled = spy
    try:
        with use_backends(compiled_layers=("cpu",), compiled_layers_graphs=("cpu",) if graphs else ()):
            loss, grads = two_segments(model, x)
    finally:
        compiled._compiled = real
    assert calls == [graphs] * 2 * CONFIG["n_layer"]  # (every layer of both segments took the compiled path)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_compiled_path_is_for_training_calls_only():
    model = TransformerXLLM(debug_config(**CONFIG))
    layer = model.transformer.layers[0]
    h = torch.zeros(1, 3, 16)
    with use_backends(compiled_layers=("cpu",)):
        assert compiled.compiled_applies(h, layer.train())
        assert not compiled.compiled_applies(h, layer, need_weights=True)
        assert not compiled.compiled_applies(h, layer, cache=object())
        assert not compiled.compiled_applies(h, layer.eval())
        with torch.no_grad():
            assert not compiled.compiled_applies(h, layer.train())
    assert not compiled.compiled_applies(h, layer.train())  # (the default: CUDA only)


@pytest.mark.parametrize(("T", "K"), [(1, 1), (3, 3), (5, 9), (7, 19)])
def test_the_padded_shift_is_the_shift(T, K):
    raw = torch.randn(2, 3, T, K, requires_grad=True)
    visible = torch.ones(T, K, dtype=torch.bool).tril(K - T)  # (query i sees keys j <= M + i: the others are masked)
    a, b = rel_shift(raw), rel_shift_padded(raw)
    torch.testing.assert_close(a[..., visible], b[..., visible], rtol=0, atol=0)
    g = torch.randn(2, 3, T, K) * visible
    (ga,) = torch.autograd.grad(a, raw, g)
    (gb,) = torch.autograd.grad(b, raw, g)
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)


def test_half_precision_logits_keep_an_fp32_loss_and_apply_only_where_asked():
    torch.manual_seed(0)
    h, w, b = torch.randn(64, 32), torch.randn(1000, 32) / 6, torch.randn(1000)
    ref = torch.nn.functional.linear(h, w, b)
    with use_backends(half_precision_logits=("cpu",)):
        half = logits_linear(h, w, b, torch.bfloat16)
        assert logits_linear(h, w, b, None).equal(ref)  # (no autocast: fp32)
    assert half.dtype == torch.float32 and not half.equal(ref)
    torch.testing.assert_close(half, ref, rtol=2e-2, atol=5e-2)  # (bf16 operands)
    assert logits_linear(h, w, b, torch.bfloat16).equal(ref)  # (the default: CUDA only)


def test_the_policy_fixed_for_a_compiled_call_is_put_back_after_it():
    """Code compiled or exported later, elsewhere (torch.export, the ONNX exporter), reads the policy that was in
    force before a compiled layer call, not the one fixed for that call (it once made an ONNX export trace the fused
    attention that a previous test had turned on)."""
    from txl.kernels.backends import Backends, traced_policy

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(**CONFIG)).train()
    x = torch.randint(0, 50, (2, 11))
    before = Backends()
    traced_policy(before)
    with use_backends(compiled_layers=("cpu",), half_precision_scores=False):
        two_segments(model, x)
    assert traced_policy(None) is before


def test_a_users_torch_compile_reads_the_process_policy_and_recompiles_when_it_changes():
    """A user's own torch.compile of the model traces txl's ops with the process's policy (txl.set_backends), not
    the defaults: with the fused attention turned on for the CPU (Triton's interpreter) the traced graph calls it,
    and turned off again the next call recompiles without it."""
    from txl import set_backends

    graphs = []

    def record(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(n_head=2, d_head=16, d_model=32, d_inner=48)).eval()
    x = torch.randint(0, 97, (2, 6))
    ref = model(x, return_log_probs=True).log_probs
    run = torch.compile(lambda ids: model(ids, return_log_probs=True).log_probs, backend=record)
    torch._dynamo.reset()
    set_backends(fused_attention=("cpu",), native_kernels=False)
    with torch.no_grad():
        out = run(x)
        assert len(graphs) == 1 and "rel_attention" in graphs[0]
        set_backends(fused_attention=())
        again = run(x)
    assert len(graphs) == 2 and "rel_attention" not in graphs[1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, ref, atol=1e-5, rtol=0)


@pytest.mark.slow  # (the heaviest of the default suite: CI runs it with the slow ones)
def test_a_whole_training_forward_compiles_with_no_host_read_but_the_adaptive_softmaxs_one():
    """torch.compile of the whole forward with its loss and memory (toward a training step as one graph): a model
    without tail clusters traces as one graph (no host read: the ids' and targets' checks are the caller's inside a
    graph; the CPU's dropout draws as F.dropout does there), with the eager path's values; with tail clusters the
    only breaks are at the adaptive softmax's one host read per loss (the clusters' sizes)."""
    from txl import TransformerXLConfig

    def model(cutoffs, dropout):
        torch.manual_seed(0)
        cfg = TransformerXLConfig(n_token=100, d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64, n_layer=2,
                                  mem_len=8, cutoffs=cutoffs, div_val=2 if cutoffs else 1,
                                  tie_projs=[False] * (len(cutoffs) + 1), dropout=dropout)  # fmt: skip
        return TransformerXLLM(cfg).train()

    x = torch.randint(0, 100, (2, 17))
    for cutoffs, dropout in (([], 0.0), ([], 0.1), ([20, 50], 0.0)):
        m = model(cutoffs, dropout)
        mems = m(x[:, :8], x[:, 1:9]).mems

        def step(inp, tgt, mems, m=m):
            out = m(inp, tgt, mems=mems)
            return out.loss, out.mems

        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(x[:, 8:16], x[:, 9:17], mems)
        frames = [b.user_stack[-1] for b in explained.break_reasons]
        where = {(f.filename.rsplit("/", 1)[-1], f.lineno) for f in frames}
        if cutoffs:
            assert {f for f, _ in where} == {"adaptive.py"} and len({line for _, line in where}) == 1, where
            continue
        assert explained.graph_break_count == 0, where
        if dropout == 0.0:
            torch._dynamo.reset()
            loss, new_mems = torch.compile(step, fullgraph=True, backend="aot_eager")(x[:, 8:16], x[:, 9:17], mems)
            ref_loss, ref_mems = step(x[:, 8:16], x[:, 9:17], mems)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for a, b in zip(new_mems, ref_mems, strict=True):
                torch.testing.assert_close(a, b)
