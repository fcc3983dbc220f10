"""Acting as one graph (txl.rl.acting.RingMemory): the ring's step, run eagerly on the CPU (the stand-in for its CUDA
graph), computes what the K/V cache's step computes (AgentMemory) with resets anywhere, across the ring's wrap and
after updates; its state() starts a training window as AgentMemory's does; a model whose layers are not stock takes
the reference (said once); on CUDA the replayed graph equals the eager step (where a GPU runs the suite)."""

from __future__ import annotations

import logging

import pytest
import torch

from txl.kernels.backends import use_backends
from txl.rl import AgentMemory, MemoryTransformer, RingMemory, gtrxl_config

GATES = ["gru", "residual", "input", "output", "highway", "sigmoid_tanh"]


def run_both(model: MemoryTransformer, x: torch.Tensor, resets: torch.Tensor, update_at: int | None = None):
    """Step a ring and a K/V cache memory through ``x`` [N, S, d]; return both features [N, S, D], both memories."""
    N, S = x.shape[:2]
    ring, cache = model.initial_memory(N, graph=True), model.initial_memory(N, graph=False)
    assert isinstance(ring, RingMemory) and isinstance(cache, AgentMemory)
    a, b = [], []
    for t in range(S):
        if t == update_at:  # an optimizer's step: the weights change in place
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        a.append(model.step(x[:, t], resets[:, t], ring))
        b.append(model.step(x[:, t], resets[:, t], cache))
    return torch.stack(a, 1), torch.stack(b, 1), ring, cache


@pytest.mark.parametrize("gate", GATES)
def test_ring_step_equals_the_cache_step_with_resets_and_updates(gate):
    """Every gate: the ring's features equal the cache's within 1e-5 over 3.5 turns of the ring, resets at random
    places (one environment never resets, one resets at every step for a while), an update half-way."""
    torch.manual_seed(3)
    cfg = gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=6, gate=gate, gate_bias=0.5, init_std=0.2)
    model = MemoryTransformer(cfg, 5).eval()
    N, S = 6, 25
    x = torch.randn(N, S, 5)
    resets = torch.rand(N, S) < 0.15
    resets[:, 0] = True
    resets[1, 1:] = False
    resets[2, 3:9] = True
    ring_f, cache_f, ring, cache = run_both(model, x, resets, update_at=14)
    torch.testing.assert_close(ring_f, cache_f, rtol=1e-5, atol=1e-5)
    assert cache_f.std() > 0.1
    a, b = ring.state(), cache.state()
    assert torch.equal(a.invalid, b.invalid)
    torch.testing.assert_close(a.hidden, b.hidden * ~b.invalid[:, None, :, None], rtol=1e-5, atol=1e-5)


def test_ring_state_starts_a_window_that_replays_the_steps():
    """The ring's state() at a window's start, then ``window`` over the next steps: the features acting gave."""
    torch.manual_seed(4)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4), 3).eval()
    N, pre, T = 4, 9, 7
    x, resets = torch.randn(N, pre + T, 3), torch.rand(N, pre + T) < 0.2
    resets[:, 0] = True
    ring = model.initial_memory(N, graph=True)
    feats = []
    for t in range(pre + T):
        if t == pre:
            start = ring.state()
        feats.append(model.step(x[:, t], resets[:, t], ring))
    replay, _ = model.window(x[:, pre:], resets[:, pre:], start)
    torch.testing.assert_close(replay, torch.stack(feats[pre:], 1), rtol=1e-5, atol=1e-5)


def test_a_nan_of_an_earlier_episode_does_not_reach_the_next():
    """A non-finite observation, then a reset: the ring forgets it (zeroed, masked); the features stay finite and
    equal the cache's."""
    torch.manual_seed(5)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=5), 3).eval()
    N, S = 3, 12
    x, resets = torch.randn(N, S, 3), torch.zeros(N, S, dtype=torch.bool)
    resets[:, 0] = True
    x[1, 4] = float("nan")
    resets[1, 6] = True
    ring_f, cache_f, _, _ = run_both(model, x, resets)
    assert torch.isfinite(ring_f[1, 6:]).all()
    torch.testing.assert_close(ring_f[:, 6:], cache_f[:, 6:], rtol=1e-5, atol=1e-5)


