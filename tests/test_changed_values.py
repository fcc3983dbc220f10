"""What a fast path reads, it checks (round 6, ad14): every value a fast path copies out of a module (an attention's
``scale``, ``pre_lnorm``, ``identity_map``, a norm's ``eps``) is read per call or is part of its key. Each is changed
on one layer after a first generation (which checked the native decoding step for that kind of model) and the
cached paths still compute what the changed model's own forward computes."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.kernels import admission, decode, native
from txl.kernels.backends import Backends, use_backends
from txl.model.cache import KVCache

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native kernels need a C compiler")

ALL_OFF = {f: (False if isinstance(getattr(Backends(), f), bool) else ()) for f in Backends.__dataclass_fields__}

# (which module of layer 1, its attribute, the new value, the config it applies to, whether the native step still
# applies: it declines a layer whose attention and feed-forward disagree)
CHANGES = {
    "attn.scale": ("attn", "scale", 0.01, {}, True),
    "attn.scale=1": ("attn", "scale", 1.0, {}, True),
    "attn.pre_lnorm": ("attn", "pre_lnorm", True, {}, False),
    "ff.pre_lnorm": ("ff", "pre_lnorm", True, {}, False),
    "both.pre_lnorm": (("attn", "ff"), "pre_lnorm", False, dict(pre_lnorm=True), True),
    "attn.layer_norm.eps": ("attn.layer_norm", "eps", 0.5, {}, True),
    "ff.layer_norm.eps": ("ff.layer_norm", "eps", 0.5, {}, True),
    "attn.identity_map": ("attn", "identity_map", True, dict(pre_lnorm=True), False),
}


@pytest.fixture(autouse=True)
def _fresh_checks():
    admission.forget_verified()
    yield
    admission.forget_verified()


def _change(m: TransformerXLLM, where, attr: str, value) -> None:
    layer = m.transformer.layers[1]
    for path in (where,) if isinstance(where, str) else where:
        target = layer
        for part in path.split("."):
            target = getattr(target, part)
        setattr(target, attr, value)


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_value_changed_on_one_layer_after_a_generation_is_seen_by_every_cached_path(name, monkeypatch):
    from txl.infer.generation import generate, stream

    where, attr, value, overrides, native_after = CHANGES[name]
    torch.manual_seed(0)
    m = TransformerXLLM(debug_config(n_token=40, mem_len=64, d_model=32, d_inner=64, n_head=4, **overrides)).eval()
    calls = []
    real = native.decode_step

    def counted(*args, **kwargs):  # (the native steps that ran: a decline returns None)
        out = real(*args, **kwargs)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(decode.native, "decode_step", counted)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(1))
    generate(m, prompt, 4, temperature=0.0, mem_len=64)  # (the native step checked for this kind of model)
    assert calls, "the native decoding step did not run on the stock model"

    _change(m, where, attr, value)
    calls.clear()
    out = generate(m, prompt, 10, temperature=0.0, mem_len=64)
    # (where it applies, the native step ran on the changed model: the values it read are tested, not a decline)
    assert bool(calls) == native_after, (name, len(calls))
    with torch.no_grad(), use_backends(**ALL_OFF):
        ref = m(out, return_log_probs=True).log_probs  # [B, T, V]: the changed model's own forward
    assert torch.equal(out[:, 5:], ref[:, 4:-1].argmax(-1)), name
    got = []
    streamed = stream(m, prompt, 10, temperature=0.0, mem_len=64, observe=lambda lp, tok: got.append(lp))
    assert torch.equal(torch.cat(list(streamed), 1), out[:, 5:])
    torch.testing.assert_close(torch.stack(got, 1), ref[:, 4:-1], atol=1e-4, rtol=0)  # [B, 10, V]
    # cached evaluation (segments of 4 on a K/V cache: the native attention reads each layer's scale per call)
    with torch.no_grad():
        cache, parts = KVCache(m.config, 2, 64, 4), []
        for s in range(0, out.shape[1], 4):
            parts.append(m(out[:, s : s + 4], cache=cache, mem_len=64, return_log_probs=True).log_probs)
    torch.testing.assert_close(torch.cat(parts, 1), ref, atol=1e-4, rtol=0)
