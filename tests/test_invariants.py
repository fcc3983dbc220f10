"""Model invariants: recurrence, causality, batch independence, the shift, masks, mem_len=0, clamp_len."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.kernels import linear as linear_kernels
from txl.kernels.backends import set_backends
from txl.model import attention
from txl.model.modeling import (
    SHIFT_ALIGN,
    Dropout,
    causal_mask,
    mask_scores,
    mask_scores_,
    rel_shift,
    rel_shift_gather,
    shift_padding,
    sinusoid_embedding,
)

VARIANTS = {
    "plain": {},
    "pre_lnorm": {"pre_lnorm": True},
    "untie_r_clamp": {"untie_r": True, "clamp_len": 5},
    "adaptive": {"n_token": 300, "cutoffs": [40, 120], "div_val": 2, "d_embed": 24},
}


def lm(**overrides) -> TransformerXLLM:
    return TransformerXLLM(debug_config(**overrides)).double().eval()


def run_segments(model, ids, lengths, mem_len, grad=False, **kw):
    """Feed ``ids`` [B, N] as consecutive segments of the given lengths; return the concatenated log-probs."""
    mems, outs, start = None, [], 0
    with torch.set_grad_enabled(grad):
        for n in lengths:
            out = model(ids[:, start : start + n], mems=mems, mem_len=mem_len, return_log_probs=True, **kw)
            outs.append(out.log_probs)
            mems, start = out.mems, start + n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "lengths, mem_len",
    [([8, 8, 8], 16), ([6, 6, 6, 6], 18), ([5, 7, 12], 24), ([4, 10, 10], 32)],
    ids=["seg=8,mem=16", "seg=6,mem=18", "uneven", "mem>needed"],
)
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training_path"])
def test_segments_equal_one_pass(variant, lengths, mem_len, grad):
    """With enough memory, k segments carrying the memory compute exactly one pass over the whole sequence."""
    model = lm(**VARIANTS[variant])
    ids = torch.randint(0, model.config.n_token, (2, sum(lengths)))
    whole = run_segments(model, ids, [sum(lengths)], mem_len=mem_len, grad=grad)
    pieces = run_segments(model, ids, lengths, mem_len=mem_len, grad=grad)
    torch.testing.assert_close(pieces, whole, atol=1e-10, rtol=0)


def test_short_memory_differs_from_one_pass():
    """Sanity of the test above: too short a memory must change the result."""
    model = lm()
    ids = torch.randint(0, 97, (2, 24))
    whole = run_segments(model, ids, [24], mem_len=24)
    short = run_segments(model, ids, [8, 8, 8], mem_len=4)
    assert (short - whole).abs().max() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t", [3, 9, 13], ids=["seg0", "seg1_first", "seg1_mid"])
def test_causality_across_memory(variant, t):
    """Changing token t changes nothing before t, but does change t and later (through the memory too)."""
    model = lm(**VARIANTS[variant])
    ids = torch.randint(0, model.config.n_token, (1, 24))
    changed = ids.clone()
    changed[0, t] = (ids[0, t] + 1) % model.config.n_token
    a = run_segments(model, ids, [9, 7, 8], mem_len=16)
    b = run_segments(model, changed, [9, 7, 8], mem_len=16)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=0, rtol=0)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-6
    assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-6  # the last segment sees it only through the memory


@pytest.mark.parametrize("variant", VARIANTS)
def test_batch_rows_independent(variant):
    model = lm(**VARIANTS[variant])
    ids = torch.randint(0, model.config.n_token, (3, 20))
    other = ids.clone()
    other[1:] = torch.randint(0, model.config.n_token, (2, 20))
    a = run_segments(model, ids, [10, 10], mem_len=10)
    b = run_segments(model, other, [10, 10], mem_len=10)
    torch.testing.assert_close(a[0], b[0], atol=1e-12, rtol=0)
    single = run_segments(model, ids[:1], [10, 10], mem_len=10)
    torch.testing.assert_close(a[:1], single, atol=1e-12, rtol=0)


@pytest.mark.parametrize("qlen, mlen", [(1, 0), (4, 0), (3, 5), (5, 3), (7, 7)])
def test_rel_shift_equals_naive_gather(qlen, mlen):
    """bd[.., i, j] must be bd_raw[.., i, K-1-(M+i-j)], the raw column of distance M+i-j, wherever j <= M+i."""
    klen = qlen + mlen
    raw = torch.randn(2, 3, qlen, klen)
    shifted = rel_shift(raw)
    for i in range(qlen):
        for j in range(mlen + i + 1):
            assert shifted[..., i, j].equal(raw[..., i, klen - 1 - (mlen + i - j)])
    # works on a transposed layout (only the [T, K] blocks are contiguous) without copying
    raw_t = torch.randn(3, 2, qlen, klen).transpose(0, 1)
    assert rel_shift(raw_t).untyped_storage().data_ptr() == raw_t.untyped_storage().data_ptr()
    torch.testing.assert_close(rel_shift(raw_t).tril(mlen), rel_shift(raw_t.contiguous()).tril(mlen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qlen, mlen", [(1, 0), (4, 0), (3, 5), (5, 3), (7, 9)])
def test_rel_shift_gradient_equals_the_gathers_in_the_products_layout(qlen, mlen, dtype):
    """The shift's backward gives the gradient of the gather (zero on the raw columns no query reads), in a layout
    the (b)+(d) product's backward reads without a copy: the raw term's [H, B] order, rows of stride K+T."""
    klen, H, B = qlen + mlen, 3, 2
    mask = causal_mask(qlen, mlen, False, 0)
    grad = torch.randn(B, H, qlen, klen).masked_fill(mask, 0).to(dtype)  # (masked scores get no gradient)
    raws = []
    for shift in (rel_shift, rel_shift_gather):
        raw = torch.randn(H, B, qlen, klen).to(dtype).requires_grad_().transpose(0, 1)  # as the model makes it
        raw.register_hook(raws.append)  # (the gradient as the product's backward gets it)
        shift(raw).backward(grad)
    assert raws[0].equal(raws[1])
    flat = raws[0].transpose(0, 1).view(H, B * qlen, klen)  # (a view: it would raise if a copy were needed)
    assert flat.stride() == (B * qlen * (klen + qlen), klen + qlen, 1)


@pytest.mark.parametrize("pre_lnorm", [False, True])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_training_projections_have_the_gradients_of_autograds_products(pre_lnorm, autocast, monkeypatch):
    """The projections of [memory; segment] with one backward (no input gradient for the detached memory) give
    the loss and every gradient of the per-slice F.linear path, to the products' rounding."""
    model = TransformerXLLM(debug_config(dropout=0.0, pre_lnorm=pre_lnorm)).train()
    ids = torch.randint(0, model.config.n_token, (3, 2 * 12 + 1))
    results = []
    for fused in (True, False):
        set_backends(segment_projection=fused)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            first = model(ids[:, :12], labels=ids[:, 1:13])
            loss = model(ids[:, 12:24], labels=ids[:, 13:25], mems=first.mems).loss + first.loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert loss.equal(ref_loss) and grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        scale = ref_grads[name].abs().max()
        tol = 2e-2 if autocast else 1e-5
        assert (g - ref_grads[name]).abs().max() <= tol * scale, name
    set_backends(segment_projection=True)
    qkv = model.transformer.layers[0].attn.qkv_net.weight
    calls = []
    real = linear_kernels._SegmentMemoryProjection.apply
    monkeypatch.setattr(linear_kernels._SegmentMemoryProjection, "apply", lambda *a: calls.append(1) or real(*a))
    model(ids[:, 12:24], labels=ids[:, 13:25], mems=first.mems).loss.backward()
    assert len(calls) == (0 if pre_lnorm else model.config.n_layer) and qkv.grad is not None


