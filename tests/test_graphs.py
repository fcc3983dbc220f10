"""The graphs of cached segments (txl.kernels.graphs), on the CPU through their stand-in (the step traced by make_fx,
every host-side value fixed, replayed): when a step records or replays, and that whatever a graph could not see (a
hook, new weights, another cache) makes the step run the reference instead of a stale graph. Exactness against the
reference is tests/test_backends_exact.py's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM, use_backends
from txl.model.modeling import KVCache

T, MEM = 4, 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerXLLM(debug_config(n_token=50, d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24,
                                        n_layer=2, mem_len=MEM, cutoffs=[20], div_val=1)).eval()  # fmt: skip


def evaluate(model, ids, *, bf16=True, graphs=True, cache=None, **kw):
    """The per-token losses of ``ids`` [B, N] in segments of T on one cache, and the cache."""
    cache = cache or KVCache(model.config, ids.shape[0], MEM, T)
    out = []
    with use_backends(graph_segments=("cpu",) if graphs else ()), torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for i in range(0, ids.shape[1] - T, T):
                out.append(model(ids[:, i : i + T], ids[:, i + 1 : i + T + 1], cache=cache, **kw).losses)
    return torch.cat(out, dim=1), cache


def recorded(cache) -> int:
    return len(cache.segment_graphs.graphs) if cache.segment_graphs is not None else 0


def test_a_full_window_records_one_graph_per_offset_and_replays_them(model):
    ids = torch.randint(0, 50, (2, 161))
    ours, cache = evaluate(model, ids)
    reference, ref_cache = evaluate(model, ids, graphs=False)
    torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2)
    assert recorded(ref_cache) == 0
    offsets = set(cache.segment_graphs.graphs)
    assert len(offsets) >= 2 and all(isinstance(o, int) for o in offsets)  # (the window moves along its buffer)
    assert all(g.graph is not None for g in cache.segment_graphs.graphs.values())


def test_fp32_steps_padding_and_per_layer_outputs_run_the_reference(model):
    ids = torch.randint(0, 50, (2, 81))
    _, cache = evaluate(model, ids, bf16=False)
    assert recorded(cache) == 0  # (fp32: bound by the arithmetic, not the launches)
    _, cache = evaluate(model, ids, output_hidden_states=True)
    assert recorded(cache) == 0
    cache = KVCache(model.config, 2, MEM, T)
    padding = torch.zeros(2, T, dtype=torch.bool)
    padding[0, :2] = True
    with torch.no_grad():
        model(ids[:, :T], cache=cache, padding=padding)
    _, cache = evaluate(model, ids[:, : 3 * T + 1], cache=cache)  # (3 steps: the padding still in the window)
    assert recorded(cache) == 0
    _, cache = evaluate(model, ids, cache=cache)  # (then it leaves the window: graphs)
    assert recorded(cache) > 0


def test_a_hook_new_weights_or_another_cache_are_never_replayed_stale(model):
    ids = torch.randint(0, 50, (2, 121))
    _, cache = evaluate(model, ids[:, :61])
    assert recorded(cache) > 0
    calls = []
    handle = model.transformer.layers[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        evaluate(model, ids[:, 60:], cache=cache)
    finally:
        handle.remove()
    assert len(calls) == 15  # (the hook ran at every step: no graph replayed over it)

    # New weights (a new tensor, another address) mid-evaluation: the steps on the same cache follow them.
    layer = model.transformer.layers[1].ff.layer_2
    saved, results = layer.weight, {}
    for graphs in (True, False):
        _, cache = evaluate(model, ids[:, :61], graphs=graphs)
        try:
            layer.weight = torch.nn.Parameter(saved.detach() * 3)
            results[graphs], _ = evaluate(model, ids[:, 60:], graphs=graphs, cache=cache)
        finally:
            layer.weight = saved
    torch.testing.assert_close(results[True], results[False], rtol=2e-2, atol=2e-2)


def test_a_cache_nobody_holds_is_freed_at_once_with_its_graphs(model):
    """The graphs keep their step function (and what it reads) in the cache; that function holds the cache weakly,
    so that no reference cycle keeps a dropped cache (its keys and values, its graphs' memory pool on a GPU) alive
    until Python's cycle collector happens to run: a server that scores with a new cache per request, or a benchmark
    that measures one path after another, would hold every earlier cache's GPU memory until then."""
    import gc
    import weakref

    ids = torch.randint(0, 50, (2, 81))
    gc.disable()
    try:
        ours, cache = evaluate(model, ids)
        assert recorded(cache) >= 2
        gone = weakref.ref(cache)
        del cache
        assert gone() is None, gc.get_referrers(gone())
    finally:
        gc.enable()
    again, _ = evaluate(model, ids)  # (and the graphs still replay what the reference computes)
    torch.testing.assert_close(again, ours)
