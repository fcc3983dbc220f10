"""The ablation's positional schemes (``attn_type``, the original code's numbering): 1 Shaw et al., 2 Vaswani et al.,
3 Al-Rfou et al. (attn_type 0, Transformer-XL, is covered by the HF oracles and tests/test_invariants.py).

Each: parameter counts against the original code's formulas, causality across the memory, segments vs one pass where
the encoding allows it, the scores against the formula written out, the memory's positions, the K/V cache (1) or its
refusal (2, 3), save/load, and training, evaluation and generation through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLConfig, TransformerXLLM
from txl.infer.evaluate import evaluate
from txl.infer.generation import generate
from txl.kernels.backends import set_backends
from txl.model.modeling import KVCache

TYPES = [0, 1, 2, 3]


def config(attn_type: int, **kw) -> TransformerXLConfig:
    kw.setdefault("max_klen", 12 if attn_type in (1, 3) else 0)
    return debug_config(attn_type=attn_type, **kw)


def model(attn_type: int, **kw) -> TransformerXLLM:
    return TransformerXLLM(config(attn_type, **kw)).eval()


def original_param_count(c: TransformerXLConfig) -> int:
    """``MemTransformerLM``'s parameters (full softmax, tied weights): its layer classes and ``_create_params``."""
    d, hd, L = c.d_model, c.n_head * c.d_head, c.n_layer
    embedding = c.n_token * d + c.n_token  # word_emb (tied to the softmax) + softmax bias
    ff = d * c.d_inner + c.d_inner + c.d_inner * d + d + 2 * d
    attn = 3 * hd * d + hd * d + 2 * d  # qkv_net (or q_net + kv_net), o_net, layer_norm
    extra = {
        0: L * hd * d + 2 * hd,  # r_net per layer; r_w_bias, r_r_bias [H, Dh]
        1: L * c.max_klen * hd + L * hd + L * c.max_klen * c.n_head,  # r_emb, r_w_bias [L, H, Dh], r_bias
        2: 0,  # the sinusoid is not learned
        3: L * c.max_klen * hd,  # r_emb [L, max_klen, H, Dh] (H * Dh = d_model)
    }[c.attn_type]
    return embedding + L * (attn + ff) + extra


@pytest.mark.parametrize("attn_type", TYPES)
def test_parameter_counts_match_the_original_formulas(attn_type):
    m = model(attn_type)
    assert sum(p.numel() for p in m.parameters()) == original_param_count(m.config)


@pytest.mark.parametrize("attn_type", TYPES)
def test_causal_across_the_memory_and_the_memory_flows(attn_type):
    m = model(attn_type)
    ids = torch.randint(0, 97, (2, 14))
    with torch.no_grad():
        first = m(ids[:, :7])
        out = m(ids[:, 7:], mems=first.mems).last_hidden_state
        changed = ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 97  # the last token: no earlier output may change
        out2 = m(changed[:, 7:], mems=first.mems).last_hidden_state
        other = ids.clone()
        other[:, 0] = (other[:, 0] + 1) % 97  # a token of the previous segment: reaches this one through the memory
        out3 = m(other[:, 7:], mems=m(other[:, :7]).mems).last_hidden_state
    torch.testing.assert_close(out[:, :-1], out2[:, :-1], rtol=0, atol=0)
    assert not torch.allclose(out[:, -1], out2[:, -1])
    assert (out3 - out).abs().max() > 1e-4


@pytest.mark.parametrize(
    "attn_type, n_layer",
    [(0, 2), (1, 2), (2, 1), (3, 1)],  # absolute positions: a memory's deeper states keep their old positions
)
def test_segments_equal_one_pass(attn_type, n_layer):
    """With a memory that holds every earlier position, segment by segment equals one pass. For absolute positions
    this holds for one layer (its memory is the position-free input, positioned anew in each window); deeper
    memories are hidden states computed in an earlier window (the paper's "temporal confusion")."""
    m = model(attn_type, n_layer=n_layer, mem_len=12)
    ids = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        full = m(ids[:, :12], ids[:, 1:], mem_len=12).losses
        a = m(ids[:, :5], ids[:, 1:6], mem_len=12)
        b = m(ids[:, 5:9], ids[:, 6:10], mems=a.mems, mem_len=12)
        c = m(ids[:, 9:12], ids[:, 10:13], mems=b.mems, mem_len=12)
    torch.testing.assert_close(torch.cat([a.losses, b.losses, c.losses], 1), full, atol=1e-5, rtol=1e-5)


