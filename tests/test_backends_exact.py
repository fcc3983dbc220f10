"""Every fast path is a backend of an operation whose specification is the model's reference code: one
parametrized test turns each field of txl.kernels.backends.Backends off in turn and holds what the model computes with
every backend on to what it computes with that one off - training (loss and every gradient, over two segments
with the memory) and inference (a K/V-cached prompt with left padding, then one-token steps past the memory's
end, so that its window wraps; a cached evaluation in segments under bf16 autocast, past the memory's end) - in fp32
and under bf16 autocast, on odd shapes (3 heads of 12, segments of 7, an adaptive softmax with div_val 2). Dropout
backends are held to dropout's own definition instead (their random streams differ by design): every output is 0 or
x / (1 - p), at a rate near p, and the backward uses the same mask. The GPU paths (a list of devices in the policy)
run on the CPU here: training's layers compiled by Inductor, the adaptive softmax's products in bf16, the attention as
one SDPA call, the graphs of cached segments (their stand-in: the step traced by make_fx, replayed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import debug_config
from txl import Backends, TransformerXLLM, use_backends
from txl.kernels import native
from txl.kernels.runtime import native_bf16
from txl.model.modeling import Dropout, KVCache, transposed_weights

FIELDS = [f.name for f in dataclasses.fields(Backends)]
DROPOUTS = ("native_dropout", "native_relu_dropout")
CONFIG = dict(
    n_token=60,
    d_model=24,
    d_embed=24,
    n_head=3,
    d_head=12,
    d_inner=40,
    n_layer=2,
    mem_len=5,
    cutoffs=[20, 40],
    div_val=2,
    tie_projs=[False, True, True],
    clamp_len=9,
    same_length=True,
    init_std=0.1,
    proj_init_std=0.1,
)  # fmt: skip  (scores of a trained model's size: bf16 rounds them)


def off(field: str) -> dict:
    """The policy with ``field``'s backend off; for a list of devices (SDPA in training, the compiled layers, the
    half-precision logits: GPU paths) the non-default choice, the CPU added, so that the CPU runs the path a GPU
    takes and the test holds it to the CPU's default path."""
    default = getattr(Backends(), field)
    return {field: ("cpu",) if isinstance(default, tuple) else False}


def skip_without_the_library(field: str) -> None:
    """A native backend cannot run without the library (no C compiler): both sides would run the reference, and the
    test would check nothing."""
    if field.startswith("native") and native.library() is None:
        pytest.skip(f"{field}: {native.status()}")
    if field.startswith("fused_attention"):
        pytest.importorskip("triton", reason=f"{field}: triton is not installed (extra 'triton')")


def count_fused_calls(monkeypatch) -> list:
    """A list that grows by one for each call of the fused Triton kernel (so that the test knows it ran)."""
    from txl.kernels import fused_attention

    calls, kernel = [], fused_attention.fused_rel_attention

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return kernel(*args, **kw)

    monkeypatch.setattr(fused_attention, "fused_rel_attention", counted)
    return calls


