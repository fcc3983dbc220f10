"""The native CPU kernels are torch.library operators (txl.kernels.native.ops): each passes torch.library.opcheck
(schema, fake implementation against the real one, autograd registration), torch.compile traces them as one
operator each without a graph break, torch.export records them by name, and the model's native backends call them
(their values are the reference's: tests/test_backends_exact.py)."""

from __future__ import annotations

import math

import pytest
import torch

from txl import TransformerXLConfig, TransformerXLLM, use_backends
from txl.kernels import native
from txl.kernels.native import ops  # noqa: F401  (registers torch.ops.txl.native_*)
from txl.model.positions import causal_mask

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.status()}")


def attention_operands(T=5, M=4, B=2, H=2, Dh=8):
    g = torch.Generator().manual_seed(0)
    K = T + M
    q = torch.randn(B, T, H, Dh, generator=g)
    u, v = torch.randn(H, Dh, generator=g), torch.randn(H, Dh, generator=g)
    kv = torch.randn(B, K, 2, H, Dh, generator=g).permute(2, 0, 3, 1, 4)  # (the projection's layout)
    r = torch.randn(H, Dh, K, generator=g)
    return q, u, v, kv, r, causal_mask(T, M, False, 0), 1 / math.sqrt(Dh)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_each_native_operator_passes_opcheck(p):
    q, u, v, kv, r, mask, scale = attention_operands()
    grad = [t.clone().requires_grad_() for t in (q, u, v)]
    kvg = kv.detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.txl.native_rel_attention_train.default, (*grad, kvg, r, mask, scale, p, 7))
    torch.library.opcheck(torch.ops.txl.native_rel_attention.default, (q, u, v, kv[0], kv[1], r, mask, scale))
    x = torch.randn(7, 33, requires_grad=True)
    torch.library.opcheck(torch.ops.txl.native_dropout.default, (x, max(p, 0.1), 11, bool(p)))
    torch.library.opcheck(torch.ops.txl.native_nll.default, (x, torch.tensor([0, 5, -1, 32, 1, 2, 3])))


def test_compile_traces_the_operators_whole_and_export_names_them():
    x = torch.randn(6, 40)
    target = torch.tensor([1, 4, 39, -1, 0, 7])

    def loss(x, target):
        y = torch.ops.txl.native_dropout(x, 0.1, 3, True)
        return torch.ops.txl.native_nll(y, target)[0].sum()

    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, target), loss(x, target))
    assert not torch._dynamo.utils.counters["graph_break"]

    class Loss(torch.nn.Module):
        def forward(self, x, target):
            return loss(x, target)

    graph = str(torch.export.export(Loss(), (x, target)).graph)
    assert "txl.native_dropout" in graph and "txl.native_nll" in graph


def test_the_models_native_backends_run_the_operators():
    """A CPU training step with the native kernels on calls the registered operators (attention with its backward,
    dropout, relu + dropout, the NLL), seen by a dispatch mode that records every operator."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_token=50, d_model=16, n_head=2, d_head=8, d_inner=32, n_layer=2, mem_len=4,
                              dropout=0.1, dropatt=0.1)  # fmt: skip
    model = TransformerXLLM(cfg).train()
    x = torch.randint(0, 50, (2, 9))
    with use_backends(), Seen() as seen:
        out = model(x[:, :8], x[:, 1:])
        out.loss.backward()
    for name in ("native_rel_attention_train", "native_rel_attention_backward", "native_dropout",
                 "native_relu_dropout_backward", "native_nll", "native_nll_backward"):  # fmt: skip
        assert f"txl.{name}" in seen.names, (name, sorted(n for n in seen.names if "txl" in n))
