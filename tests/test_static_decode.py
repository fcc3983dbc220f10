"""The one-token step with fixed shapes (txl.infer.static_decode, replayed as a CUDA graph on a GPU) computes what the
uncached model computes: run eagerly here, over a ring of mem_len + 1 slots, also once the ring is full and wraps,
with same_length, clamp_len, pre-LN, untied biases, the adaptive softmax and left-padded batches. (The graph capture
itself needs CUDA: benchmarks/model_speed.py --device cuda checks its tokens against the uncached loop.)"""

from __future__ import annotations

import pytest
import torch

from tests.test_kv_cache import VARIANTS, greedy_uncached, lm, uncached_steps
from txl.infer import static_decode
from txl.infer.generation import Penalties, generate, stream
from txl.infer.static_decode import StaticDecoder
from txl.kernels.backends import set_backends
from txl.model import cache as ring_module
from txl.model.modeling import KVCache

ALL = {**VARIANTS, "tf_same_length": {"same_length": True, "tf_same_length": True}}


@pytest.mark.parametrize("variant", ALL)
def test_static_steps_equal_the_uncached_loop_over_a_wrapping_ring(variant):
    model = lm(**ALL[variant], init_std=0.3)
    n_token, mem_len, steps = model.config.n_token, 11, 60
    prompt = torch.randint(0, n_token, (1, 7))
    forced = torch.randint(0, n_token, (steps,)).tolist()
    expected = uncached_steps(model, prompt, forced, mem_len)  # [steps, V]
    cache = KVCache(model.config, 1, mem_len, 7)
    with torch.no_grad():
        h = model.transformer(prompt, cache=cache, mem_len=mem_len).last_hidden_state[:, -1]
        log_probs = model.crit(h, return_log_probs=True)[1]
    decoder = StaticDecoder(model, cache, mem_len)
    for i, tok in enumerate(forced):
        torch.testing.assert_close(log_probs[0], expected[i], atol=1e-5, rtol=1e-5, msg=f"step {i + 1}")
        log_probs = decoder(torch.tensor([tok]))
    # the ring wrapped several times: every slot holds one of the last mem_len + 1 positions
    assert int(decoder.pos) == 7 + steps and sorted(decoder.slot_pos.tolist()) == list(range(7 + steps - 12, 7 + steps))


@pytest.fixture
def everywhere(monkeypatch):
    """Generation takes the static decoder on the CPU too (eagerly, no graph); counts its steps."""
    calls = []
    step = StaticDecoder.step
    monkeypatch.setattr(static_decode, "applies", lambda model, device, max_new_tokens: True)
    monkeypatch.setattr(StaticDecoder, "step", lambda self: calls.append(1) or step(self))
    return calls


@pytest.mark.parametrize("variant", ["plain", "same_length_clamp", "adaptive"])
def test_generation_through_the_static_decoder_equals_the_uncached_loop(variant, everywhere):
    model = lm(**VARIANTS[variant], init_std=0.3)
    prompt = torch.randint(0, model.config.n_token, (1, 20))
    got = generate(model, prompt, 100, temperature=0.0, mem_len=24)[0, 20:].tolist()
    assert len(everywhere) == 99  # every new token after the first (the prompt's pass gives the first)
    assert got == greedy_uncached(model, prompt, 100, 24)


def test_static_decoder_batches_left_padded_prompts_and_stops_rows(everywhere, monkeypatch):
    model = lm(init_std=0.3)
    lengths = [5, 13, 9, 1]
    longest = max(lengths)
    prompts = [torch.randint(0, model.config.n_token, (1, n)) for n in lengths]
    batch = torch.zeros(len(lengths), longest, dtype=torch.long)
    padding = torch.ones(len(lengths), longest, dtype=torch.bool)
    for row, p in enumerate(prompts):
        batch[row, longest - p.shape[1] :] = p
        padding[row, longest - p.shape[1] :] = False
    together = generate(model, batch, 40, temperature=0.0, mem_len=10, padding=padding)[:, longest:]
    assert everywhere
    for row, p in enumerate(prompts):
        assert together[row].tolist() == greedy_uncached(model, p, 40, 10), f"row {row} (prompt of {lengths[row]})"
    # sampling with a seed and a stop token: what the K/V cache's own steps give
    stop = int(together[1, 5])
    runs = []
    for on in (True, False):
        monkeypatch.setattr(static_decode, "applies", lambda model, device, max_new_tokens, on=on: on)
        g = torch.Generator().manual_seed(4)
        steps = stream(model, batch, 40, temperature=0.8, top_k=30, generator=g, padding=padding, stop_tokens=[stop])
        runs.append(torch.cat(list(steps), dim=1))
    assert runs[0].equal(runs[1])


