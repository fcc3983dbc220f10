"""The Compressive Transformer (txl.model.compressive; issue 76): cmem_len 0 is Transformer-XL, the compressed
memory reaches back c x cmem_len positions beyond the memory and no further, the groups of c do not depend on the
segment length, the reconstruction loss trains the compression functions alone, the K/V cache computes what the
memories compute, generation equals reading one token at a time, and `txl train` logs and resumes the
reconstruction loss."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import debug_config
from tests.train_helpers import run_inprocess
from txl import TransformerXLConfig, TransformerXLLM
from txl.infer.generation import generate
from txl.model.cache import KVCache
from txl.util.metrics import read_metrics

KINDS = ["max", "mean", "conv", "dilated_conv", "most_used"]


def lm(**kw) -> TransformerXLLM:
    torch.manual_seed(0)
    return TransformerXLLM(debug_config(**kw)).eval()


def read(model: TransformerXLLM, ids: torch.Tensor, T: int, **kw) -> tuple[list, torch.Tensor]:
    """The text read T tokens at a time with the memories: (the last memories, the last segment's log-probs)."""
    mems, out = None, None
    with torch.no_grad():
        for t in range(0, ids.shape[1], T):
            out = model(ids[:, t : t + T], mems=mems, return_log_probs=True, **kw)
            mems = out.mems
    return mems, out.log_probs


def test_cmem_len_0_is_transformer_xl_exactly():
    """A config without the new fields (an older config.json) is cmem_len 0; a Compressive Transformer read with
    cmem_len 0 computes what Transformer-XL with the same weights computes (its compression functions unused)."""
    base = debug_config(mem_len=6).to_dict()
    old = {k: v for k, v in base.items() if k not in ("cmem_len", "cmem_ratio", "compression")}
    assert TransformerXLConfig.from_dict(old) == TransformerXLConfig.from_dict(base)
    txl = lm(mem_len=6)
    comp = lm(mem_len=6, cmem_len=3, cmem_ratio=2)
    missing, unexpected = comp.load_state_dict(txl.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("transformer.compress.") for k in missing)
    ids = torch.randint(0, 97, (2, 30))
    mems_a, a = read(txl, ids, 5)
    mems_b, b = read(comp, ids, 5, cmem_len=0)
    assert len(mems_a) == len(mems_b) == 2 and torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_inside_the_compressed_span_is_read_and_one_beyond_it_is_not(kind):
    """One layer (its inputs are the embeddings, so a token reaches the last segment only through the memories):
    memory 4, 3 compressed slots of c = 2, segments of 4. Changing a token older than the memory but inside the
    compressed span changes the last segment's log-probs; one beyond it (long gone) changes nothing."""
    model = lm(n_layer=1, mem_len=4, cmem_len=3, cmem_ratio=2, compression=kind)
    ids = torch.randint(0, 97, (2, 48))
    _, base = read(model, ids, 4)
    last = 44  # the last segment [44, 48) reads the memory [40, 44) and the slots of [34, 40)
    for pos, changes in ((last - 4 - 2, True), (last - 4 - 6, True), (2, False)):
        other = ids.clone()
        other[:, pos] = (other[:, pos] + 1) % 97
        _, out = read(model, other, 4)
        assert (not torch.equal(out, base)) == changes, (kind, pos)
    without = read(model, ids, 4, cmem_len=0)[1]
    assert not torch.equal(without, base)  # (the compressed memory is read)


@pytest.mark.parametrize("T", [1, 3, 5, 8])
def test_the_groups_of_c_do_not_depend_on_the_segment_length(T):
    """The first layer's inputs are the embeddings whatever the segmentation: its compressed slots (mean pooling)
    are the same for segments of any length: c consecutive positions counted from the start, the memory holding
    mem_len to mem_len + c - 1 positions."""
    model = lm(mem_len=6, cmem_len=5, cmem_ratio=3, compression="mean")
    ids = torch.randint(0, 97, (1, 40))
    mems, _ = read(model, ids, T)
    emb = model.transformer.word_emb(ids)[0]  # [40, D]
    memory, slots = mems[0][0], mems[2][0]  # layer 0: [M, D], [Mc, D]
    M = memory.shape[0]
    assert 6 <= M <= 8 and (40 - M) % 3 == 0 and torch.allclose(memory, emb[40 - M :])
    groups = emb[: 40 - M].unflatten(0, (-1, 3)).mean(1)[-5:]
    torch.testing.assert_close(slots, groups)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 5])