def test_shaw_scores_equal_the_formula():
    """attn_type 1: A_ij = (q_i + u_l).k_j + q_i.E_l[d] + b_l[d], d = min(i - j, max_klen - 1), by loops; the window
    (M + T = 11 keys) is longer than max_klen = 6, so the farthest distances share the last embedding."""
    m = model(1, max_klen=6)
    with torch.no_grad():
        for layer in m.transformer.layers:
            layer.attn.r_bias.normal_()  # (initialised at 0, as the original)
        ids = torch.randint(0, 97, (2, 11))
        first = m(ids[:, :5])
        out = m(ids[:, 5:], mems=first.mems, output_attentions=True, output_hidden_states=True)
    H, Dh = 2, 8
    for layer in range(2):
        attn = m.transformer.layers[layer].attn
        h, mem = out.hidden_states[layer], first.mems[layer]
        w_q, w_k, _ = attn.qkv_net.weight.split(H * Dh)
        B, T, M = h.shape[0], h.shape[1], mem.shape[1]
        q = (h @ w_q.T).view(B, T, H, Dh)
        k = (torch.cat([mem, h], 1) @ w_k.T).view(B, M + T, H, Dh)
        scores = torch.full((B, H, T, M + T), float("-inf"))
        for i in range(T):
            for j in range(M + i + 1):
                d = min(M + i - j, 5)
                scores[:, :, i, j] = (
                    ((q[:, i] + attn.r_w_bias) * k[:, j]).sum(-1) + (q[:, i] * attn.r_emb[d]).sum(-1) + attn.r_bias[d]
                )
        expected = torch.softmax(scores / math.sqrt(Dh), -1)
        torch.testing.assert_close(out.attentions[layer], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn_type", [2, 3])
def test_absolute_positions_are_indices_in_the_window(attn_type):
    """A key's position is its index j in the window [memory; segment]; the memory stays position-free (the original
    code adds positions into it in place, so they pile up), so the same call twice gives the same result."""
    from txl.model.modeling import sinusoid_embedding

    m = model(attn_type, n_layer=1)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        first = m(ids[:, :5], output_hidden_states=True)
        mem = first.mems[0].clone()
        torch.testing.assert_close(mem, first.hidden_states[0], rtol=0, atol=0)  # no positions in the memory
        out = m(ids[:, 5:], mems=first.mems, output_attentions=True, output_hidden_states=True)
        again = m(ids[:, 5:], mems=first.mems)
    torch.testing.assert_close(first.mems[0], mem, rtol=0, atol=0)
    torch.testing.assert_close(out.last_hidden_state, again.last_hidden_state, rtol=0, atol=1e-5)
    attn = m.transformer.layers[0].attn
    K = 9
    if attn_type == 2:
        pos = sinusoid_embedding(K, 16).flip(0)  # rows for the positions 0, ..., K-1
    else:
        pos = attn.r_emb[:K]
    x = torch.cat([mem, out.hidden_states[0]], 1) + pos  # [B, K, D]
    w_q, w_k, _ = attn.qkv_net.weight.split(16)
    q = (x[:, -4:] @ w_q.T).view(2, 4, 2, 8).transpose(1, 2)
    k = (x @ w_k.T).view(2, K, 2, 8).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(4, K, dtype=torch.bool).triu(K - 4 + 1), float("-inf"))
    torch.testing.assert_close(out.attentions[0], scores.softmax(-1), atol=1e-5, rtol=1e-5)


def test_kv_cache_for_relative_positions_only():
    ids = np.random.default_rng(0).integers(0, 97, 200)
    shaw = model(1, max_klen=20)
    a = evaluate(shaw, ids, batch_size=2, tgt_len=5, mem_len=15, cache=True)
    b = evaluate(shaw, ids, batch_size=2, tgt_len=5, mem_len=15, cache=False)
    assert abs(a.loss - b.loss) < 1e-6
    for attn_type in (2, 3):
        absolute = model(attn_type)
        with pytest.raises(ValueError, match="absolute positions.*cannot be cached"):
            KVCache(absolute.config, 1, 8)
        a = evaluate(absolute, ids, batch_size=2, tgt_len=5, mem_len=15)  # the default falls back to no cache
        b = evaluate(absolute, ids, batch_size=2, tgt_len=5, mem_len=15, cache=False)
        assert a.loss == b.loss


@pytest.mark.parametrize("attn_type", [1, 2, 3])
def test_generation_equals_the_uncached_loop(attn_type):
    """Greedy tokens of `generate` (K/V cache for 1, recomputed memory for 2 and 3) equal a loop that feeds the
    whole text again through the memory path, 30 steps past mem_len."""
    m = model(attn_type, mem_len=6, max_klen=40 if attn_type in (1, 3) else 0)
    prompt = torch.randint(0, 97, (1, 5))
    got = generate(m, prompt, 30, temperature=0.0)
    ids = prompt
    with torch.no_grad():
        mems, nxt = None, prompt
        for _ in range(30):
            out = m.transformer(nxt, mems, mem_len=6)
            mems = out.mems
            _, lp = m.crit(out.last_hidden_state[:, -1], return_log_probs=True)
            nxt = lp.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    assert torch.equal(got, ids)


