"""Memory for agents (txl.rl, GTrXL): the acting step and the training window compute the same features with resets
anywhere, no attention crosses an episode boundary, the gates start as the identity, TrXL-I is the plain reordering,
the memory costs what the docs say, and bad input gets one clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from txl.model.config import TransformerXLConfig
from txl.model.gating import GRUGate
from txl.model.positions import causal_mask
from txl.model.transformer import TransformerXL
from txl.rl import AgentMemory, MemoryState, MemoryTransformer, gtrxl_config

GATES = ["gru", "residual", "input", "output", "highway", "sigmoid_tanh"]


def rollout(model: MemoryTransformer, x: torch.Tensor, resets: torch.Tensor, start: int, mem_len: int | None = None):
    """Step every environment through ``x`` [N, S, d]; return the features [N, S, D], the memory's state at step
    ``start`` and at the end."""
    memory = model.initial_memory(x.shape[0], mem_len)
    feats, state = [], None
    for t in range(x.shape[1]):
        if t == start:
            state = memory.state()
        feats.append(model.step(x[:, t], resets[:, t], memory))
    return torch.stack(feats, 1), state, memory.state()


@pytest.mark.parametrize("gate", GATES)
def test_step_equals_window_with_resets_anywhere(gate):
    """T calls of ``step`` (the cached acting path, its buffer sliding) = one ``window`` from the memory at its start,
    token for token within 1e-5, with resets at random places (several per window, one at the window's first step
    in some environments); two windows in a row chain through the returned memory."""
    torch.manual_seed(1)
    cfg = gtrxl_config(d_model=32, n_layer=3, n_head=4, mem_len=5, gate=gate, gate_bias=0.5, init_std=0.2)
    model = MemoryTransformer(cfg, 7)
    N, pre, T = 5, 13, 11
    x = torch.randn(N, pre + 2 * T, 7)
    resets = torch.rand(N, pre + 2 * T) < 0.2
    resets[:, 0] = True
    resets[1, pre] = True  # an episode starting at the window's first step
    resets[2, pre:] = False  # one environment whose episode spans both windows and the memory
    steps, state, end = rollout(model, x, resets, pre)
    a, mid = model.window(x[:, pre : pre + T], resets[:, pre : pre + T], state)
    b, last = model.window(x[:, pre + T :], resets[:, pre + T :], mid)
    torch.testing.assert_close(torch.cat([a, b], 1), steps[:, pre:], rtol=1e-5, atol=1e-5)
    assert torch.equal(last.invalid, end.invalid)
    valid = ~last.invalid[:, None, :, None]  # (invalid steps hold whatever was there)
    torch.testing.assert_close(last.hidden * valid, end.hidden * valid, rtol=1e-5, atol=1e-5)
    assert steps[:, pre:].std() > 0.1  # (features that vary: the comparison means something)


def test_window_with_gradients_from_a_memory_longer_than_the_episode_so_far():
    """The training window (train mode, gradients on) from a state whose memory is partly unfilled: the same features
    as acting, and gradients reach every weight of the gates and the input layer."""
    torch.manual_seed(2)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=8), 3).train()
    x, resets = torch.randn(2, 6, 3), torch.zeros(2, 6, dtype=torch.bool)
    resets[:, 0] = True
    steps, state, _ = rollout(model, x, resets, 3)
    assert state.invalid[:, :5].all() and not state.invalid[:, 5:].any()
    feats, _ = model.window(x[:, 3:], resets[:, 3:], state)
    torch.testing.assert_close(feats, steps[:, 3:], rtol=1e-5, atol=1e-5)
    feats.square().sum().backward()
    for name, p in model.named_parameters():
        if "word_emb" not in name:  # (vectors in: the token table is not used)
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_nothing_is_attended_across_an_episode_boundary():
    """Perturbing the inputs of an environment's previous episode changes nothing from its reset on, in the acting
    path and in the window (the memory state and the window's earlier steps both); before the reset it does change
    the features (the memory is used). The step after a reset equals a fresh memory's first step: the old memory is
    masked, not zeroed (a zero memory is still attended)."""
    torch.manual_seed(3)
    model = MemoryTransformer(gtrxl_config(d_model=24, n_layer=2, n_head=3, mem_len=10), 4)
    N, S, cut = 3, 20, 12
    x = torch.randn(N, S, 4)
    resets = torch.zeros(N, S, dtype=torch.bool)
    resets[:, 0] = True
    resets[:, cut] = True
    y = x.clone()
    y[:, :cut] += torch.randn(N, cut, 4)  # the previous episode, changed
    fx, sx, _ = rollout(model, x, resets, 8)
    fy, sy, _ = rollout(model, y, resets, 8)
    assert (fx[:, 1:cut] - fy[:, 1:cut]).abs().max() > 1e-3
    torch.testing.assert_close(fx[:, cut:], fy[:, cut:], rtol=0, atol=1e-6)
    wx, _ = model.window(x[:, 8:], resets[:, 8:], sx)
    wy, _ = model.window(y[:, 8:], resets[:, 8:], sy)
    torch.testing.assert_close(wx[:, cut - 8 :], wy[:, cut - 8 :], rtol=0, atol=1e-6)
    fresh = model.step(x[:, cut], torch.ones(N, dtype=torch.bool), model.initial_memory(N))
    torch.testing.assert_close(fx[:, cut], fresh, rtol=1e-5, atol=1e-6)
    # what RLlib does: a zero memory, attended, gives other features
    zero = MemoryState(torch.zeros(N, 2, 10, 24), torch.zeros(N, 10, dtype=torch.bool))
    attended, _ = model.window(x[:, cut : cut + 1], torch.ones(N, 1, dtype=torch.bool), zero)
    torch.testing.assert_close(attended[:, 0], fresh, rtol=1e-5, atol=1e-6)  # (a reset masks even a zero memory)
    zero_attended, _ = model.window(x[:, cut : cut + 1], torch.zeros(N, 1, dtype=torch.bool), zero)
    assert (zero_attended[:, 0] - fresh).abs().max() > 1e-4


def test_window_mask_is_block_diagonal_in_time():
    """The window's mask from resets (with the model's causal mask): a query sees its own episode's keys only, the
    last M steps and itself."""
    resets = torch.tensor([[False, False, True, False, True]])
    invalid = torch.tensor([[True, False, False]])
    seen = ~(MemoryTransformer.window_mask(resets, invalid)[0] | causal_mask(5, 3, False, 0))  # [T, M + T]
    expected = torch.tensor(
        [  # keys: memory m0 m1 m2, then steps 0..4
            [0, 1, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 1, 1, 0, 0, 0],
            [0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(seen, expected)


def test_gru_gate_matches_its_formula_and_passes_the_input_with_a_large_bias():
    """GTrXL's GRU gate against its formula written out; with b_g -> inf it returns x unchanged, so every block of a
    gated model starts as the identity: the model's output is its input (the other gates with a b_g too)."""
    torch.manual_seed(4)
    cfg = gtrxl_config(d_model=8, n_layer=2, n_head=2, gate_bias=0.7)
    gate = GRUGate(cfg)
    x, y = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    Wr, Wz, Wg = gate.w.weight.chunk(3, 0)
    Ur, Uz = gate.u.weight.chunk(2, 0)
    r = torch.sigmoid(y @ Wr.T + x @ Ur.T)
    z = torch.sigmoid(y @ Wz.T + x @ Uz.T - 0.7)
    h = torch.tanh(y @ Wg.T + (r * x) @ gate.u_g.weight.T)
    torch.testing.assert_close(gate(x, y), (1 - z) * x + z * h)
    with torch.no_grad():
        gate.b_g.fill_(1e4)
    assert torch.equal(gate(x, y), x)
    for name in ("gru", "output", "highway", "sigmoid_tanh"):
        model = TransformerXL(gtrxl_config(d_model=8, n_layer=3, n_head=2, gate=name, gate_bias=1e4))
        e = torch.randn(2, 5, 8)
        out = model(inputs_embeds=e, mems=[torch.randn(2, 4, 8)] * 3)
        assert torch.equal(out.last_hidden_state, e), name
        assert all(torch.equal(h, e) for h in model(inputs_embeds=e, output_hidden_states=True).hidden_states)
    small = TransformerXL(gtrxl_config(d_model=8, n_layer=3, n_head=2, gate="gru", gate_bias=2.0))
    assert (small(inputs_embeds=e).last_hidden_state - e).abs().max() > 1e-4  # (b_g = 2: near, not at, identity)