def test_the_kv_cache_computes_what_the_memories_compute(kind, T):
    """A cached reading (the memory's keys and values, the compressed slots projected once; one-token steps by the
    model's step or its native form where it applies) gives the uncached reading's losses, and txl eval's cached
    scoring its uncached score."""
    from txl.infer.evaluate import evaluate

    model = lm(mem_len=6, cmem_len=4, cmem_ratio=3, compression=kind)
    ids = torch.randint(0, 97, (2, 41))
    got = {}
    for cached in (False, True):
        mems, cache, parts = None, KVCache(model.config, 2, 6, T) if cached else None, []
        with torch.no_grad():
            for t in range(0, 40, T):
                out = model(ids[:, t : t + T], ids[:, t + 1 : t + T + 1], mems=mems, cache=cache)
                mems, parts = out.mems, [*parts, out.losses]
        got[cached] = torch.cat(parts, 1)
        assert not cached or (cache.slots == 4 and 6 <= cache.length - cache.slots <= 8)
    torch.testing.assert_close(got[True], got[False], atol=1e-5, rtol=0)
    data = torch.randint(0, 97, (400,)).numpy()
    scores = [evaluate(model, data, batch_size=2, tgt_len=7, mem_len=6, cache=c).loss for c in (True, False)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-5)


def test_the_reconstruction_loss_trains_the_compression_functions_alone():
    """With and without the reconstruction loss, every gradient of the language model is the same; the compression
    functions (a convolution here) get theirs from it alone."""
    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(mem_len=4, cmem_len=2, cmem_ratio=2, compression="conv", dropout=0.0))
    ids = torch.randint(0, 97, (2, 25))
    mems = None
    with torch.no_grad():
        for t in range(0, 16, 4):
            mems = model(ids[:, t : t + 4], mems=mems).mems
    grads = {}
    for with_recon in (False, True):
        model.zero_grad()
        out = model(ids[:, 16:20], ids[:, 17:21], mems=mems)
        assert out.recon_loss is not None and out.recon_loss > 0
        (out.loss + out.recon_loss if with_recon else out.loss).backward()
        grads[with_recon] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        if ".compress." in name:
            assert g is None and grads[True][name] is not None and grads[True][name].abs().sum() > 0
        else:
            assert torch.equal(g, grads[True][name]), name


def test_greedy_generation_equals_reading_one_token_at_a_time():
    model = lm(mem_len=5, cmem_len=3, cmem_ratio=2, compression="conv")
    prompt = torch.randint(0, 97, (1, 5))  # (read as one segment: as one token at a time, within mem_len)
    out = generate(model, prompt, 16, temperature=0.0)[0].tolist()
    seq, mems = prompt[0].tolist(), None
    with torch.no_grad():
        for i in range(len(seq) + 15):
            step = model(torch.tensor([[seq[i]]]), mems=mems, return_log_probs=True)
            mems = step.mems
            if i >= len(prompt[0]) - 1:
                seq.append(int(step.log_probs[0, -1].argmax()))
    assert out == seq


def test_the_memory_layout_and_its_errors():
    """mems: n_layer memories then n_layer compressed memories; a mistake is one line naming what to do."""
    model = lm(mem_len=4, cmem_len=2, cmem_ratio=2)
    ids = torch.randint(0, 97, (2, 12))
    mems, _ = read(model, ids, 4)
    D = model.config.d_model
    assert len(mems) == 4 and mems[2].shape == (2, 2, D) and mems[0].shape == (2, 4, D)
    with pytest.raises(ValueError, match=r"pass mems\[:n_layer\]"):
        model(ids[:, :4], mems=mems, cmem_len=0)
    with pytest.raises(ValueError, match="must be n_layer = 2 tensors"):
        model(ids[:, :4], mems=mems[:3])
    with pytest.raises(ValueError, match="no compression function"):
        lm(mem_len=4)(ids[:, :4], cmem_len=2)
    with pytest.raises(ValueError, match="reads no padding"):
        model(ids[:, :4], padding=torch.tensor([[True, False, False, False]] * 2), cache=KVCache(model.config, 2, 4))
    with pytest.raises(ValueError, match="caches are not merged"):
        KVCache.merge([KVCache(model.config, 1, 4), KVCache(model.config, 1, 4)])
    with pytest.raises(ValueError, match=r"TransformerXLConfig\.cmem_len = 2: .*set mem_len > 0"):
        debug_config(mem_len=0, cmem_len=2)
    with pytest.raises(ValueError, match=r"TransformerXLConfig\.compression = 'gzip'"):
        debug_config(mem_len=4, cmem_len=2, compression="gzip")


def test_save_and_load_keep_the_compression(tmp_path):
    model = lm(mem_len=4, cmem_len=2, cmem_ratio=2, compression="dilated_conv")
    model.save_pretrained(tmp_path / "m")
    back = TransformerXLLM.from_pretrained(tmp_path / "m").eval()
    assert back.config == model.config
    ids = torch.randint(0, 97, (1, 20))
    assert torch.equal(read(model, ids, 4)[1], read(back, ids, 4)[1])
    assert copy.deepcopy(back.config).compression == "dilated_conv"


