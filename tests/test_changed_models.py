"""Models changed the way researchers change them (a subclass, a forward set on an instance, a swapped module, a
class patched, a code object edited, a hook) compute what their own forward computes in every path: generation,
streaming, beam search, the server's engine, an agent's acting step, cached evaluation, a training step. Each fast
path either computes the same or is declined with one log line naming the module (``txl.kernels.admission``). An
unchanged model takes every fast path."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.kernels import admission, native
from txl.kernels.backends import Backends, use_backends
from txl.model.attention import RelPartialLearnableMultiHeadAttn
from txl.model.transformer import PositionwiseFF

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels need a C compiler")

ALL_OFF = {
    f: (False if isinstance(getattr(Backends(), f), bool) else ()) for f in Backends.__dataclass_fields__
}  # (every fast path off: the model's own code everywhere)


def gelu_ff_forward(self: PositionwiseFF, h: torch.Tensor) -> torch.Tensor:
    x = self.layer_norm(h) if self.pre_lnorm else h
    y = self.layer_2(F.gelu(self.layer_1(x)))
    return self.layer_norm(h + y) if not self.pre_lnorm else h + y


class GeluFF(PositionwiseFF):
    forward = gelu_ff_forward


class ScaledAttention(RelPartialLearnableMultiHeadAttn):
    def output(self, h, attn_vec):
        return super().output(h, 0.5 * attn_vec)


class ScoresOverride(RelPartialLearnableMultiHeadAttn):
    """Changes only the scores (the native attention kernel computes scores()+attend() itself)."""

    def scores(self, q, pos, K):
        q_w, bd = super().scores(q, pos, K)
        return q_w * 1.5, bd


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) * 1.3)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class HalfGate(nn.Module):
    def forward(self, h, y):
        return h + 0.5 * torch.tanh(y)


def _ff_subclass(m):
    for layer in m.transformer.layers:
        ff = GeluFF.__new__(GeluFF)
        ff.__dict__.update(layer.ff.__dict__)
        layer.ff = ff


def _instance_forward(m):
    for layer in m.transformer.layers:
        layer.ff.forward = types.MethodType(gelu_ff_forward, layer.ff)


def _attention_subclass(m):
    for layer in m.transformer.layers:
        layer.attn.__class__ = ScaledAttention


def _scores_override(m):
    for layer in m.transformer.layers:
        layer.attn.__class__ = ScoresOverride


def _swapped_norm(m):
    for layer in m.transformer.layers:
        layer.attn.layer_norm = RMSNorm(m.config.d_model)
        layer.ff.layer_norm = RMSNorm(m.config.d_model)


def _custom_gate(m):
    for layer in m.transformer.layers:
        layer.ff.gate = HalfGate()


def _hook(m):
    m.transformer.layers[1].ff.layer_2.register_forward_hook(lambda mod, inp, out: out * 0.7)


def _class_patch(m, monkeypatch):
    monkeypatch.setattr(PositionwiseFF, "forward", gelu_ff_forward)


def _code_edit(m, monkeypatch):
    """An edit of PositionwiseFF.forward's source: the same function object, another code (what editing txl's file
    before the import gives)."""
    monkeypatch.setattr(PositionwiseFF.forward, "__code__", gelu_ff_forward.__code__)


CHANGES = {
    "ff_subclass": (_ff_subclass, {}),
    "instance_forward": (_instance_forward, {}),
    "attention_subclass": (_attention_subclass, {}),
    "scores_override": (_scores_override, {}),
    "swapped_norm": (_swapped_norm, {}),
    "custom_gate": (_custom_gate, dict(pre_lnorm=True)),
    "hook": (_hook, {}),
    "class_patch": (_class_patch, {}),
    "code_edit": (_code_edit, {}),
}


def _model(change: str | None, monkeypatch, **overrides) -> TransformerXLLM:
    torch.manual_seed(0)
    extra = CHANGES[change][1] if change else {}
    base = dict(n_token=40, mem_len=64, d_model=32, d_inner=64, n_head=4) | extra | overrides
    m = TransformerXLLM(debug_config(**base))
    if change:
        fn = CHANGES[change][0]
        fn(m, monkeypatch) if fn.__code__.co_argcount == 2 else fn(m)
    return m.eval()


@pytest.fixture(autouse=True)
def _fresh_checks():
    admission.forget_verified()
    yield
    admission.forget_verified()


def _declined(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "declined" in r.getMessage()]


def _reference_log_probs(m, ids):
    """What the changed model's own forward computes over the whole text (no cache, every fast path off)."""
    with torch.no_grad(), use_backends(**ALL_OFF):
        return m(ids, return_log_probs=True).log_probs  # [B, T, V]


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_path_computes_what_the_changed_model_computes(change, monkeypatch, caplog):
    from txl.infer.generation import beam_search, generate, stream
    from txl.model.cache import KVCache

    caplog.set_level(logging.WARNING, logger="txl")
    m = _model(change, monkeypatch)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))

    # generation (greedy): each new token is the argmax of the changed model's own log-probabilities
    out = generate(m, prompt, 12, temperature=0.0, mem_len=64)
    ref = _reference_log_probs(m, out)
    assert torch.equal(out[:, 5:], ref[:, 4:-1].argmax(-1)), change
    streamed = torch.cat(list(stream(m, prompt, 12, temperature=0.0, mem_len=64)), dim=1)
    assert torch.equal(streamed, out[:, 5:])

    # the cached one-token step (what generate, stream, beam search, the engine and an agent run): log-probs
    with torch.no_grad():
        cache = KVCache(m.config, 2, 64, 5)
        got = [m(out[:, :5], cache=cache, mem_len=64, return_log_probs=True).log_probs]
        for t in range(5, out.shape[1]):
            got.append(m(out[:, t : t + 1], cache=cache, mem_len=64, return_log_probs=True).log_probs)
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=0)

    # beam search: as with every fast path off (the model's own code)
    with use_backends(**ALL_OFF):
        beams_ref = beam_search(m, prompt[:1], 6, num_beams=3, mem_len=64)
    assert torch.equal(beam_search(m, prompt[:1], 6, num_beams=3, mem_len=64), beams_ref)

    # cached evaluation: segments of 4 on a KV cache, as txl eval reads
    with torch.no_grad():
        cache, parts = KVCache(m.config, 2, 64, 4), []
        for s in range(0, out.shape[1], 4):
            parts.append(m(out[:, s : s + 4], cache=cache, mem_len=64, return_log_probs=True).log_probs)
    torch.testing.assert_close(torch.cat(parts, 1), ref, atol=1e-5, rtol=0)

    # a training step: the loss and every gradient as with the model's own code
    _training_matches(m, out)

    if change not in ("code_edit",):  # (a class or instance change is refused before anything runs, named)
        assert _declined(caplog), f"{change}: no fast path said it declined"
    for line in _declined(caplog):
        assert line.count("\n") == 0 and "txl: fast path" in line


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_serve_engine_generates_what_the_changed_model_generates(change, monkeypatch):
    """txl serve's engine (batched one-token steps): as the changed model's own code generates alone."""
    pytest.importorskip("fastapi", reason="the server needs the extra 'serve'")
    pytest.importorskip("uvicorn", reason="the server needs the extra 'serve'")
    from serve_helpers import engine_tokens
    from txl.infer.generation import generate

    m = _model(change, monkeypatch)
    prompt = torch.randint(0, 40, (5,), generator=torch.Generator().manual_seed(1)).tolist()
    got = engine_tokens(m, prompt, 8, 64)
    with use_backends(**ALL_OFF):
        alone = generate(m, torch.tensor([prompt]), 8, temperature=0.0, mem_len=64)[0, len(prompt) :].tolist()
    assert got == alone


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_compressive_model_computes_what_the_changed_model_computes(change, monkeypatch):
    """Issue 76: a Compressive Transformer (both memories, compression past the memory) changed in each way reads
    a text by segments, generates and trains as with every fast path off (the changed model's own code)."""
    from txl.infer.generation import generate

    m = _model(change, monkeypatch, mem_len=8, cmem_len=4, cmem_ratio=2, compression="conv")
    ids = torch.randint(0, 40, (2, 29), generator=torch.Generator().manual_seed(1))

    def read(**policy):
        mems, parts = None, []
        with torch.no_grad(), use_backends(**policy):
            for s in range(0, ids.shape[1], 4):
                out = m(ids[:, s : s + 4], mems=mems, return_log_probs=True)
                mems, parts = out.mems, [*parts, out.log_probs]
        return torch.cat(parts, 1), mems

    (got, mems), (ref, ref_mems) = read(), read(**ALL_OFF)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert len(mems) == 4 and mems[2].shape[1] == 4  # (the compressed memory is full)
    torch.testing.assert_close(mems, ref_mems, atol=1e-5, rtol=0)
    prompt = ids[:, :6]
    with use_backends(**ALL_OFF):
        alone = generate(m, prompt, 10, temperature=0.0)
    assert torch.equal(generate(m, prompt, 10, temperature=0.0), alone)
    _training_matches(m, ids[:, :13])


