"""The model calls its nn.Linear modules (issue 48, item 4): forward hooks fire on every one of them, and a layer
that replaces one (an adapter, a quantised layer) is what computes, in every path: training with a memory, cached
evaluation, the one-token generation step, the adaptive softmax's loss and log-probabilities, the classifier. A plain
nn.Linear keeps the fast backends; tests/test_backends_exact.py holds those to the reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from txl import TransformerXLConfig, TransformerXLForSequenceClassification, TransformerXLLM
from txl.infer.generation import generate
from txl.kernels.linear import plain_linear
from txl.model.modeling import KVCache


class LowRank(nn.Module):
    """What PEFT's LoRA layer is, in short: the base layer's output plus B(A(x)) (not an nn.Linear: the model must
    call it; its ``weight`` is the base layer's, as PEFT's)."""

    def __init__(self, base: nn.Linear, rank: int = 2, seed: int = 0):
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(rank, base.in_features, generator=g) * 0.3)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, generator=g) * 0.3)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


def config(div_val: int = 1, **kw) -> TransformerXLConfig:
    base = dict(n_token=60, d_model=32, d_embed=48, n_head=4, d_head=8, d_inner=64, n_layer=2, mem_len=12,
                cutoffs=[20, 40], div_val=div_val, tie_weight=False, dropout=0.0)  # fmt: skip
    return TransformerXLConfig(**{**base, **kw})


def adapted(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the model with a LowRank around every nn.Linear, the same model with each adapter merged into its weight)."""
    wrapped, merged = copy.deepcopy(model), copy.deepcopy(model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for i, name in enumerate(names):
        parent, _, child = name.rpartition(".")
        low = LowRank(getattr(wrapped.get_submodule(parent), child), seed=i)
        setattr(wrapped.get_submodule(parent), child, low)
        with torch.no_grad():
            merged.get_submodule(name).weight += low.b @ low.a
    return wrapped, merged


@pytest.mark.parametrize("div_val", [1, 2])
def test_an_adapter_computes_in_every_path_as_its_merged_weights(div_val):
    torch.manual_seed(0)
    model = TransformerXLLM(config(div_val))
    wrapped, merged = adapted(model)
    assert not any(plain_linear(m) for m in wrapped.modules() if isinstance(m, LowRank))
    x = torch.randint(0, 60, (2, 25))
    for m in (wrapped, merged):
        m.train()
    # training: two segments, the second with a memory, gradients on
    outs = []
    for m in (wrapped, merged):
        o1 = m(x[:, :8], x[:, 1:9])
        o2 = m(x[:, 8:16], x[:, 9:17], mems=o1.mems)
        o2.loss.backward()
        outs.append((o1.losses, o2.losses))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the adapters get gradients; the base weights the same as the merged model's
    lin = wrapped.transformer.layers[1].attn.qkv_net
    assert lin.a.grad is not None and lin.a.grad.abs().sum() > 0
    torch.testing.assert_close(
        lin.base.weight.grad, merged.transformer.layers[1].attn.qkv_net.weight.grad, atol=1e-5, rtol=1e-5
    )
    # cached evaluation (segments of 8, then one token at a time) and the log-probabilities
    for m in (wrapped, merged):
        m.eval()
    with torch.no_grad():
        res = []
        for m in (wrapped, merged):
            cache = KVCache(m.config, 2, 12, 8)
            seg = [m(x[:, i : i + 8], x[:, i + 1 : i + 9], cache=cache).losses for i in (0, 8)]
            steps = [m(x[:, i : i + 1], return_log_probs=True, cache=cache).log_probs for i in range(16, 20)]
            res.append(seg + steps)
        for a, b in zip(*res, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # generation (txl's own, cached: the one-token step)
    gens = [generate(m, x[:, :6], 10, temperature=0.0) for m in (wrapped, merged)]
    assert torch.equal(gens[0], gens[1])
    plain = generate(model.eval(), x[:, :6], 10, temperature=0.0)
    assert not torch.equal(gens[0], plain)  # (the adapters change what is generated: they were used)


def test_an_adapter_computes_in_the_classifier():
    torch.manual_seed(0)
    model = TransformerXLForSequenceClassification(config(num_labels=3)).eval()
    wrapped, merged = adapted(model)
    x = torch.randint(0, 60, (3, 10))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x).logits, merged(x).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(wrapped(x).logits, model(x).logits, atol=1e-3)


def test_hooks_fire_on_every_linear_layer_in_every_path():
    torch.manual_seed(0)
    model = TransformerXLLM(config(2, tie_weight=True))
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    seen: set[str] = set()
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out, n=n: seen.add(n))
    x = torch.randint(0, 60, (2, 20))
    model.train()
    o = model(x[:, :8], x[:, 1:9])
    seen.clear()
    model(x[:, 8:16], x[:, 9:17], mems=o.mems).loss.backward()  # training, with a memory
    assert seen == names
    model.eval()
    with torch.no_grad():
        cache = KVCache(model.config, 2, 12, 8)
        seen.clear()
        model(x[:, :8], x[:, 1:9], cache=cache)  # cached evaluation (the native loss backend otherwise)
        assert seen == names
        seen.clear()
        model(x[:, 8:9], return_log_probs=True, cache=cache)  # the one-token step
        # (W_kR R is the cache's, projected by r_net at the cache's first segment, as the keys of the memory are)
        assert seen == {n for n in names if not n.endswith("r_net")}
    seen.clear()
    generate(model, x[:, :4], 3, temperature=0.0)
    assert seen == names