def train(model, x, y, precision: str):
    model.zero_grad(set_to_none=True)
    model.train()
    mems, total = None, 0.0
    for seg in (slice(0, 7), slice(7, 14)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x[:, seg], y[:, seg], mems=mems)
        out.loss.float().backward()
        mems, total = out.mems, total + float(out.loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def infer(model, prompt, padding, steps, stream):
    model.eval()
    with torch.no_grad(), transposed_weights():  # (as txl.infer.evaluate, generation and the server read)
        cache = KVCache(model.config, prompt.shape[0], model.config.mem_len, prompt.shape[1])
        out = [model(prompt, cache=cache, padding=padding, return_log_probs=True).log_probs[:, -1]]
        for t in range(steps.shape[1]):
            out.append(model(steps[:, t : t + 1], cache=cache, return_log_probs=True).log_probs[:, -1])
        scored = model(prompt, prompt, padding=padding).losses  # (the NLL of a padded batch, no cache)
        # A cached evaluation under bf16 autocast in segments of 3 past the memory's end (the window cycles through
        # its buffer; the graphs of segments apply to half-precision steps).
        cache = KVCache(model.config, stream.shape[0], model.config.mem_len, 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [
                model(stream[:, i : i + 3], stream[:, i + 1 : i + 4], cache=cache).losses for i in range(0, 39, 3)
            ]
    graphs = cache.segment_graphs.graphs if cache.segment_graphs else {}
    return torch.stack(out), scored, torch.cat(losses, dim=1), len(graphs)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "field",
    [  # (the compiled layers' case compiles every layer shape with Inductor: ~70 s on 2 AVX2 cores, CI runs it)
        pytest.param(f, marks=pytest.mark.slow) if f == "compiled_layers" else f for f in FIELDS if f not in DROPOUTS
    ],
)
def test_each_backend_computes_what_the_reference_computes(field, precision, monkeypatch):
    if precision == "bf16" and not native_bf16(torch.device("cpu")):
        pytest.skip("bf16 autocast is emulated on this CPU (txl trains in fp32 there)")
    skip_without_the_library(field)
    fused_calls = count_fused_calls(monkeypatch) if field.startswith("fused_attention") else []
    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(**CONFIG))
    x = torch.randint(0, 60, (3, 15))
    prompt, steps = torch.randint(0, 60, (3, 6)), torch.randint(0, 60, (3, 9))  # (9 steps: past mem_len 5)
    stream = torch.randint(0, 60, (3, 43))
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, :2] = True
    results = {}
    for name, policy in (("on", {}), ("off", off(field))):
        with use_backends(**policy):
            results[name] = train(model, x[:, :-1], x[:, 1:], precision), infer(model, prompt, padding, steps, stream)
    (loss_on, grads_on), (logp_on, nll_on, evaluated_on, graphs_on) = results["on"]
    (loss_off, grads_off), (logp_off, nll_off, evaluated_off, graphs_off) = results["off"]
    if field == "graph_segments":  # (the graphs' CPU stand-in ran: several offsets recorded, then replayed)
        assert graphs_on == 0 and graphs_off >= 3
    if field == "fused_attention":  # (the kernel ran, under Triton's interpreter: prompt, steps, evaluation)
        assert len(fused_calls) >= 8, fused_calls
    if field == "fused_attention_training":  # (training's two segments, each layer)
        assert len(fused_calls) >= 4, fused_calls
    tol = dict(rtol=2e-2, atol=2e-2) if precision == "bf16" else dict(rtol=1e-4, atol=1e-5)
    assert loss_on == pytest.approx(loss_off, rel=tol["rtol"])
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name in grads_on:
        if precision == "bf16":  # (bf16 rounds each backend's sums differently: the gradient as a whole)
            err = (grads_on[name] - grads_off[name]).norm() / grads_off[name].norm().clamp_min(1e-12)
            assert err < 6e-2, (name, float(err))  # (a wrong shift or mask errs by O(1))
        else:
            torch.testing.assert_close(grads_on[name], grads_off[name], **tol, msg=name)
    torch.testing.assert_close(logp_on, logp_off, rtol=1e-4, atol=1e-4)  # (inference runs in fp32)
    torch.testing.assert_close(nll_on, nll_off, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(evaluated_on, evaluated_off, rtol=2e-2, atol=2e-2)  # (bf16; a wrong window errs by O(1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("field", DROPOUTS)
def test_each_dropout_backend_is_dropout(field, precision):
    if precision == "bf16" and not native_bf16(torch.device("cpu")):
        pytest.skip("bf16 autocast is emulated on this CPU (txl trains in fp32 there)")
    skip_without_the_library(field)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    p = 0.3
    drop = Dropout(p).train()
    for policy in ({}, off(field)):
        with use_backends(**policy):
            x = (torch.rand(64, 513) + 0.5).to(dtype).requires_grad_()
            relu = field == "native_relu_dropout"
            y = drop.relu(x) if relu else drop(x)
            kept = y != 0
            expected = x.detach() / (1 - p)
            torch.testing.assert_close(y[kept], expected[kept], rtol=1e-2 if relu or dtype != torch.float32 else 1e-6,
                                       atol=0)  # fmt: skip
            assert abs(1 - kept.float().mean().item() - p) < 0.02
            y.backward(torch.ones_like(y))
            torch.testing.assert_close(x.grad, kept.to(dtype) / (1 - p), rtol=1e-2, atol=0)  # (the same mask)