def test_a_hook_on_the_layers_takes_the_reference_and_says_so(caplog):
    """A forward hook on a gate: the ring's step is the modules' own (the hook runs at every step), the features the
    hook changes are what the cache memory's reference path computes too; the log says the graph path was declined."""
    torch.manual_seed(6)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4), 3).eval()
    calls = []

    def hook(module, inputs, output):
        calls.append(1)
        return output * 1.5

    model.core.layers[1].attn.gate.register_forward_hook(hook)
    x, resets = torch.randn(3, 8, 3), torch.zeros(3, 8, dtype=torch.bool)
    resets[:, 0] = True
    with caplog.at_level(logging.WARNING, logger="txl"):
        ring_f, cache_f, _, _ = run_both(model, x, resets)
    torch.testing.assert_close(ring_f, cache_f, rtol=1e-5, atol=1e-5)
    assert calls
    assert "graph_act" in caplog.text


def test_a_swapped_position_projection_is_called_as_a_module():
    """A user's module in place of W_kR (no ``weight`` of its own, and a bias): the ring asks it for W_kR R like the
    model does (the step takes the reference, as for any changed layer) and follows the cache memory."""
    torch.manual_seed(8)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4), 3).eval()

    class Projection(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner, self.shift = inner, torch.nn.Parameter(0.1 * torch.randn(inner.out_features))

        def forward(self, r: torch.Tensor) -> torch.Tensor:
            return self.inner(r) + self.shift

    for layer in model.core.layers:
        layer.attn.r_net = Projection(layer.attn.r_net)
    x, resets = torch.randn(3, 8, 3), torch.rand(3, 8) < 0.2
    resets[:, 0] = True
    ring_f, cache_f, _, _ = run_both(model, x, resets, update_at=4)
    torch.testing.assert_close(ring_f, cache_f, rtol=1e-5, atol=1e-5)


def test_the_default_memory_follows_the_policy():
    """On the CPU the default is the K/V cache (its native step is faster there); with graph_act on for the CPU it is
    the ring; clone() is independent; a ring of a model of another configuration is refused in one line."""
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=1, n_head=2, mem_len=3), 2).eval()
    assert isinstance(model.initial_memory(2), AgentMemory)
    with use_backends(graph_act=("cpu",)):
        ring = model.initial_memory(2)
    assert isinstance(ring, RingMemory)
    x, r = torch.randn(2, 2), torch.ones(2, dtype=torch.bool)
    model.step(x, r, ring)
    copy = ring.clone()
    model.step(x, ~r, copy)
    assert int(ring.pos) == 1 and int(copy.pos) == 2
    other = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=3), 2).eval()
    with pytest.raises(ValueError, match="made by a model of another configuration"):
        other.step(x, r, ring)
    with pytest.raises(ValueError, match=r"step: x must be \[2, 2\]"):
        model.step(torch.randn(3, 2), r, ring)
    model.double()
    with pytest.raises(ValueError, match="holds torch.float32 on cpu and the model's weights are torch.float64"):
        model.step(x, r, ring)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the replayed graph")
def test_the_replayed_graph_equals_the_eager_step_on_cuda():
    """On CUDA: the graph's replays equal the cache memory's steps (and survive an update in place)."""
    torch.manual_seed(7)
    model = MemoryTransformer(gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=8), 4).cuda().eval()
    x, resets = torch.randn(16, 30, 4, device="cuda"), torch.rand(16, 30, device="cuda") < 0.1
    ring_f, cache_f, ring, cache = run_both(model, x, resets, update_at=17)
    assert ring._replay is not None
    torch.testing.assert_close(ring_f, cache_f, rtol=1e-4, atol=1e-4)
    # a hook put on the input layer after the capture runs at every step (the step is no longer the replay)
    calls = []
    model.embed.register_forward_hook(lambda m, i, o: calls.append(1) or o * 2)
    no = torch.zeros(16, dtype=torch.bool, device="cuda")
    a, b = model.step(x[:, 0], no, ring), model.step(x[:, 0], no, cache)
    assert len(calls) == 2
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_ring_in_bf16_follows_the_cache_in_bf16():
    """A bf16 model (as on a GPU): the ring's features (softmax in fp32) equal the cache's within bf16's rounding."""
    torch.manual_seed(8)
    model = MemoryTransformer(gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=5), 3).eval().to(torch.bfloat16)
    x, resets = torch.randn(4, 14, 3), torch.rand(4, 14) < 0.2
    resets[:, 0] = True
    ring_f, cache_f, ring, _ = run_both(model, x, resets)
    assert ring_f.dtype == torch.bfloat16 and ring.state().hidden.dtype == torch.bfloat16
    torch.testing.assert_close(ring_f.float(), cache_f.float(), rtol=0.05, atol=0.05)