def test_txl_train_logs_the_reconstruction_loss_and_resumes_exactly(tmp_path):
    """Through `txl train`: every train row has recon beside the loss; a run stopped and resumed logs what the
    uninterrupted run logs."""
    run = dict(model__cmem_len=4, model__cmem_ratio=2, train__log_interval=1, train__eval_interval=3)
    run |= dict(train__checkpoint_interval=3, train__max_steps=6)
    full = run_inprocess(tmp_path, "full", **run)
    rows = [r for r in read_metrics(full) if r.get("split") == "train"]
    assert len(rows) == 6 and all(r["recon"] >= 0 for r in rows) and rows[-1]["recon"] > 0
    part = run_inprocess(tmp_path, "part", **run, train__max_tokens=3 * 4 * 16)
    run_inprocess(tmp_path, "part", **run)  # --resume auto
    again = [r for r in read_metrics(part) if r.get("split") == "train"]
    assert [(r["step"], r["loss"], r["recon"]) for r in again] == [(r["step"], r["loss"], r["recon"]) for r in rows]


def test_the_servers_engine_generates_from_a_compressive_model():
    """txl serve's engine (one request at a time: compressive caches are not merged; as `generate` does), and beam
    search (its cache's rows reordered with their slots)."""
    pytest.importorskip("uvicorn", reason="the server needs the extra 'serve'")
    from tests.serve_helpers import engine_tokens
    from txl.infer.generation import beam_search

    model = lm(mem_len=5, cmem_len=3, cmem_ratio=2)
    prompt = [5, 9, 11, 2, 40, 7]
    want = generate(model, torch.tensor([prompt]), 14, temperature=0.0, mem_len=5)[0, len(prompt) :].tolist()
    assert engine_tokens(model, prompt, 14, mem_len=5) == want
    beams = beam_search(model, torch.tensor([prompt]), 4, num_beams=2)
    assert beams.shape == (1, len(prompt) + 4)


def test_a_cache_reordered_or_taken_by_rows_keeps_each_rows_memories():
    """KVCache.select (beam search) and take move the compressed slots and the kept layer inputs with their rows."""
    model = lm(mem_len=4, cmem_len=3, cmem_ratio=2)
    ids = torch.randint(0, 97, (3, 30))
    cache, mems = KVCache(model.config, 3, 4, 5), None
    with torch.no_grad():
        for t in range(0, 25, 5):
            model(ids[:, t : t + 5], cache=cache)
            mems = model(ids[:, t : t + 5], mems=mems).mems
        rows = [2, 0, 2]
        part = cache.take([1])
        cache.select(rows)
        nxt = ids[rows, 25:30]
        got = model(nxt, nxt, cache=cache).losses
        want = model(nxt, nxt, mems=[m[rows] for m in mems]).losses
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        one = model(ids[1:2, 25:30], ids[1:2, 25:30], cache=part).losses
        alone = model(ids[1:2, 25:30], ids[1:2, 25:30], mems=[m[1:2] for m in mems]).losses
        torch.testing.assert_close(one, alone, atol=1e-5, rtol=0)


def test_the_cpu_recipe_trains_through_txl_train_and_logs_recon(tmp_path):
    """configs/sympy_compressive.yaml (a few steps, on a small corpus of the sympy dataset's form): the run's model
    is a Compressive Transformer and every train row logs recon."""
    from txl.cli import main

    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 40), ("valid", 4), ("test", 4)):
        (data / f"{split}.txt").write_text("".join(f"def f{i}(x):\n    return x + {i}\n\f\n" for i in range(n)))
    run = tmp_path / "run"
    main(["train", "--config", "configs/sympy_compressive.yaml", "--data.path", str(data), "--run_dir", str(run),
          "--train.max_steps", "4", "--train.log_interval", "1", "--train.eval_interval", "0", "--train.tgt_len",
          "16", "--train.batch_size", "2", "--data.cache_dir", str(tmp_path / "cache")])  # fmt: skip
    rows = [r for r in read_metrics(run) if r.get("split") == "train"]
    assert len(rows) == 4 and all("recon" in r for r in rows)
    assert TransformerXLLM.from_pretrained(run / "checkpoints" / "step-4").config.cmem_len == 128


def test_what_cannot_take_a_compressed_memory_yet_says_so_in_one_line(tmp_path, capsys):
    """`txl export onnx` of a Compressive Transformer: one line, nothing written."""
    pytest.importorskip("onnx", reason="ONNX export needs the extra 'onnx'")
    from tests.test_cli_errors import fails

    lm(mem_len=4, cmem_len=2, cmem_ratio=2).save_pretrained(tmp_path / "ct")
    line = fails(capsys, ["export", "onnx", "--model", str(tmp_path / "ct"), "--out", str(tmp_path / "m.onnx")])
    assert "cmem_len 2: the exported step carries one memory" in line and not (tmp_path / "m.onnx").exists()