def _training_matches(m, ids):
    def step(**policy):
        m.train()
        m.zero_grad()
        with use_backends(**policy):
            out = m(ids[:, :-1], ids[:, 1:])
            out.loss.backward()
        m.eval()
        return out.loss.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

    loss, grads = step()
    ref_loss, ref_grads = step(**ALL_OFF)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("change", ["ff_subclass", "instance_forward", "swapped_norm", "custom_gate", "code_edit"])
def test_an_agent_acts_as_its_changed_model_replays(change, monkeypatch):
    """txl.rl: the acting step (a cached step of one token per environment) gives the features that window(), the
    model's own forward over the steps, gives."""
    from txl.rl.memory import MemoryTransformer, gtrxl_config

    torch.manual_seed(0)
    agent = MemoryTransformer(gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=16), d_input=5).eval()
    fn = CHANGES[change][0]

    class Holder:  # (the change functions take a language model: .transformer.layers)
        transformer = agent.core
        config = agent.config

    fn(Holder, monkeypatch) if fn.__code__.co_argcount == 2 else fn(Holder)
    x = torch.randn(3, 6, 5)
    resets = torch.zeros(3, 6, dtype=torch.bool)
    resets[:, 0] = True
    memory = agent.initial_memory(3)
    state = memory.state()
    acted = torch.stack([agent.step(x[:, t], resets[:, t], memory) for t in range(6)], 1)
    with torch.no_grad():
        replayed, _ = agent.window(x, resets, state)
    torch.testing.assert_close(acted, replayed, atol=1e-5, rtol=0)