@pytest.mark.parametrize("qlen, mlen", [(2, 0), (4, 0), (3, 5), (5, 3), (7, 9), (9, 7)])
def test_padded_rel_shift_is_a_view_without_overlap(qlen, mlen):
    """Inference pads the raw rows to a multiple of SHIFT_ALIGN: the shifted view keeps every unmasked entry and no
    two of its entries share memory, so the mask can be written into it in place."""
    klen = qlen + mlen
    width = klen + shift_padding(klen)
    assert width % SHIFT_ALIGN == 0 and width > klen
    raw = torch.randn(2, 3, qlen, width)
    raw[..., klen:] = 0
    shifted = rel_shift(raw, klen)
    assert shifted.shape == (2, 3, qlen, klen)
    assert shifted.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    torch.testing.assert_close(shifted.tril(mlen), rel_shift(raw[..., :klen].contiguous()).tril(mlen), atol=0, rtol=0)
    marks = torch.arange(shifted.numel(), dtype=raw.dtype).view(shifted.shape)
    shifted.copy_(marks)  # every entry its own number: with an overlap, a later write would overwrite an earlier
    assert shifted.equal(marks)


@pytest.mark.parametrize("kind", ["causal", "same_length", "padding", "scattered", "none"])
def test_in_place_mask_equals_the_added_bias(kind):
    """The in-place mask (only the columns from the first masked one on) equals the added bias."""
    qlen, mlen = 5, 7
    mask = causal_mask(qlen, mlen, kind == "same_length", 6)
    if kind == "scattered":
        mask = torch.zeros_like(mask)
        mask[1, 2] = mask[3, 5] = mask[0, 9] = mask[4, 11] = True
    if kind == "padding":
        padded = torch.zeros(2, mlen + qlen, dtype=torch.bool)
        padded[0, :4] = True
        mask = (mask | padded[:, None, :])[:, None]  # [B, 1, T, K]
    elif kind == "none":
        mask = torch.zeros_like(mask)
    score = torch.randn(2, 3, qlen, mlen + qlen)
    expected = mask_scores(score, mask)
    assert mask_scores_(score, mask) is score
    assert score.equal(expected)