@pytest.mark.parametrize("attn_type", [1, 2, 3])
def test_save_and_load(attn_type, tmp_path):
    m = model(attn_type)
    m.save_pretrained(tmp_path)
    loaded = TransformerXLLM.from_pretrained(tmp_path)
    assert loaded.config.attn_type == attn_type and loaded.config.max_klen == (0 if attn_type == 2 else 12)
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, ids).losses, m(ids, ids).losses, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attn_type=4), "attn_type = 4: must be 0 (Transformer-XL), 1 (Shaw et al.)"),
        (dict(attn_type=0, max_klen=8), "max_klen = 8: attn_type 0 learns no position table"),
        (dict(attn_type=1, max_klen=8, untie_r=True), "untie_r = True: unties Transformer-XL's biases"),
        (dict(attn_type=2, max_klen=-1), "max_klen = -1: must be an integer >= 0"),
    ],
)
def test_config_names_combinations_that_make_no_sense(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        debug_config(**overrides)
    with pytest.raises(ValueError, match="max_klen = 0: attn_type 3 learns one embedding per position"):
        TransformerXLLM(debug_config(attn_type=3))


@pytest.mark.parametrize("attn_type", [1, 2, 3])
def test_train_eval_generate_through_the_cli(attn_type, tmp_path, capsys):
    """`txl train --model.attn_type N`: the run's model has the scheme (max_klen derived as tgt_len + ext_len +
    mem_len for learned positions), learns, and `txl eval` / `txl generate` use it."""
    from train_helpers import run_inprocess
    from txl.cli import main
    from txl.train.checkpoint import resolve_model_dir

    run = run_inprocess(tmp_path, model__attn_type=attn_type, train__max_steps=12, train__eval_interval=0)
    folder = resolve_model_dir(run)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["attn_type"] == attn_type
    assert cfg["max_klen"] == (16 + 0 + 16 if attn_type in (1, 3) else 0)
    capsys.readouterr()
    main(["eval", "--model", str(run), "--max_batches", "4", "--mem_len", "32", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["loss"] < math.log(84)  # better than uniform: it learned something
    main(["generate", "--model", str(run), "--prompt", "ab ", "--max_new_tokens", "20", "--seed", "1"])
    assert len(capsys.readouterr().out) >= 20


@pytest.mark.parametrize("attn_type", TYPES)
@pytest.mark.parametrize("same_length", [False, True])
def test_fused_training_attention_gives_the_same_loss_and_gradients(attn_type, same_length, monkeypatch):
    """Training's attention as one scaled_dot_product_attention call (the (b)+(d) term and the mask as its bias; on
    CUDA by default, ``Backends.sdpa_training_devices``): the loss and every gradient of the PyTorch kernels', over
    two segments with the memory, with dropout (not dropatt, which keeps the explicit path)."""

    set_backends(native_attention=False)  # (attend(), as on a GPU)
    torch.manual_seed(0)
    klen = {"max_klen": 40} if attn_type in (1, 3) else {}
    m = TransformerXLLM(config(attn_type, same_length=same_length, dropatt=0.0, init_std=0.3, **klen))
    m.train()
    x = torch.randint(0, m.config.n_token, (3, 17))
    results = []
    for devices in ((), ("cpu",)):
        set_backends(sdpa_training_devices=devices)
        m.zero_grad()
        torch.manual_seed(1)  # (the same dropout masks)
        out = m(x[:, :8], x[:, 1:9])
        out2 = m(x[:, 8:16], x[:, 9:17], mems=out.mems)
        (out.loss + out2.loss).backward()
        results.append((out.loss + out2.loss, {n: p.grad.clone() for n, p in m.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_fused_training_attention_is_fp32_only(monkeypatch):
    """Under autocast (bf16) training keeps the explicit kernels (the fused call paid only in fp32); inference
    takes SDPA either way."""
    import torch.nn.functional as F

    set_backends(native_attention=False)
    set_backends(sdpa_training_devices=("cpu",))
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    m = TransformerXLLM(config(0, dropatt=0.0)).train()
    x = torch.randint(0, m.config.n_token, (2, 9))
    m(x[:, :8], x[:, 1:]).loss.backward()
    fp32 = len(calls)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x[:, :8], x[:, 1:]).loss.backward()
    assert fp32 == m.config.n_layer and len(calls) == fp32  # (none more under autocast)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m.eval()(x[:, :8], x[:, 1:])
    assert len(calls) == fp32 + m.config.n_layer