def test_without_gates_the_model_is_trxl_i():
    """gate="residual" with identity_map is TrXL-I: the pre-LN Transformer-XL with a ReLU on each sub-module's output
    before the residual sum (built here from the pre-LN model by ReLU hooks on W_o and the feed-forward's output)."""
    torch.manual_seed(5)
    cfg = gtrxl_config(d_model=16, n_layer=2, n_head=2, gate="residual", mem_len=4)
    trxl_i = TransformerXL(cfg)
    plain_cfg = TransformerXLConfig(**{**cfg.to_dict(), "identity_map": False})
    pre_ln = TransformerXL(plain_cfg)
    pre_ln.load_state_dict(trxl_i.state_dict())
    for layer in pre_ln.layers:
        layer.attn.o_net.register_forward_hook(lambda m, i, o: F.relu(o))
        layer.ff.layer_2.register_forward_hook(lambda m, i, o: F.relu(o))
    e, mems = torch.randn(2, 6, 16), [torch.randn(2, 4, 16)] * 2
    torch.testing.assert_close(trxl_i(inputs_embeds=e, mems=mems).last_hidden_state,
                               pre_ln(inputs_embeds=e, mems=mems).last_hidden_state, rtol=0, atol=1e-6)  # fmt: skip
    unhooked = TransformerXL(plain_cfg)
    unhooked.load_state_dict(trxl_i.state_dict())
    assert (unhooked(inputs_embeds=e, mems=mems).last_hidden_state - trxl_i(inputs_embeds=e, mems=mems)
            .last_hidden_state).abs().max() > 1e-4  # fmt: skip