def test_half_precision_softmax_computes_in_fp32():
    """Attention scores stay bf16 under autocast because torch's bf16 softmax computes in fp32 and rounds once."""
    x = (torch.randn(4, 3, 17, 300) * 4).bfloat16()
    assert torch.softmax(x, -1).equal(torch.softmax(x.float(), -1).bfloat16())


def naive_layer_scores(model, h, mem, layer, clamp_len=-1):
    """Scores of one layer straight from the paper: A_ij = (q_i+u).k_j + (q_i+v).W_kR R_{i-j}, by loops."""
    attn = model.transformer.layers[layer].attn
    cfg = model.config
    H, Dh = cfg.n_head, cfg.d_head
    cat = torch.cat([mem, h], dim=1)
    B, T, M = h.shape[0], h.shape[1], mem.shape[1]
    w_q, w_k, _ = attn.qkv_net.weight.split(H * Dh)
    q = (h @ w_q.T).view(B, T, H, Dh)
    k = (cat @ w_k.T).view(B, M + T, H, Dh)
    u = model.transformer.r_w_bias[layer] if cfg.untie_r else model.transformer.r_w_bias
    v = model.transformer.r_r_bias[layer] if cfg.untie_r else model.transformer.r_r_bias
    scores = torch.full((B, H, T, M + T), float("-inf"), dtype=h.dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0.0, cfg.d_model, 2.0, dtype=h.dtype) / cfg.d_model))
    for i in range(T):
        for j in range(M + i + 1):
            dist = float(M + i - j)
            if clamp_len > 0:
                dist = min(dist, clamp_len)
            r = torch.cat([torch.sin(dist * inv_freq), torch.cos(dist * inv_freq)])  # R_{i-j}
            r_k = (r @ attn.r_net.weight.T).view(H, Dh)
            scores[:, :, i, j] = ((q[:, i] + u) * k[:, j]).sum(-1) + ((q[:, i] + v) * r_k).sum(-1)
    return scores / math.sqrt(Dh)


@pytest.mark.parametrize("variant", ["plain", "untie_r_clamp"])
def test_attention_equals_paper_formula(variant):
    """The fast path (one GEMM per head + strided shift) equals the explicit per-(i, j) formula."""
    model = lm(**VARIANTS[variant])
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        first = model(ids[:, :5])
        out = model(ids[:, 5:], mems=first.mems, output_attentions=True, output_hidden_states=True)
    for layer in range(model.config.n_layer):
        h, mem = out.hidden_states[layer], first.mems[layer]
        expected = torch.softmax(naive_layer_scores(model, h, mem, layer, model.config.clamp_len), dim=-1)
        torch.testing.assert_close(out.attentions[layer], expected, atol=1e-12, rtol=0)


def reference_mask(qlen, mlen, mem_len, same_length):
    """The reference code's construction (triu + tril), re-built with plain loops."""
    klen = mlen + qlen
    mask = [[j > i + mlen for j in range(klen)] for i in range(qlen)]  # triu(ones, 1 + mlen)
    if same_length:
        mask_len = klen - mem_len
        mask_shift_len = qlen - mask_len if mask_len > 0 else qlen
        for i in range(qlen):
            for j in range(klen):
                mask[i][j] = mask[i][j] or j - i <= -mask_shift_len  # tril(ones, -mask_shift_len)
    return torch.tensor(mask, dtype=torch.bool)