def test_an_unchanged_model_takes_every_fast_path(monkeypatch, caplog):
    """The stock model: no fast path declines, and the native decode step, the native attention (inference and
    training), the native NLL and the one-token loop all run."""
    from txl.infer.generation import generate
    from txl.kernels import attention, decode, nll
    from txl.model.cache import KVCache

    caplog.set_level(logging.WARNING, logger="txl")
    calls: dict[str, int] = {}

    def count(module, name, key):
        real = getattr(module, name)

        def counted(*a, **k):
            calls[key] = calls.get(key, 0) + 1
            return real(*a, **k)

        monkeypatch.setattr(module, name, counted)

    count(decode.native, "decode_step", "decode")
    count(attention.ops, "rel_attention", "attention")
    count(attention.ops, "rel_attention_train", "attention_train")
    m = _model(None, monkeypatch, dropout=0.1)
    count(nll.ops, "nll", "nll")
    prompt = torch.randint(0, 40, (2, 5))
    generate(m, prompt, 6, temperature=0.0, mem_len=64)
    with torch.no_grad():
        m(prompt, cache=KVCache(m.config, 2, 64, 5))
    m.train()
    m(prompt[:, :-1], prompt[:, 1:]).loss.backward()
    assert not _declined(caplog), _declined(caplog)
    assert {"decode", "attention", "attention_train", "nll"} <= set(calls), calls