def test_where_the_graph_applies(monkeypatch):
    model, cuda = lm(), torch.device("cuda")
    assert not static_decode.applies(model, torch.device("cpu"), 100)  # (the native decode kernel is faster there)
    assert static_decode.applies(model, cuda, 100)
    assert not static_decode.applies(model, cuda, static_decode.MIN_NEW_TOKENS - 1)  # (the capture would not pay)
    set_backends(graph_decode=False)
    assert not static_decode.applies(model, cuda, 100)
    set_backends(graph_decode=True)
    with monkeypatch.context() as m:  # (CUDA's autocast cannot be entered without CUDA: its flag, as it reads)
        m.setattr(torch, "is_autocast_enabled", lambda device_type=None: device_type == "cuda")
        assert not static_decode.applies(model, cuda, 100)  # under autocast: the kernel-by-kernel step
    assert not static_decode.applies(lm(attn_type=2), cuda, 100)  # absolute positions: no cache
    learnable = lm(attn_type=1, max_klen=64)  # (relative, cached, but its positional terms are learned per distance)
    assert not static_decode.applies(learnable, cuda, 100)
    with pytest.raises(ValueError, match="attn_type 0"):
        StaticDecoder(learnable, KVCache(learnable.config, 1, 8), 8)


def test_static_decoder_from_a_given_memory_and_with_penalties(everywhere, monkeypatch):
    """A memory given as layer inputs (HF's zero memory) fills the prompt's cache, which the ring takes over; the
    penalties read the history outside the step: both as the K/V cache's own steps give them."""
    model = lm(**VARIANTS["pre_lnorm_untie_r"], init_std=0.3)
    cfg = model.config
    prompt = torch.randint(0, cfg.n_token, (2, 6))
    mems = [torch.randn(2, 10, cfg.d_model) for _ in range(cfg.n_layer)]
    penalties = Penalties(repetition_penalty=1.5, no_repeat_ngram_size=2, presence_penalty=0.5)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(static_decode, "applies", lambda model, device, max_new_tokens, on=on: on)
        greedy = generate(model, prompt, 40, temperature=0.0, mem_len=16, mems=mems)[:, 6:]
        penalized = generate(model, prompt, 40, temperature=0.0, mem_len=16, penalties=penalties)[:, 6:]
        runs.append((greedy, penalized))
    assert everywhere
    assert runs[0][0].equal(runs[1][0]) and runs[0][1].equal(runs[1][1])
    assert greedy[0].tolist() == greedy_uncached(model, prompt[:1], 40, 16, [m[:1] for m in mems])
    plain = generate(model, prompt, 40, temperature=0.0, mem_len=16)[:, 6:]
    assert not runs[0][1].equal(plain)  # (the penalties change the text)


def test_a_broken_capture_goes_on_without_a_graph(monkeypatch):
    """Another thread's CUDA work can invalidate the capture (it runs nothing): the decoder then launches the step
    kernel by kernel, from the same state, for the rest of the generation."""
    model = lm(init_std=0.3)
    prompt = torch.randint(0, model.config.n_token, (1, 7))
    forced = torch.randint(0, model.config.n_token, (30,)).tolist()
    runs = []
    for broken in (False, True):
        cache = KVCache(model.config, 1, 11, 7)
        with torch.no_grad():
            model.transformer(prompt, cache=cache, mem_len=11)
        decoder = StaticDecoder(model, cache, 11)
        if broken:
            decoder.graph = True  # (as on CUDA)

            def capture(*args):
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            monkeypatch.setattr(ring_module, "capture_undone", capture)  # (the Ring's capture)
        runs.append(torch.stack([decoder(torch.tensor([t])) for t in forced]))
        assert decoder.graph is False and int(decoder.pos) == 7 + 30
    assert runs[0].equal(runs[1])


def test_float64_steps_stay_float64():
    """A float64 model's step computes in float64 throughout (the softmax too): its log-probabilities equal the
    float64 uncached loop's to 1e-12."""
    model = lm(init_std=0.3).double()
    prompt = torch.randint(0, model.config.n_token, (1, 5))
    forced = torch.randint(0, model.config.n_token, (25,)).tolist()
    expected = uncached_steps(model, prompt, forced, 9)
    cache = KVCache(model.config, 1, 9, 5, dtype=torch.float64)
    with torch.no_grad():
        model.transformer(prompt, cache=cache, mem_len=9)
    decoder = StaticDecoder(model, cache, 9)
    got = torch.stack([decoder(torch.tensor([t]))[0] for t in forced[:-1]])  # [24, V]
    torch.testing.assert_close(got, expected[1:], atol=1e-12, rtol=1e-12)