@pytest.mark.parametrize(
    "qlen, mlen, mem_len",
    [(4, 6, 6), (4, 3, 6), (4, 0, 6), (6, 4, 4), (5, 5, 5), (8, 8, 8), (3, 10, 10), (5, 2, 3), (1, 7, 7)],
)
@pytest.mark.parametrize("same_length", [False, True])
def test_mask_equals_reference_construction(qlen, mlen, mem_len, same_length):
    """Includes klen == mem_len + qlen (e.g. 4/6/6, 8/8/8: huggingface/transformers#14832)."""
    assert causal_mask(qlen, mlen, same_length, mem_len).equal(reference_mask(qlen, mlen, mem_len, same_length))
    if same_length and mlen + qlen > mem_len:
        visible = (~causal_mask(qlen, mlen, True, mem_len)).sum(1)
        assert visible.tolist() == [min(mem_len, mlen + i + 1) for i in range(qlen)]


def test_same_length_window_in_model():
    """With same_length (one layer), a key more than mem_len positions back has no influence."""
    model = lm(n_layer=1, same_length=True, mem_len=4)
    ids = torch.randint(0, 97, (1, 12))
    changed = ids.clone()
    changed[0, 3] = (ids[0, 3] + 1) % 97
    a = run_segments(model, ids, [6, 6], mem_len=4)
    b = run_segments(model, changed, [6, 6], mem_len=4)
    torch.testing.assert_close(a[:, 7:], b[:, 7:], atol=0, rtol=0)  # positions >= 3 + 4 no longer see token 3
    assert (a[:, 3:7] - b[:, 3:7]).abs().min() > 0
    # and same_length=False (per call) makes them see it again through the layer's memory
    c = run_segments(model, ids, [6, 6], mem_len=6, same_length=False)
    d = run_segments(model, changed, [6, 6], mem_len=6, same_length=False)
    assert (c[:, 7:] - d[:, 7:]).abs().max() > 1e-6


def test_mem_len_zero():
    model = lm(mem_len=0)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        first = model(ids[:, :8])
        assert first.mems is None
        second = model(ids[:, 8:], mems=first.mems, return_log_probs=True)
        alone = model(ids[:, 8:], return_log_probs=True)
    torch.testing.assert_close(second.log_probs, alone.log_probs, atol=0, rtol=0)
    with pytest.raises(ValueError, match="same_length"):
        model(ids, same_length=True)


def test_clamp_len():
    table = sinusoid_embedding(12, 16, clamp_len=4)
    for k in range(12 - 4):  # rows of distances 11..4 all hold distance 4
        assert table[k].equal(table[12 - 1 - 4])
    torch.testing.assert_close(sinusoid_embedding(12, 16, clamp_len=20), sinusoid_embedding(12, 16))
    model = lm()
    ids = torch.randint(0, 97, (2, 16))
    base = run_segments(model, ids, [8, 8], mem_len=8)
    torch.testing.assert_close(run_segments(model, ids, [8, 8], mem_len=8, clamp_len=100), base)
    assert (run_segments(model, ids, [8, 8], mem_len=8, clamp_len=2) - base).abs().max() > 1e-3


def test_memory_length_per_call_and_ext_len():
    model = lm(mem_len=4)
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        out = model(ids[:, :6])
        assert out.mems[0].shape == (2, 4, 16)
        torch.testing.assert_close(out.mems[0], model(ids[:, :6], output_hidden_states=True).hidden_states[0][:, 2:])
        longer = model(ids[:, :6], mem_len=10)
        assert longer.mems[0].shape == (2, 6, 16)
        ext = model(ids[:, :6], mem_len=3, ext_len=2)  # the last 2 positions are left out of the memory
        h0 = model(ids[:, :6], output_hidden_states=True).hidden_states[0]
        torch.testing.assert_close(ext.mems[0], h0[:, 1:4])


def test_mems_are_detached_and_inputs_checked():
    model = TransformerXLLM(debug_config()).train()
    ids = torch.randint(0, 97, (2, 8))
    out = model(ids, ids)
    assert all(not m.requires_grad and m.grad_fn is None for m in out.mems)
    nxt = model(ids, ids, mems=out.mems)
    nxt.loss.backward()  # no second backward through the first segment's graph
    with pytest.raises(ValueError, match="batch-first"):
        model(ids, mems=[m.transpose(0, 1) for m in out.mems])
    with pytest.raises(ValueError, match="n_token"):
        model(torch.full((1, 3), 97))