def test_memory_cost_is_as_documented():
    """``AgentMemory.bytes_per_env`` (the docs' formula, 2 (M + 1) L (2 H Dh + D) b plus a flag per position) is what
    the acting memory holds per environment; a stored window start is L M D b bytes and M flags."""
    for dtype, b in ((torch.float32, 4), (torch.bfloat16, 2)):
        cfg = gtrxl_config(d_model=32, n_layer=3, n_head=4, d_head=6, mem_len=64)
        model = MemoryTransformer(cfg, 5).to(dtype)
        N, M = 7, 64
        mem = model.initial_memory(N, M)
        held = sum(t.numel() * t.element_size() for t in (mem.cache.k, mem.cache.v, mem.hidden, mem.cache.padding))
        assert held == N * AgentMemory.bytes_per_env(cfg, M, b) == N * 2 * (M + 1) * (3 * (2 * 4 * 6 + 32) * b + 1)
        state = mem.state()
        assert state.nbytes() == N * (3 * M * 32 * b + M)
        assert mem.state(torch.bfloat16).nbytes() == N * (3 * M * 32 * 2 + M)


def test_bad_input_gets_one_clear_error():
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=1, n_head=2, mem_len=4), 3)
    mem = model.initial_memory(4)
    with pytest.raises(ValueError, match=r"step: x must be \[4, 3\]"):
        model.step(torch.zeros(4, 5), torch.zeros(4, dtype=torch.bool), mem)
    with pytest.raises(ValueError, match=r"step: reset must be \[4\]"):
        model.step(torch.zeros(4, 3), torch.zeros(3, dtype=torch.bool), mem)
    other = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4), 3)
    with pytest.raises(ValueError, match="this memory was made by a model of another configuration"):
        other.step(torch.zeros(4, 3), torch.zeros(4, dtype=torch.bool), mem)
    state = mem.state()
    with pytest.raises(ValueError, match=r"window: resets must be \[4, 2\]"):
        model.window(torch.zeros(4, 2, 3), torch.zeros(4, 3, dtype=torch.bool), state)
    with pytest.raises(ValueError, match=r"window: x must be \[N, T, d_input=3\]"):
        model.window(torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.bool), state)
    with pytest.raises(ValueError, match=r"window: state.hidden must be \[N=2"):
        model.window(torch.zeros(2, 2, 3), torch.zeros(2, 2, dtype=torch.bool), state)
    with pytest.raises(ValueError, match=r"needs .* GiB and cpu has .* GiB free: use fewer environments"):
        model.initial_memory(10**9, 4096)
    with pytest.raises(ValueError, match="mem_len must be a positive integer"):
        model.initial_memory(4, 0)
    with pytest.raises(ValueError, match="identity_map = True: reorders the pre-LN layer"):
        TransformerXLConfig(identity_map=True)
    with pytest.raises(ValueError, match="gate = 'gru': gates the identity-map reordered layer"):
        TransformerXLConfig(gate="gru", pre_lnorm=True)
    with pytest.raises(ValueError, match="must be one of residual, gru"):
        TransformerXLConfig(gate="lstm", pre_lnorm=True, identity_map=True)