def test_a_ring_that_does_not_fit_is_one_line_before_anything_is_allocated():
    model = MemoryTransformer(gtrxl_config(d_model=64, n_layer=2, n_head=4, mem_len=4096), 4)
    with pytest.raises(ValueError, match=r"the memory of 100000 environments x mem_len 4096 needs [\d.]+ GiB"):
        model.initial_memory(100_000, graph=True)
    assert RingMemory.bytes_per_env(model.config, 64) == 65 * (2 * (2 * 64 + 64) * 4 + 1)


def test_a_hook_on_the_input_layer_keeps_the_step_off_the_graph():
    """The step calls the input layer itself: with a hook on it the graph is not replayed (here: a ring told to use
    graphs on the CPU takes the eager step, and no capture is tried); the hook runs at every step."""
    torch.manual_seed(9)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=1, n_head=2, mem_len=3), 2).eval()
    ring = model.initial_memory(2, graph=True)
    ring.graph = True  # (as on CUDA: a capture here would fail on the CPU)
    calls = []
    model.embed.register_forward_hook(lambda m, i, o: calls.append(1))
    for _ in range(3):
        model.step(torch.randn(2, 2), torch.zeros(2, dtype=torch.bool), ring)
    assert len(calls) == 3 and ring._replay is None


def _data_copy(model, target):
    for p, q in zip(model.parameters(), target.parameters(), strict=True):
        p.data.copy_(q.data)  # (the target-network idiom: no version counter moves)


def _data_sgd(model, target):
    for p in model.parameters():
        p.data.add_(-0.05 * torch.randn_like(p))  # (manual SGD through .data)


def _data_assign(model, target):
    for p, q in zip(model.parameters(), target.parameters(), strict=True):
        p.data = q.detach().clone()  # (a new storage behind the same Parameter)


def _one_element(model, target):
    model.core.layers[0].attn.qkv_net.weight.data[3, 5] += 0.5  # (one weight, through .data)


@pytest.mark.parametrize("write", [_data_copy, _data_sgd, _data_assign, _one_element])
@pytest.mark.parametrize("kind", ["cache", "ring"])
@pytest.mark.parametrize("gate", ["gru", "residual"])
def test_weights_written_through_data_are_seen_by_the_next_step(write, kind, gate):
    """Round 6, rn1: writes through ``.data`` bump no version counter; the acting memory still recomputes its keys,
    so the next step equals ``window()`` over ``memory.state()`` (the model's own forward)."""
    torch.manual_seed(0)
    model = MemoryTransformer(gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=8, gate=gate), 5).eval()
    target = MemoryTransformer(model.config, 5).eval()
    with use_backends(graph_act=("cpu",) if kind == "ring" else ()):
        memory = model.initial_memory(3)
    assert isinstance(memory, RingMemory if kind == "ring" else AgentMemory)
    x, reset = torch.randn(3, 7, 5), torch.zeros(3, 7, dtype=torch.bool)
    reset[:, 0] = True
    for t in range(6):
        model.step(x[:, t], reset[:, t], memory)
    state = memory.state()
    write(model, target)
    acted = model.step(x[:, 6], reset[:, 6], memory)
    with torch.no_grad():
        replayed, _ = model.window(x[:, 6:], reset[:, 6:], state)
    torch.testing.assert_close(acted, replayed[:, 0], rtol=1e-5, atol=1e-5)


def test_a_target_network_steps_the_memory_of_the_model_it_copies():
    """A deepcopy of the model (a target network) steps the ring made by the original, as it steps its cache: it
    computes the keys again with its own weights (round 6, rn7-ring)."""
    import copy

    torch.manual_seed(0)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=1, n_head=2, mem_len=4), 3).eval()
    with use_backends(graph_act=("cpu",)):
        ring = model.initial_memory(2)
    x, r = torch.randn(2, 3), torch.ones(2, dtype=torch.bool)
    model.step(x, r, ring)
    target = copy.deepcopy(model)
    for p in target.parameters():
        p.data.mul_(0.9)
    state = ring.state()
    acted = target.step(x, ~r, ring)
    with torch.no_grad():
        replayed, _ = target.window(x[:, None], (~r)[:, None], state)
    torch.testing.assert_close(acted, replayed[:, 0], rtol=1e-5, atol=1e-5)