@pytest.mark.parametrize("ext_len", [1, 5, 12])
@pytest.mark.parametrize("variant", ["plain", "adaptive"])
def test_ext_len_segments_equal_one_pass(variant, ext_len):
    """ext_len as the reference data loader feeds it: each input starts with the last ext_len tokens of the previous
    segment, only the last tgt_len positions are scored, and the memory leaves those ext_len positions out. With a
    memory that reaches back to the start, every token is scored once with its whole past: one pass."""
    model = lm(mem_len=64, **VARIANTS[variant])
    ids = torch.randint(0, model.config.n_token, (2, 41))
    with torch.no_grad():
        one_pass = model(ids[:, :-1], ids[:, 1:]).losses  # [2, 40]
        mems, pos, scored = None, 0, []
        while pos < 40:
            n, beg = min(8, 40 - pos), max(0, pos - ext_len)
            out = model(ids[:, beg : pos + n], ids[:, pos + 1 : pos + n + 1], mems=mems, ext_len=ext_len)
            assert out.losses.shape == (2, n)  # the ext_len context positions are not scored
            scored.append(out.losses)
            mems, pos = out.mems, pos + n
    torch.testing.assert_close(torch.cat(scored, dim=1), one_pass, atol=1e-10, rtol=0)


def test_inference_and_training_paths_agree():
    model = lm(n_token=300, cutoffs=[40, 120], div_val=2)
    ids = torch.randint(0, 300, (2, 12))
    torch.testing.assert_close(
        run_segments(model, ids, [6, 6], mem_len=6, grad=True), run_segments(model, ids, [6, 6], mem_len=6)
    )


def test_attention_probabilities():
    model = lm()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        first = model(ids[:, :5])
        out = model(ids[:, 5:], mems=first.mems, output_attentions=True)
    mask = causal_mask(7, 5, False, 8)
    for prob in out.attentions:
        assert prob.shape == (2, 2, 7, 12)
        torch.testing.assert_close(prob.sum(-1), torch.ones(2, 2, 7, dtype=prob.dtype))
        assert prob[..., mask].abs().max() == 0


def test_dropout_only_in_training():
    model = TransformerXLLM(debug_config(dropout=0.2, dropatt=0.3))
    ids = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        model.train()
        assert not model(ids, ids).losses.equal(model(ids, ids).losses)
        model.eval()
        assert model(ids, ids).losses.equal(model(ids, ids).losses)
    only_att = TransformerXLLM(debug_config(dropout=0.0, dropatt=0.5)).train()
    with torch.no_grad():  # dropatt applies in training mode even without gradients
        assert not only_att(ids, ids).losses.equal(only_att(ids, ids).losses)


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("n", [1_001, 300_001])
def test_cpu_dropout_mask_has_the_dropout_distribution(n, native_on, monkeypatch):
    """Both CPU masks (txl.kernels.native's Philox stream; without it, two 24-bit uniforms from each 64-bit random
    word):
    keep rate 1 - p, kept entries scaled by 1 / (1 - p), neighbours independent, the same mask for the same
    seed."""
    set_backends(native_dropout=native_on)
    p = 0.1
    drop = Dropout(p).train()
    x = torch.ones(n)
    torch.manual_seed(0)
    y = drop(x)
    kept = y != 0
    assert torch.allclose(y[kept], torch.full((), 1 / (1 - p)))
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * sd
    pairs = kept[: n // 2 * 2].view(-1, 2).double().t()  # neighbours (the two uniforms of a word without native)
    assert abs(torch.corrcoef(pairs)[0, 1].item()) < 5 / math.sqrt(n // 2)
    torch.manual_seed(0)
    assert drop(x).equal(y)
    assert not drop(x).equal(y)


@pytest.mark.parametrize("same_length", [False, True])
def test_mask_bias_equals_masked_fill(same_length):
    """The mask is added as a -inf bias (faster than masked_fill); the loss and every gradient stay the same."""
    from unittest import mock

    def fill(score, mask, inplace=False):
        return score.masked_fill_(mask, float("-inf")) if inplace else score.masked_fill(mask, float("-inf"))

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(same_length=same_length, dropout=0.0))
    x = torch.randint(0, model.config.n_token, (2, 9))
    mems = [torch.randn(2, 5, model.config.d_model) for _ in range(model.config.n_layer)]
    results = []
    for patch in (mock.patch.object(attention, "mask_scores", fill), mock.MagicMock()):
        model.zero_grad()
        with patch:
            loss = model(x[:, :-1], x[:, 1:], mems=mems, mem_len=6).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
