"""The registry of fast paths (txl.kernels.registry), walked: every backend registered is, on a model that uses it,
(1) chosen, (2) checked against its reference the first time (verified), (3) measured against it on the CPU, (4)
declined for a module that is changed (a hook on the module it stands in for), and (5) equal to its reference: the
model with that one backend refused computes the same training loss, gradients and generation log-probabilities
(dropout and dropatt on: the backends draw the reference's masks). A backend that only a device runs is held by the
device's tests named here; a new backend with neither fails this test."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import debug_config
from tests.test_backends_exact import CONFIG
from txl import TransformerXLLM, use_backends
from txl.kernels import admission, measured, native, registry, timing
from txl.kernels.registry import REGISTRY
from txl.model.modeling import KVCache, transposed_weights

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.status()}")

ON_THE_CPU = {  # backend -> (the module it stands in for, the one hooked: it or, for a tree, a module in it)
    "native_dropout": (lambda m: m.transformer.layers[0].attn.drop,) * 2,
    "native_relu_dropout": (lambda m: m.transformer.layers[0].ff.drop,) * 2,
    "native_attention": (lambda m: m.transformer.layers[0].attn,) * 2,
    "native_attention_train": (lambda m: m.transformer.layers[1].attn.dropatt,) * 2,
    "native_nll": (lambda m: m.crit, lambda m: m.crit.out_layers[1]),
    "segment_projection": (lambda m: m.transformer.layers[0].attn.qkv_net,) * 2,
    "fast_decode": (lambda m: m.transformer.layers, lambda m: m.transformer.layers[1].ff),
    "native_decode": (lambda m: None, lambda m: m.transformer.layers[0].attn),
}
ON_A_DEVICE = {  # backend -> the tests that hold it on its device (Triton's interpreter, make_fx's stand-in, CUDA)
    "fused_attention": "tests/test_fused_attention.py",
    "fused_attention_training": "tests/test_fused_attention.py",
    "graph_segments": "tests/test_graphs.py",
    "graph_decode": "tests/test_static_decode.py",
    "graph_act": "tests/test_rl_acting.py",
}


def run(model: TransformerXLLM) -> tuple:
    """Training over two segments (dropout, dropatt, the memory), then a cached prompt and one-token steps."""
    torch.manual_seed(1)
    x = torch.randint(0, 60, (3, 15))
    model.zero_grad(set_to_none=True)
    model.train()
    mems, losses = None, []
    for seg in (slice(0, 7), slice(7, 14)):
        out = model(x[:, seg], x[:, seg.start + 1 : seg.stop + 1], mems=mems)
        out.loss.backward()
        mems = out.mems
        losses.append(out.loss.detach())
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.eval()
    with torch.no_grad(), transposed_weights():
        cache = KVCache(model.config, 3, model.config.mem_len, 6)
        logp = [model(x[:, :6], cache=cache, return_log_probs=True).log_probs[:, -1]]
        logp += [model(x[:, t : t + 1], cache=cache, return_log_probs=True).log_probs[:, -1] for t in range(6, 14)]
        scored = model(x[:, :-1], x[:, 1:]).losses  # (evaluation's NLL: the native NLL without gradients)
    return torch.stack(losses), grads, torch.stack(logp), scored


@pytest.fixture
def spied(monkeypatch):
    """Which backends were chosen, and for which modules (name -> set of module ids; None: no module)."""
    chosen: dict[str, set] = {}
    real = registry.choose

    def spy(name, module, *a, **kw):
        ok = real(name, module, *a, **kw)
        if ok:
            mods = module if isinstance(module, (list, tuple)) else [module]
            chosen.setdefault(name, set()).update(id(m) if m is not None else None for m in mods)
        return ok

    monkeypatch.setattr(registry, "choose", spy)
    monkeypatch.setattr(timing, "timer", iter(range(10**9)).__next__)  # (every call "takes" one tick)
    admission.forget_verified()
    measured.forget()
    monkeypatch.setattr(measured, "_save", lambda: None)  # (no file written: the machine's choices stay)
    return chosen


def model() -> TransformerXLLM:
    torch.manual_seed(0)
    return TransformerXLLM(debug_config(**CONFIG, dropout=0.1, dropatt=0.1))


def test_every_backend_is_accounted_for():
    assert set(REGISTRY) == set(ON_THE_CPU) | set(ON_A_DEVICE), set(REGISTRY) ^ (set(ON_THE_CPU) | set(ON_A_DEVICE))
    for name, path in ON_A_DEVICE.items():
        assert name in open(path, encoding="utf-8").read(), (name, path)
        assert not REGISTRY[name].measured  # (their speed: docs/benchmarks.md, on the device)
    for name in ON_THE_CPU:
        assert REGISTRY[name].measured, name


def test_every_cpu_backend_runs_verified_and_measured(spied):
    with use_backends(measured=True):
        run(model())
    assert set(spied) == set(ON_THE_CPU), set(spied) ^ set(ON_THE_CPU)
    verified = {path for path, _ in admission._verified}
    assert verified >= set(ON_THE_CPU), set(ON_THE_CPU) - verified
    kinds = measured.choices()
    for name in ON_THE_CPU:
        assert any(k.startswith(name + " ") for k in kinds), (name, sorted(kinds))


@pytest.mark.parametrize("name", sorted(ON_THE_CPU))
def test_each_backend_declines_a_changed_module_and_equals_its_reference(name, spied, monkeypatch):
    reference = model()
    with use_backends(measured=False):
        torch.manual_seed(2)
        real = registry.choose
        monkeypatch.setattr(registry, "choose", lambda n, *a, **kw: n != name and real(n, *a, **kw))
        want = run(reference)
        monkeypatch.setattr(registry, "choose", real)
        spied.clear()
        got = run(model())
        assert name in spied
        changed = model()
        passed, hooked = (f(changed) for f in ON_THE_CPU[name])
        hooked.register_forward_hook(lambda *a: None)
        spied.clear()
        got_hooked = run(changed)
    if passed is not None:
        assert id(passed) not in spied.get(name, set())
    else:  # (its plan covers every layer: a hook anywhere in them declines the one-token loop it stands in for)
        assert name not in spied
    for a, b, c in zip(want, got, got_hooked, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)


def test_not_supported_reasons_name_what_stops_a_backend():
    m = model()
    attn = m.transformer.layers[0].attn
    q = torch.randn(2, 5, 3, 12)
    assert registry.not_supported_reasons("native_attention", attn, q) == []
    with use_backends(native_attention=False):
        assert "turns it off" in registry.not_supported_reasons("native_attention", attn, q)[0]
    assert "not fp32" in registry.not_supported_reasons("native_attention", attn, q.double())[0]
    attn.register_forward_hook(lambda *a: None)
    assert registry.not_supported_reasons("native_attention", attn, q) == ["model has a hook"]
    deep = registry.not_supported_reasons("fast_decode", m.transformer.layers, q, where="layers")
    assert deep == ["layers.0.attn has a hook"], deep