def test_acting_after_an_update_equals_the_replay():
    """The weights change between rollouts (an optimizer step, in place): the next steps equal the window replayed
    from the stored layer inputs with the new weights (the cached keys, values and W_kR R are recomputed), not the
    stale cache's."""
    torch.manual_seed(6)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=6, init_std=0.2), 3)
    N = 2
    x, resets = torch.randn(N, 14, 3), torch.zeros(N, 14, dtype=torch.bool)
    resets[:, 0] = True
    memory = model.initial_memory(N)
    for t in range(8):
        model.step(x[:, t], resets[:, t], memory)
    state = memory.state()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    feats, _ = model.window(x[:, 8:], resets[:, 8:], state)
    feats.square().sum().backward()
    opt.step()
    after = torch.stack([model.step(x[:, t], resets[:, t], memory) for t in range(8, 14)], 1)
    with torch.no_grad():
        replay, _ = model.window(x[:, 8:], resets[:, 8:], state)
    torch.testing.assert_close(after, replay, rtol=1e-5, atol=1e-5)
    assert (replay - feats).abs().max() > 1e-3  # (the update changed the features)


def test_window_gives_the_memory_after_every_step():
    """``every_step=True``: the memory after each step of the window is what the acting memory holds then."""
    torch.manual_seed(7)
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4, init_std=0.2), 3)
    N, pre, T = 3, 5, 7
    x, resets = torch.randn(N, pre + T, 3), torch.rand(N, pre + T) < 0.25
    resets[:, 0] = True
    memory = model.initial_memory(N)
    states = []
    for t in range(pre + T):
        if t == pre:
            start = memory.state()
        model.step(x[:, t], resets[:, t], memory)
        states.append(memory.state())
    with torch.no_grad():
        _, every = model.window(x[:, pre:], resets[:, pre:], start, every_step=True)
    for t in range(T):
        acted = states[pre + t]
        assert torch.equal(every.invalid[:, t], acted.invalid), t
        valid = ~acted.invalid[:, None, :, None]
        torch.testing.assert_close(every.hidden[:, t] * valid, acted.hidden * valid, rtol=1e-5, atol=1e-5)


def test_save_and_load_without_pickle(tmp_path):
    """A GTrXL agent memory saved (config.json + model.safetensors) and loaded computes the same features."""
    model = MemoryTransformer(gtrxl_config(d_model=16, n_layer=2, n_head=2, mem_len=4, gate="highway"), 5)
    model.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    again = MemoryTransformer.from_pretrained(tmp_path / "m")
    assert again.config == model.config and again.d_input == 5
    x, r = torch.randn(2, 6, 5), torch.zeros(2, 6, dtype=torch.bool)
    state = MemoryState(torch.zeros(2, 2, 4, 16), torch.ones(2, 4, dtype=torch.bool))
    assert torch.equal(model.window(x, r, state)[0], again.window(x, r, state)[0])


