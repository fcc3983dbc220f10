"""Adaptive input and projected adaptive log-softmax: normalisation, in-order NLL, lookups, fp32 under autocast."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.model import adaptive, modeling

CASES = [
    dict(cutoffs=cutoffs, div_val=div_val, d_embed=d_embed, tie_projs=tie, tie_weight=tie_weight)
    for cutoffs, div_val, d_embed, tie, tie_weight in itertools.product(
        [[], [30, 90]], [1, 2, 4], [16, 32], ["untied", "tied"], [True, False]
    )
    if not (cutoffs == [] and div_val > 1)  # div_val only matters with clusters
]


def build(case) -> TransformerXLLM:
    n_clusters = len(case["cutoffs"])
    tie_projs = [False] * (n_clusters + 1) if case["tie_projs"] == "untied" else [False] + [True] * n_clusters
    cfg = debug_config(n_token=150, **{**case, "tie_projs": tie_projs})
    return TransformerXLLM(cfg).eval()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_log_probs_normalised_and_losses_in_order(case):
    model = build(case)
    ids = torch.randint(0, 150, (3, 10))
    targets = torch.randint(0, 150, (3, 10))
    targets[0, 2] = -100
    with torch.no_grad():
        full = model(ids, targets, return_log_probs=True)
        fast = model(ids, targets)  # tail logits only for the tokens of each cluster
    torch.testing.assert_close(full.log_probs.logsumexp(-1), torch.zeros(3, 10), atol=1e-5, rtol=0)
    gathered = -full.log_probs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    gathered[0, 2] = 0.0
    torch.testing.assert_close(full.losses, gathered, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.losses, gathered, atol=1e-5, rtol=0)
    assert fast.losses[0, 2] == 0
    torch.testing.assert_close(fast.loss, gathered.sum() / 29)


def test_parameter_layout_and_ties():
    model = build(dict(cutoffs=[30, 90], div_val=2, d_embed=32, tie_projs="tied", tie_weight=True))
    emb, crit = model.transformer.word_emb, model.crit
    assert [e.weight.shape for e in emb.emb_layers] == [(30, 32), (60, 16), (60, 8)]
    assert [p.shape for p in emb.emb_projs] == [(16, 32), (16, 16), (16, 8)]
    assert all(o.weight is e.weight for o, e in zip(crit.out_layers, emb.emb_layers, strict=True))
    assert crit.out_projs[0] is not emb.emb_projs[0]
    assert crit.out_projs[1] is emb.emb_projs[1] and crit.out_projs[2] is emb.emb_projs[2]
    one_table = build(dict(cutoffs=[30, 90], div_val=1, d_embed=16, tie_projs="tied", tie_weight=True))
    assert len(one_table.crit.out_projs) == 0 and len(one_table.transformer.word_emb.emb_projs) == 0


def test_adaptive_embedding_lookup():
    """Each token is embedded by its own cluster's table and projection, scaled by sqrt(d_model)."""
    model = build(dict(cutoffs=[30, 90], div_val=2, d_embed=32, tie_projs="untied", tie_weight=True))
    emb = model.transformer.word_emb
    ids = torch.tensor([[0, 29, 30, 89, 90, 149]])
    out = emb(ids)
    for pos, (tok, cluster, start) in enumerate([(0, 0, 0), (29, 0, 0), (30, 1, 30), (89, 1, 30), (90, 2, 90)]):
        expected = emb.emb_layers[cluster].weight[tok - start] @ emb.emb_projs[cluster].T * 16**0.5
        torch.testing.assert_close(out[0, pos], expected)
    out.sum().backward()  # tables receive gradient only for the rows that were used
    assert emb.emb_layers[1].weight.grad[1:59].abs().sum() == 0
    assert emb.emb_layers[1].weight.grad[0].abs().sum() > 0 and emb.emb_layers[1].weight.grad[59].abs().sum() > 0


@pytest.mark.parametrize("div_val", [1, 4])
def test_bf16_autocast_softmax_in_fp32(div_val):
    """Under bf16 autocast (also div_val > 1, HF #19914) the log-softmax runs in fp32 and stays normalised."""
    model = TransformerXLLM(debug_config(n_token=150, cutoffs=[30, 90], div_val=div_val, d_embed=32)).eval()
    ids = torch.randint(0, 150, (2, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, ids, return_log_probs=True)
    assert out.log_probs.dtype == torch.float32 and out.losses.dtype == torch.float32
    torch.testing.assert_close(out.log_probs.logsumexp(-1), torch.zeros(2, 8), atol=1e-5, rtol=0)
    with torch.no_grad():
        ref = model(ids, ids)
    assert (out.losses - ref.losses).abs().max() < 0.2  # bf16 is close to fp32, not equal


def test_bad_targets():
    model = build(dict(cutoffs=[30, 90], div_val=2, d_embed=32, tie_projs="tied", tie_weight=True))
    ids = torch.randint(0, 150, (2, 4))
    with pytest.raises(ValueError, match="targets must be in"):
        model(ids, torch.full((2, 4), 150))
    for shape in ((2, 5), (3, 4), (2, 0)):  # longer than the input, another batch, nothing to score
        with pytest.raises(ValueError, match="shape"):
            model(ids, torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("cutoffs", [[29, 90], [30, 90, 120], [29, 90, 120]], ids=["pad1", "pad7", "pad0"])
def test_the_heads_padding_columns_change_nothing(cutoffs, monkeypatch):
    """The head padded with -inf columns up to HEAD_ALIGN (29 + 2 -> 32, 30 + 3 -> 40; 29 + 3 = 32 unpadded) gives
    the unpadded head's losses, log-probs and gradients, to the softmax's rounding."""
    head = cutoffs[0] + len(cutoffs)
    assert (head % modeling.HEAD_ALIGN == 0) == (cutoffs == [29, 90, 120])
    model = TransformerXLLM(debug_config(n_token=150, cutoffs=cutoffs, div_val=2, d_embed=16)).train()
    ids, targets = torch.randint(0, 150, (3, 10)), torch.randint(0, 150, (3, 10))
    results = []
    for align in (modeling.HEAD_ALIGN, 0):
        monkeypatch.setattr(adaptive, "HEAD_ALIGN", align)  # (read where the head is built)
        model.zero_grad()
        torch.manual_seed(0)
        out = model(ids, targets)
        out.loss.backward()
        with torch.no_grad():
            log_probs = model.eval()(ids, return_log_probs=True).log_probs
        model.train()
        results.append((out.losses.detach(), log_probs, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (losses, log_probs, grads), (ref_losses, ref_log_probs, ref_grads) = results
    assert log_probs.shape == ref_log_probs.shape == (3, 10, 150)
    torch.testing.assert_close(losses, ref_losses, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-6, rtol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-7, rtol=1e-5, msg=name)