@pytest.mark.parametrize("gate", ["gru", "residual"])
def test_fast_paths_compute_what_the_reference_does(gate):
    """The backends that run for GTrXL (the native attention in the acting step and in the training window, forward
    and backward; the native dropout-free kernels) give the reference's features and gradients: every backend off is
    the reference."""
    from txl.kernels.backends import use_backends

    torch.manual_seed(8)
    model = MemoryTransformer(gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=6, gate=gate, init_std=0.2), 3)
    x, resets = torch.randn(3, 15, 3), torch.rand(3, 15) < 0.2
    resets[:, 0] = True

    def run():
        steps, state, _ = rollout(model, x, resets, 7)
        model.zero_grad()
        feats, _ = model.window(x[:, 7:], resets[:, 7:], state)
        feats.square().sum().backward()
        return steps, feats, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fast = run()
    with use_backends(native_kernels=False, native_attention=False, fast_decode=False, native_decode=False):
        ref = run()
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(fast[2], ref[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))  # (fp32 sums reordered)


def test_key_mask_masks_keys_per_query_and_checks_its_shape():
    """``key_mask`` on the base model: a query whose earlier keys are all masked sees itself only (its output is the
    one of a segment of that token alone); a wrong shape or dtype is one clear error."""
    torch.manual_seed(9)
    model = TransformerXL(gtrxl_config(d_model=16, n_layer=2, n_head=2, init_std=0.2)).eval()
    e = torch.randn(1, 4, 16)
    km = torch.zeros(1, 4, 4, dtype=torch.bool)
    km[0, 3, :3] = True
    alone = model(inputs_embeds=e[:, 3:]).last_hidden_state[:, 0]
    torch.testing.assert_close(model(inputs_embeds=e, key_mask=km).last_hidden_state[:, 3], alone)
    assert (model(inputs_embeds=e).last_hidden_state[:, 3] - alone).abs().max() > 1e-4
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor \[batch, T, M \+ T\] = \[1, 4, 4\]"):
        model(inputs_embeds=e, key_mask=torch.zeros(1, 4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_mask must be a bool tensor"):
        model(inputs_embeds=e, key_mask=torch.zeros(1, 4, 4))


def test_step_equals_window_at_the_edges():
    """Memory of 1 step, windows of 1 step, a window from the empty memory before the first step, one layer or
    three, windows longer and shorter than the memory: step = window, and the memory at the end is the acting one."""
    import random

    rng = random.Random(0)
    torch.manual_seed(10)
    for _ in range(20):
        M, T, pre = rng.choice([1, 2, 5, 17]), rng.choice([1, 2, 7, 20]), rng.choice([0, 1, 3, 40])
        N, L, gate = rng.choice([1, 3]), rng.choice([1, 3]), rng.choice(GATES)
        cfg = gtrxl_config(d_model=16, n_layer=L, n_head=2, mem_len=M, gate=gate, gate_bias=0.0, init_std=0.2)
        model = MemoryTransformer(cfg, 3).eval()
        x, resets = torch.randn(N, pre + T, 3), torch.rand(N, pre + T) < rng.random() * 0.5
        resets[:, 0] = True
        steps, state, end = rollout(model, x, resets, pre)
        state = state or model.initial_memory(N).state()
        feats, last = model.window(x[:, pre:], resets[:, pre:], state)
        torch.testing.assert_close(feats, steps[:, pre:], rtol=1e-5, atol=1e-5)
        assert torch.equal(last.invalid, end.invalid), (M, T, pre)


@pytest.mark.parametrize(
    "gate, d_model, n_head, d_head, n_envs, std",
    [
        ("gru", 64, 4, 16, 20, 0.3),  # (the example's shapes: 16 outputs at a time for many rows, 16 lanes of gates)
        ("gru", 40, 2, 20, 7, 0.3),  # (scalar tails: d_model 40 = 2 x 16 + 8)
        ("gru", 24, 3, 8, 2, 0.3),  # (few rows: a weight row at a time)
        ("gru", 48, 3, 16, 9, 3.0),  # (saturated gates: sigmoid and tanh near 0 and 1)
        ("residual", 64, 4, 16, 20, 0.3),  # (TrXL-I: the ReLU before the sum)
        ("highway", 48, 3, 16, 9, 0.3),  # (a gate the C step does not compute: the Python loop)
    ],
)
def test_acting_steps_one_token_loops_compute_what_the_layers_do(gate, d_model, n_head, d_head, n_envs, std):
    """The acting step goes through the one-token loop over the layers' weights (txl.kernels.decode), in C where it
    applies (the GRU gate and TrXL-I's ReLU included) and in Python otherwise (any gate), recording each layer's input
    for the memory: the features and the memory's state as the layers' own forward gives them, over 20 steps with
    resets, and the C step ran (or, for another gate, did not)."""
    from txl.kernels import admission, native
    from txl.kernels.backends import use_backends

    torch.manual_seed(3)
    cfg = gtrxl_config(d_model=d_model, n_layer=3, n_head=n_head, d_head=d_head, d_inner=2 * d_model + 8, mem_len=5,
                       gate=gate)  # fmt: skip
    model = MemoryTransformer(cfg, 6).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    x, resets = torch.randn(n_envs, 20, 6), torch.rand(n_envs, 20) < 0.15
    ran, step = [], native.decode_step

    def counted(*args, **kw):
        out = step(*args, **kw)
        if not admission.checking():  # (a kind's first step is checked against the Python loop: it runs once more)
            ran.append(out is not None)
        return out

    results = {}
    for name, policy in (("native", {}), ("loop", dict(native_decode=False)), ("layers", dict(fast_decode=False))):
        ran.clear()
        with use_backends(**policy), pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "decode_step", counted)
            feats, _, end = rollout(model, x, resets, 0)
        results[name] = feats, end.hidden, list(ran)
    feats, hidden, _ = results["layers"]
    for name in ("native", "loop"):
        torch.testing.assert_close(results[name][0], feats, rtol=1e-4, atol=1e-4 * float(feats.abs().max()))
        torch.testing.assert_close(results[name][1], hidden, rtol=1e-4, atol=1e-4 * float(hidden.abs().max()))
    in_c = gate in ("gru", "residual") and native.library() is not None
    assert sum(results["native"][2]) == 20 * in_c  # (each step in C, or none)
    assert not any(results["loop"][2] + results["layers"][2])


def test_a_hook_on_a_gates_layer_keeps_the_acting_step_on_the_layers():
    """The one-token loop reads the gates' weights in C: a forward hook on a gate's linear layer (an adapter's, a
    probe's) must fire, so that step then runs the layers' forward (fails if the loop ignored the gates' modules)."""
    torch.manual_seed(4)
    model = MemoryTransformer(gtrxl_config(d_model=32, n_layer=2, n_head=4, mem_len=4), 3).eval()
    seen = []
    model.core.layers[1].ff.gate.u_g.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    memory = model.initial_memory(5)
    for _ in range(3):
        model.step(torch.randn(5, 3), torch.zeros(5, dtype=torch.bool), memory)
    assert len(seen) == 3


def test_the_gated_acting_step_does_not_depend_on_the_number_of_threads(monkeypatch):
    """The C step's gate products are shared by the threads in whole blocks of outputs: the kernel run with 1 and 2
    threads gives the same bits (d_model 40: blocks of 16 and a tail; PyTorch's own products with 1 thread on both
    sides, as its GEMMs of several rows sum in another order with 2)."""
    torch.manual_seed(5)
    model = MemoryTransformer(gtrxl_config(d_model=40, n_layer=2, n_head=2, d_head=20, mem_len=4, init_std=0.3), 6)
    x, resets = torch.randn(7, 9, 6), torch.rand(7, 9) < 0.2
    threads, out = torch.get_num_threads(), {}
    try:
        torch.set_num_threads(1)
        for n in (1, 2):
            monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)  # (what the kernels are given)
            out[n] = rollout(model.eval(), x, resets, 0)[0]
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)
    assert torch.equal(out[1], out[2])
