"""The memory as cached keys and values (KVCache): evaluation and generation compute what the uncached model
computes (the memory's keys/values projected again from its hidden states), also once the memory is full and
slides; batched prompts of different lengths give what each prompt gives alone; stop tokens end rows."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ADAPTIVE_FIXTURE, HF_FIXTURES, debug_config
from txl import TransformerXLLM
from txl.infer.evaluate import evaluate
from txl.infer.generation import generate, stream
from txl.infer.prompt import read_prompt
from txl.kernels import decode as kernels_decode
from txl.kernels.backends import set_backends
from txl.kernels.linear import weight_copies
from txl.model import modeling
from txl.model.config import Reading
from txl.model.modeling import KVCache

VARIANTS = {
    "plain": {},
    "same_length_clamp": {"same_length": True, "clamp_len": 6},
    "pre_lnorm_untie_r": {"pre_lnorm": True, "untie_r": True},
    "adaptive": {"n_token": 300, "cutoffs": [40, 120], "div_val": 2, "d_embed": 24},
}


def lm(**overrides) -> TransformerXLLM:
    return TransformerXLLM(debug_config(**overrides)).eval()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seg, mem_len", [(8, 16), (5, 23), (16, 8)], ids=["8/16", "5/23", "16/8"])
def test_cached_segments_equal_the_uncached_memory(variant, seg, mem_len):
    model = lm(**VARIANTS[variant], mem_len=mem_len)
    ids = torch.randint(0, model.config.n_token, (3, 12 * seg + 1))
    cache = KVCache(model.config, 3, mem_len, seg)
    mems, lost = None, 0
    with torch.no_grad():
        for s in range(0, 12 * seg, seg):
            x, y = ids[:, s : s + seg], ids[:, s + 1 : s + seg + 1]
            plain = model(x, y, mems=mems, return_log_probs=True)
            cached = model(x, y, cache=cache, return_log_probs=True)
            torch.testing.assert_close(cached.log_probs, plain.log_probs, atol=1e-5, rtol=0)
            torch.testing.assert_close(cached.losses, plain.losses, atol=1e-5, rtol=0)
            assert cached.mems is None and cache.length == plain.mems[0].shape[1]
            lost = max(lost, cache.start)
            mems = plain.mems
    assert lost > 0  # the window slid and was moved to the front of the buffer at least once


def test_cached_evaluation_equals_uncached(tmp_path):
    model = lm(mem_len=8, same_length=True)
    data = np.random.default_rng(0).integers(0, 97, 3_000)
    kw = dict(batch_size=4, tgt_len=12, mem_len=40, clamp_len=20, same_length=True)
    cached, plain = evaluate(model, data, **kw), evaluate(model, data, cache=False, **kw)
    assert cached.tokens == plain.tokens > 2_900
    assert cached.loss == pytest.approx(plain.loss, abs=1e-6)
    with pytest.raises(ValueError, match="inference"):
        model.train()(torch.zeros(4, 3, dtype=torch.long), cache=KVCache(model.config, 4, 8))


def uncached_steps(model, prompt, forced: list[int], mem_len: int) -> torch.Tensor:
    """The reference: the memory as hidden states, re-projected at every step; the log-probs [steps, V] before
    each of the ``forced`` tokens is fed."""
    all_log_probs = []
    with torch.no_grad():
        out = model.transformer(prompt, None, mem_len=mem_len)
        for tok in forced:
            all_log_probs.append(model.crit(out.last_hidden_state[:, -1], return_log_probs=True)[1])
            out = model.transformer(torch.tensor([[tok]]), out.mems, mem_len=mem_len)
    return torch.cat(all_log_probs)


def greedy_uncached(model, prompt, steps: int, mem_len: int, mems=None) -> list[int]:
    tokens = []
    with torch.no_grad():
        out = model.transformer(prompt, mems, mem_len=mem_len)
        for _ in range(steps):
            nxt = model.crit(out.last_hidden_state[:, -1], return_log_probs=True)[1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            out = model.transformer(nxt, out.mems, mem_len=mem_len)
    return tokens


@pytest.mark.parametrize("variant", ["plain", "same_length_clamp", "adaptive"])
def test_cached_generation_equals_the_uncached_loop_over_a_sliding_memory(variant):
    model = lm(**VARIANTS[variant])
    n_token, mem_len, steps = model.config.n_token, 24, 512
    prompt = torch.randint(0, n_token, (1, 20))
    got = generate(model, prompt, steps, temperature=0.0, mem_len=mem_len)[0, 20:].tolist()
    assert got == greedy_uncached(model, prompt, steps, mem_len)  # token for token
    # log-probs over 512 steps, fed varied tokens: the memory is full after 4 steps and then slides
    forced = torch.randint(0, n_token, (steps,)).tolist()
    expected = uncached_steps(model, prompt, forced, mem_len)
    cache = KVCache(model.config, 1, mem_len, 20)
    with torch.no_grad():
        h = model.transformer(prompt, cache=cache, mem_len=mem_len).last_hidden_state[:, -1]
        for i, tok in enumerate(forced):
            _, log_probs = model.crit(h, return_log_probs=True)
            # (rtol: the fp32 rounding of this sharp model (init_std 0.3) is itself ~1e-5: the uncached fp32 loop
            # is 1.8e-5 from a float64 one on the adaptive variant; test_native_step_is_as_exact_as_the_pytorch_path
            # checks against float64 that the cached step is at least as close to it)
            torch.testing.assert_close(log_probs[0], expected[i], atol=1e-5, rtol=1e-5, msg=f"step {i + 1}")
            h = model.transformer(torch.tensor([[tok]]), cache=cache, mem_len=mem_len).last_hidden_state[:, -1]
    assert cache.length == mem_len and cache.start > 0


@pytest.mark.parametrize("variant", ["plain", "same_length_clamp", "adaptive"])
def test_batched_prompts_of_different_lengths_equal_one_by_one(variant):
    model = lm(**VARIANTS[variant])
    lengths = [5, 13, 9, 1]
    prompts = [torch.randint(0, model.config.n_token, (1, n)) for n in lengths]
    longest = max(lengths)
    batch = torch.zeros(len(lengths), longest, dtype=torch.long)
    padding = torch.ones(len(lengths), longest, dtype=torch.bool)
    for row, p in enumerate(prompts):
        batch[row, longest - p.shape[1] :] = p
        padding[row, longest - p.shape[1] :] = False
    mem_len, steps = 10, 60
    together = generate(model, batch, steps, temperature=0.0, mem_len=mem_len, padding=padding)[:, longest:]
    for row, p in enumerate(prompts):
        alone = generate(model, p, steps, temperature=0.0, mem_len=mem_len)[0, p.shape[1] :]
        assert together[row].tolist() == alone.tolist(), f"row {row} (prompt of {lengths[row]})"
    # log-probs of the first new token, row by row
    cache = KVCache(model.config, len(lengths), mem_len, longest)
    with torch.no_grad():
        h = model.transformer(batch, cache=cache, mem_len=mem_len, padding=padding).last_hidden_state[:, -1]
        _, batched = model.crit(h, return_log_probs=True)
        for row, p in enumerate(prompts):
            _, alone = model.crit(model.transformer(p, mem_len=mem_len).last_hidden_state[:, -1], return_log_probs=True)
            torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="padding must be"):
        generate(model, batch, 2, padding=padding.flip(1))  # padding on the right is refused


def test_stop_tokens_end_rows_and_sampling_is_seeded():
    model = lm()
    prompt = torch.randint(0, 97, (3, 6))
    g = torch.Generator().manual_seed(5)
    free = generate(model, prompt, 40, temperature=1.0, generator=g)[:, 6:]
    stop = int(free[1, 3])  # a token that row 1 produces at step 4
    g = torch.Generator().manual_seed(5)
    steps = list(stream(model, prompt, 40, temperature=1.0, generator=g, stop_tokens=[stop], pad_id=0))
    out = torch.cat(steps, dim=1)
    for row in range(3):
        hits = (free[row] == stop).nonzero()
        first = int(hits[0]) if len(hits) else None
        upto = out.shape[1] if first is None else first + 1
        assert out[row, :upto].tolist() == free[row, :upto].tolist()  # the same sample until the stop token
        assert (out[row, upto:] == 0).all()  # then padding
    assert out.shape[1] <= 40 and (out.shape[1] == 40 or all((r == stop).any() for r in out))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = generate(model, prompt, 20, temperature=0.7, top_k=20, top_p=0.9, generator=g1)
    assert a.equal(generate(model, prompt, 20, temperature=0.7, top_k=20, top_p=0.9, generator=g2))


def test_model_generate_takes_hugging_face_arguments():
    """``model.generate`` as HF users call it: greedy by default, ``max_length`` counting the prompt,
    ``attention_mask`` for left padding, ``eos_token_id`` / ``pad_token_id``, ``do_sample`` with HF's top_k 50."""
    model = lm(**VARIANTS["same_length_clamp"])
    prompt = torch.randint(0, 97, (1, 9))
    out = model.generate(prompt, max_new_tokens=30)  # greedy, the config's mem_len (16): it slides
    assert out.shape == (1, 39) and out[0, :9].equal(prompt[0])
    assert out[0, 9:].tolist() == greedy_uncached(model, prompt, 30, model.config.mem_len)
    assert model.generate(prompt, max_length=25).equal(out[:, :25])  # max_length counts the prompt
    assert model.generate(prompt).shape == (1, 20)  # HF's default: max_length 20
    assert model.generate(prompt[0], max_new_tokens=3).equal(out[:, :12])  # a 1-D prompt is one row
    with pytest.raises(ValueError, match="max_length = 9 counts the prompt of 9 tokens"):
        model.generate(prompt, max_length=9)
    with pytest.raises(ValueError, match="not both"):
        model.generate(prompt, max_new_tokens=3, max_length=30)
    # eos ends a row, then pad_token_id fills it (HF's output layout)
    eos = int(out[0, 9 + 4])
    first = (out[0, 9:] == eos).nonzero()[0].item()
    stopped = model.generate(prompt, max_new_tokens=30, eos_token_id=[eos, 96], pad_token_id=0)
    assert stopped[0, : 9 + first + 1].equal(out[0, : 9 + first + 1]) and (stopped[0, 9 + first + 1 :] == 0).all()
    # attention_mask: 0 on the left padding; every row as if alone
    short = torch.randint(0, 97, (1, 4))
    batch = torch.cat([prompt, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    both = model.generate(batch, max_new_tokens=12, attention_mask=mask)
    assert both[0].equal(out[0, :21]) and both[1, 9:].equal(model.generate(short, max_new_tokens=12)[0, 4:])
    with pytest.raises(ValueError, match="pad prompts on the left"):
        model.generate(batch, max_new_tokens=2, attention_mask=mask.flip(1))
    # do_sample: seeded, and HF's defaults (temperature 1, top_k 50, top_p 1) as the txl options
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    sampled = model.generate(prompt, max_new_tokens=25, do_sample=True, generator=g1)
    assert sampled.equal(generate(model, prompt, 25, temperature=1.0, top_k=50, generator=g2))
    assert not sampled.equal(out[:, :34])
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    hot = model.generate(prompt, max_new_tokens=25, do_sample=True, temperature=0.6, top_k=0, top_p=0.8, generator=g1)
    assert hot.equal(generate(model, prompt, 25, temperature=0.6, top_p=0.8, generator=g2))


def test_model_generate_returns_several_samples_per_prompt():
    model = lm()
    prompts = torch.randint(0, 97, (2, 5))
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    out = model.generate(prompts, max_new_tokens=12, do_sample=True, num_return_sequences=3, generator=g1)
    assert out.shape == (6, 17) and out[:3, :5].eq(prompts[0]).all() and out[3:, :5].eq(prompts[1]).all()
    assert out.equal(generate(model, prompts.repeat_interleave(3, 0), 12, top_k=50, generator=g2))
    assert len({tuple(r) for r in out[:3, 5:].tolist()}) > 1  # different samples of one prompt
    with pytest.raises(ValueError, match="must be 1 for greedy decoding"):
        model.generate(prompts, max_new_tokens=2, num_return_sequences=2)


@pytest.mark.parametrize("variant", [*VARIANTS, "tf_same_length"])
@pytest.mark.parametrize("memory", [False, True], ids=["no_memory", "given_memory"])
def test_a_long_prompt_read_in_pieces_equals_one_pass(variant, memory):
    """txl.infer.prompt.read_prompt (a long prompt's [T, K] mask and scores are quadratic in its length): in pieces,
    every position's hidden state, the window the cache keeps and the next steps are those of one pass of the whole
    prompt, with left padding (a piece of only padding in one row), a starting memory, same_length's window and the TF
    code's one key more, a last piece of one position (the one-token step)."""
    overrides = {"same_length": True, "tf_same_length": True} if variant == "tf_same_length" else VARIANTS[variant]
    model = lm(**overrides, init_std=0.3)
    cfg, mem_len = model.config, 12
    lengths, T = [41, 27], 41
    batch = torch.randint(0, cfg.n_token, (2, T))
    padding = torch.arange(T)[None, :] < torch.tensor([T - n for n in lengths])[:, None]  # [2, T], True on the left
    mems = [torch.randn(2, 9, cfg.d_model) for _ in range(cfg.n_layer)]
    steps = torch.randint(0, cfg.n_token, (2, 6))
    real = ~padding
    with torch.no_grad():
        for chunk in (1, 7, 8, 40):  # (41 = 5 * 8 + 1: a last piece of one position; 1: every piece is one)
            one, pieces = KVCache(cfg, 2, mem_len, T), KVCache(cfg, 2, mem_len, chunk)
            if memory:
                model.transformer.fill_cache(one, mems, mem_len)
                model.transformer.fill_cache(pieces, mems, mem_len)
            whole = model.transformer(batch, cache=one, mem_len=mem_len, padding=padding).last_hidden_state
            got = read_prompt(model, batch, pieces, Reading(mem_len), padding, chunk=chunk)
            torch.testing.assert_close(got[real], whole[real], atol=1e-5, rtol=1e-5, msg=f"chunk {chunk}")
            assert pieces.length == one.length == mem_len
            for a, b in ((pieces.k, one.k), (pieces.v, one.v)):
                torch.testing.assert_close(a[..., pieces.start : pieces.end, :], b[..., one.start : one.end, :])
            for t in range(steps.shape[1]):  # (the generation after it: the window slides as after one pass)
                x = steps[:, t : t + 1]
                h1 = model.transformer(x, cache=one, mem_len=mem_len).last_hidden_state
                h2 = model.transformer(x, cache=pieces, mem_len=mem_len).last_hidden_state
                torch.testing.assert_close(h2, h1, atol=1e-5, rtol=1e-5, msg=f"chunk {chunk}, step {t + 1}")
    with pytest.raises(ValueError, match="at least one position"):
        read_prompt(model, batch, KVCache(cfg, 2, mem_len, T), Reading(mem_len), chunk=0)


def test_generation_after_a_prompt_longer_than_one_pass_equals_the_uncached_loop():
    """A prompt longer than PROMPT_CHUNK is read in pieces by stream, beam search and the server's engine: greedy
    tokens as the uncached loop, which reads the prompt in one pass, gives them."""
    from txl.infer.generation import beam_search
    from txl.infer.prompt import PROMPT_CHUNK
    from txl.serve.engine import Engine, Generation

    model = lm(**VARIANTS["plain"], init_std=0.3)
    T, mem_len, steps = PROMPT_CHUNK + 77, 16, 12
    prompt = torch.randint(0, model.config.n_token, (1, T))
    expected = greedy_uncached(model, prompt, steps, mem_len)
    assert generate(model, prompt, steps, temperature=0.0, mem_len=mem_len)[0, T:].tolist() == expected
    assert beam_search(model, prompt, 1, num_beams=2, mem_len=mem_len)[0, T:].tolist() == expected[:1]
    got, done = [], threading.Semaphore(0)
    engine = Engine(model, max_batch=2)
    engine.submit(Generation(prompt[0].tolist(), steps, lambda t: done.release() if t is None else got.append(t),
                             mem_len=mem_len, temperature=0.0))  # fmt: skip
    assert done.acquire(timeout=60)
    engine.shutdown()
    assert got == expected


@pytest.mark.parametrize("variant", ["plain", "pre_lnorm_untie_r", "adaptive"])
def test_generation_from_a_given_memory_equals_the_uncached_loop(variant):
    """``mems`` (layer inputs, e.g. HF's zero memory) start the cached generation: its keys and values are computed
    once (pre-LN: from the normed memory) and slide out as the uncached loop's memory does."""
    model = lm(**VARIANTS[variant], init_std=0.3)
    cfg = model.config
    prompt = torch.randint(0, cfg.n_token, (1, 6))
    for mems in ([torch.randn(1, 10, cfg.d_model) for _ in range(cfg.n_layer)], [torch.zeros(1, 16, cfg.d_model)] * 2):
        got = generate(model, prompt, 40, temperature=0.0, mem_len=16, mems=mems)[0, 6:].tolist()
        assert got == greedy_uncached(model, prompt, 40, 16, mems)
        assert got != greedy_uncached(model, prompt, 40, 16)  # (the memory matters)
    cache = KVCache(cfg, 1, 16)
    model.transformer.fill_cache(cache, mems, 16)
    with pytest.raises(ValueError, match="already holds a memory"):
        model.transformer.fill_cache(cache, mems, 16)
    with pytest.raises(ValueError, match=r"mems must be 2 tensors of shape \[batch=1"):
        generate(model, prompt, 3, mems=[torch.zeros(1, 4, cfg.d_model + 1)] * 2)


def hf_and_converted(tmp_path, monkeypatch):
    """For each sharp fixture: HF 4.46's model of it (the benchmarks' HF, with the one-expression #29650 fix), the
    folder `txl convert hf` made of it, and txl's model from that folder."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.conftest import CHAR_FIXTURE, ROOT
    from txl.cli import main

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from model_speed import patched_hf

    transformers.logging.set_verbosity_error()
    for fixture in (CHAR_FIXTURE, ADAPTIVE_FIXTURE):
        with warnings.catch_warnings():  # (HF's notes on its deprecated model)
            warnings.simplefilter("ignore")
            hf = patched_hf().TransfoXLLMHeadModel(transformers.TransfoXLConfig.from_pretrained(fixture)).eval()
        hf.load_state_dict(load_file(fixture / "model.safetensors"), strict=False)
        out = tmp_path / fixture.name
        main(["convert", "hf", str(fixture), str(out)])
        yield hf, out, TransformerXLLM.from_pretrained(out)


def test_generation_equals_hugging_face_generate_from_its_zero_memory(tmp_path, capsys, monkeypatch):
    """HF 4.46's greedy ``generate()`` of a converted checkpoint (the sharp fixtures, through `txl convert hf`),
    token for token: HF starts from mem_len zero vectors, which ``mems`` gives txl; from the empty memory (txl's
    default) the tokens differ."""
    from txl.cli import main

    for hf, out, ours in hf_and_converted(tmp_path, monkeypatch):
        cfg = ours.config
        prompt = torch.randint(0, cfg.n_token, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = hf.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0)
        zeros = [torch.zeros(2, cfg.mem_len, cfg.d_model)] * cfg.n_layer
        assert ours.generate(prompt, max_new_tokens=60, mems=zeros).equal(theirs), out.name
        assert not ours.generate(prompt, max_new_tokens=60).equal(theirs)
        # the CLI: txl generate --zero_memory true
        args = ["generate", "--model", str(out), "--prompt_ids", ",".join(map(str, prompt[0].tolist()))]
        capsys.readouterr()
        main([*args, "--max_new_tokens", "60", "--temperature", "0", "--zero_memory", "true", "--json"])
        assert json.loads(capsys.readouterr().out)["new_ids"] == theirs[0, 7:].tolist()


def test_repetition_penalty_and_no_repeat_ngrams_equal_hugging_faces(tmp_path, capsys, monkeypatch):
    """HF's repetition_penalty and no_repeat_ngram_size: the converted sharp fixtures generate HF 4.46's greedy
    tokens with each and both (from HF's zero memory), through `model.generate` and `txl generate`; each changes the
    text, no 3-gram repeats under no_repeat_ngram_size 3, and a left-padded row generates what it does alone (its
    padding is not part of its history)."""
    from txl.cli import main

    for hf, out, ours in hf_and_converted(tmp_path, monkeypatch):
        cfg = ours.config
        prompt = torch.randint(0, cfg.n_token, (2, 7), generator=torch.Generator().manual_seed(1))
        prompt[1, :3] = 0  # (row 1 read as a left-padded prompt of 4 tokens below)
        zeros = [torch.zeros(2, cfg.mem_len, cfg.d_model)] * cfg.n_layer
        plain = ours.generate(prompt, max_new_tokens=40, mems=zeros)
        for kw in ({"repetition_penalty": 1.5}, {"no_repeat_ngram_size": 3}, {"repetition_penalty": 1.3,
                   "no_repeat_ngram_size": 2}):  # fmt: skip
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = hf.generate(
                    prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0, **kw
                )  # fmt: skip
            got = ours.generate(prompt, max_new_tokens=40, mems=zeros, **kw)
            assert got.equal(theirs), (out.name, kw)
            assert not got.equal(plain), kw
            if kw.get("no_repeat_ngram_size") == 3:
                for row in got.tolist():
                    grams = list(zip(row, row[1:], row[2:], strict=False))
                    assert len(grams) == len(set(grams))
            mask = torch.ones(2, 7, dtype=torch.long)
            mask[1, :3] = 0
            padded = ours.generate(prompt, attention_mask=mask, max_new_tokens=30, **kw)
            alone = ours.generate(prompt[1:, 3:], max_new_tokens=30, **kw)
            assert padded[1, 7:].equal(alone[0, 4:]), kw
        ids = ",".join(map(str, prompt[0].tolist()))
        args = ["generate", "--model", str(out), "--prompt_ids", ids, "--max_new_tokens", "40", "--temperature", "0"]
        capsys.readouterr()
        main([*args, "--zero_memory", "true", "--repetition_penalty", "1.3", "--no_repeat_ngram_size", "2", "--json"])
        assert json.loads(capsys.readouterr().out)["new_ids"] == theirs[0, 7:].tolist()


def test_min_new_tokens_equals_hugging_faces_and_other_options_are_named(tmp_path, monkeypatch):
    """min_new_tokens / min_length (counting the prompt) keep the end-of-text token out until then, as HF's
    generate() (token for token on the converted fixtures, the eos id chosen so that greedy decoding would stop at
    once); HF's options that change nothing are accepted, the others refused by name."""
    for hf, out, ours in hf_and_converted(tmp_path, monkeypatch):
        cfg = ours.config
        prompt = torch.randint(0, cfg.n_token, (1, 6), generator=torch.Generator().manual_seed(2))
        zeros = [torch.zeros(1, cfg.mem_len, cfg.d_model)] * cfg.n_layer
        eos = int(ours.generate(prompt, max_new_tokens=1, mems=zeros)[0, -1])  # (the greedy first token)
        assert ours.generate(prompt, max_new_tokens=20, mems=zeros, eos_token_id=eos).shape[1] == 7  # stops at once
        for kw in ({"min_new_tokens": 8}, {"min_length": 6 + 5}):
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = hf.generate(
                    prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos, **kw
                )
            got = ours.generate(prompt, max_new_tokens=20, mems=zeros, eos_token_id=eos, **kw)
            assert got.equal(theirs) and got.shape[1] > 7 + 3, (out.name, kw)
    model = TransformerXLLM(debug_config(mem_len=8)).eval()
    x = torch.tensor([[1, 2, 3]])
    same = model.generate(x, max_new_tokens=5, use_cache=True, num_beams=1, output_scores=False)
    assert same.equal(model.generate(x, max_new_tokens=5))
    with pytest.raises(ValueError, match="num_beam_groups = 2: group \\(diverse\\) beam search is not implemented"):
        model.generate(x, max_new_tokens=5, num_beams=4, num_beam_groups=2)
    with pytest.raises(ValueError, match="typical_p = 0.5: not supported by txl"):
        model.generate(x, max_new_tokens=5, typical_p=0.5)
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\): max_tokens"):
        model.generate(x, max_tokens=5)


def test_beam_search_equals_hugging_faces(tmp_path, capsys, monkeypatch):
    """num_beams > 1: HF 4.46's beam search token for token on both converted fixtures (several beams, several
    sequences returned, an eos id that ends hypotheses, length_penalty with early_stopping, penalties), from HF's zero
    memory, through `model.generate` and `txl generate --num_beams`; a left-padded prompt searches as it does alone;
    beam sampling is refused by name."""
    from txl.cli import main

    for hf, out, ours in hf_and_converted(tmp_path, monkeypatch):
        cfg = ours.config
        prompt = torch.randint(0, cfg.n_token, (2, 6), generator=torch.Generator().manual_seed(4))
        zeros = [torch.zeros(2, cfg.mem_len, cfg.d_model)] * cfg.n_layer
        eos = int(ours.generate(prompt, max_new_tokens=4, mems=zeros)[0, -1])  # (a token the search meets)
        greedy = ours.generate(prompt, max_new_tokens=12, mems=zeros)
        cases = [
            {"num_beams": 3},
            {"num_beams": 4, "num_return_sequences": 2},
            {"num_beams": 3, "eos_token_id": eos},
            {"num_beams": 3, "eos_token_id": eos, "length_penalty": 0.5, "early_stopping": True},
            {"num_beams": 3, "repetition_penalty": 1.4, "no_repeat_ngram_size": 2},
        ]
        for kw in cases:
            kw = {"eos_token_id": None, "pad_token_id": 0} | kw
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, **kw)
            got = ours.generate(prompt, max_new_tokens=12, mems=zeros, **kw)
            assert got.shape == theirs.shape and got.equal(theirs), (out.name, kw)
        assert not ours.generate(prompt, max_new_tokens=12, mems=zeros, num_beams=3).equal(greedy)
        ids = ",".join(map(str, prompt[0].tolist()))
        capsys.readouterr()
        main(["generate", "--model", str(out), "--prompt_ids", ids, "--max_new_tokens", "12", "--temperature", "0",
              "--num_beams", "3", "--zero_memory", "true", "--json"])  # fmt: skip
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = hf.generate(prompt[:1], max_new_tokens=12, do_sample=False, num_beams=3, eos_token_id=None)
        assert json.loads(capsys.readouterr().out)["new_ids"] == theirs[0, 6:].tolist()
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, :2] = 0
        padded = ours.generate(prompt, attention_mask=mask, max_new_tokens=10, num_beams=3, repetition_penalty=1.3)
        alone = ours.generate(prompt[1:, 2:], max_new_tokens=10, num_beams=3, repetition_penalty=1.3)
        assert padded[1, 6:].equal(alone[0, 4:])
        assert ours.generate(prompt, max_new_tokens=0, num_beams=3).equal(prompt)  # (nothing to search)
        with pytest.raises(ValueError, match="beam sampling\\) is not implemented"):
            ours.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=True)


def test_beam_steps_is_beam_search_one_call_at_a_time():
    """txl.infer.generation.beam_steps yields once per model call (the prompt's, then one per new token) and returns
    beam_search's result; between steps the caller's gradient mode holds; closing it early restores training mode.
    The prompt's pass runs once per prompt (its beams start from copies of its cache), not once per beam."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM
    from txl.infer.generation import beam_search, beam_steps

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config())
    prompt = torch.randint(0, model.config.n_token, (2, 5), generator=torch.Generator().manual_seed(1))
    steps, n = beam_steps(model, prompt, 9, num_beams=3, mem_len=8), 0
    while True:
        try:
            next(steps)
        except StopIteration as end:
            got = end.value
            break
        n += 1
        assert torch.is_grad_enabled() and not model.training  # (eval mode until it ends)
    assert n == 9 and model.training
    rows = []
    hook = model.transformer.register_forward_hook(lambda mod, args, out: rows.append(tuple(args[0].shape)))
    assert got.equal(beam_search(model, prompt, 9, num_beams=3, mem_len=8))
    hook.remove()
    assert rows == [(2, 5)] + [(6, 1)] * 8  # (the prompts once, then 3 beams of each: 6 rows of one token)
    steps = beam_steps(model, prompt, 9, num_beams=3, mem_len=8)
    next(steps), next(steps)
    steps.close()
    assert model.training


def test_penalties_by_hand():
    """OpenAI's presence and frequency penalties count the new text only; HF's repetition penalty and n-gram ban
    read the whole sequence; logit_bias adds."""
    from txl.infer.generation import Penalties

    scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0, 0.5]])
    history = torch.tensor([[1, 2, 3, 1, 2, 2]])  # the prompt is [1, 2, 3], the new text [1, 2, 2]
    got = Penalties(presence_penalty=0.5, frequency_penalty=0.25).apply(scores, history, 3)
    assert got.tolist() == [[-1.0, -2.0 - 0.5 - 0.25, -3.0 - 0.5 - 0.5, -4.0, 0.5]]
    got = Penalties(repetition_penalty=2.0).apply(scores, history, 3)
    assert got.tolist() == [[-1.0, -4.0, -6.0, -8.0, 0.5]]
    got = Penalties(no_repeat_ngram_size=2).apply(scores, history, 3)  # after ...2: (2, 3) and (2, 2) are taken
    assert got.tolist() == [[-1.0, -2.0, float("-inf"), float("-inf"), 0.5]]
    got = Penalties(logit_bias=((4, -1.5), (0, 2.0))).apply(scores, history, 3)
    assert got.tolist() == [[1.0, -2.0, -3.0, -4.0, -1.0]]
    with pytest.raises(ValueError, match="repetition_penalty = 0: must be > 0"):
        Penalties(repetition_penalty=0)
    assert not Penalties(eos_token_ids=(1,)).any and Penalties(eos_token_ids=(1,), min_new_tokens=2).any


def test_eval_equals_hugging_faces_evaluation_from_its_zero_memory(tmp_path, capsys, monkeypatch):
    """`txl eval --zero_memory true` of a converted checkpoint (the sharp fixtures) gives the loss of HF 4.46's own
    evaluation loop (its memory starting as mem_len zero vectors, carried segment by segment); the K/V-cached and
    the uncached evaluation agree on it; from txl's default empty memory the loss differs."""
    from txl.cli import main
    from txl.data import Tokenizer

    for hf, out, ours in hf_and_converted(tmp_path, monkeypatch):
        cfg = ours.config
        # a word tokenizer whose symbol i is id i, so that a text of symbols is exactly the ids it names
        (tmp_path / "vocab.txt").write_text("\n".join(["<UNK>"] + [f"w{i}" for i in range(1, cfg.n_token)]) + "\n")
        Tokenizer.from_vocab_file(tmp_path / "vocab.txt", line_end="none").save(out)
        ids = torch.randint(1, cfg.n_token, (61,), generator=torch.Generator().manual_seed(3))
        (tmp_path / "text.txt").write_text(" ".join(f"w{i}" for i in ids.tolist()))
        nll, mems = 0.0, None
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(0, len(ids) - 1, 8):  # HF's loop: segments of 8, the memory carried
                inp, tgt = ids[i : i + 8][None], ids[i + 1 : i + 9]
                res = hf(input_ids=inp[:, : len(tgt)], mems=mems)
                nll -= float(res.prediction_scores[0].gather(-1, tgt[:, None]).double().sum())
                mems = res.mems
        same = str(cfg.same_length).lower()  # (HF's loop reads with the model's same_length)
        args = ["eval", "--model", str(out), "--data", str(tmp_path / "text.txt"), "--tgt_len", "8"]
        args += ["--same_length", same]
        capsys.readouterr()
        main([*args, "--batch_size", "1", "--json", "--zero_memory", "true"])
        got = json.loads(capsys.readouterr().out)
        assert got["tokens"] == 60 and got["zero_memory"] and got["mem_len"] == cfg.mem_len
        assert got["loss"] == pytest.approx(nll / 60, rel=1e-5, abs=1e-6), out.name
        main([*args, "--batch_size", "1", "--json"])
        assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(nll / 60, rel=1e-4)
        kw = dict(batch_size=2, tgt_len=8, mem_len=cfg.mem_len, zero_memory=True)
        cached, uncached = evaluate(ours, ids.numpy(), **kw), evaluate(ours, ids.numpy(), cache=False, **kw)
        assert cached.loss == pytest.approx(uncached.loss, rel=1e-6) and cached.tokens == 58  # (2 columns of 30)


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17])
def test_one_row_products_equal_f_linear(rows):
    weight, bias = torch.randn(96, 32), torch.randn(96)
    x = torch.randn(rows, 1, 32)
    with torch.no_grad(), modeling.transposed_weights():
        copies = weight_copies()  # (the scope's: made for a few rows, kept for the next call of the scope)
        got = modeling.linear(x, weight, bias)
        sliced = modeling.linear(x, weight, bias, out=slice(32, None))
        wide_in, narrow_x = weight.t().contiguous(), torch.randn(rows, 96)
        narrow = modeling.linear(narrow_x, wide_in)  # fewer outputs than inputs: F.linear, no copy
        assert (id(wide_in), "t") not in copies
        assert ((id(weight), "t") in copies) == (rows <= modeling.SMALL_ROWS)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(sliced, F.linear(x, weight[32:], bias[32:]), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(narrow, F.linear(narrow_x, wide_in), atol=1e-5, rtol=1e-6)
    assert len(copies) == 0 and weight_copies() is None  # dropped with the scope
    with torch.no_grad():  # outside a scope (training, evaluation): F.linear, no copy
        modeling.linear(x, weight, bias)
    assert len(copies) == 0 and weight_copies() is None


def test_generation_follows_weights_changed_in_place():
    """The transposed copies of the weights are remade when the weights change (fine-tuning, then generating)."""
    model = lm()
    prompt = torch.randint(0, model.config.n_token, (1, 6))
    generate(model, prompt, 4, temperature=0.0, mem_len=16)  # makes the copies
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    changed = generate(model, prompt, 24, temperature=0.0, mem_len=16)[0, 6:].tolist()
    assert changed == greedy_uncached(model, prompt, 24, 16)
    fresh = lm()
    fresh.load_state_dict(model.state_dict())
    assert changed == generate(fresh, prompt, 24, temperature=0.0, mem_len=16)[0, 6:].tolist()


def test_generation_steps_leave_the_onednn_route_and_restore_it():
    """One-token steps run on torch's default fp32 path (the oneDNN route of txl.kernels.runtime is ~3x slower for
    them);
    the caller's setting is back afterwards, also while the stream is suspended between tokens."""
    from txl.kernels.runtime import fp32_route

    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    seen = []
    model = lm()
    original = model.transformer.forward

    def spy(ids, *args, **kwargs):
        seen.append((ids.shape[1], setting.fp32_precision))
        return original(ids, *args, **kwargs)

    try:
        setting.fp32_precision = "bf16"
        model.transformer.forward = spy
        steps = stream(model, torch.randint(0, 97, (1, 5)), 3, temperature=0.0)
        next(steps)
        assert setting.fp32_precision == "bf16"  # between tokens: the caller's route
        list(steps)
        with fp32_route(False):
            assert setting.fp32_precision == "ieee"
        assert setting.fp32_precision == "bf16"
    finally:
        setting.fp32_precision = before
    assert seen == [(5, "bf16"), (1, "ieee"), (1, "ieee")]  # the prompt keeps the route, single tokens do not


def test_generation_reads_transposed_copies_only_while_it_runs():
    model = lm()
    steps = stream(model, torch.randint(0, model.config.n_token, (1, 5)), 4, temperature=0.0)
    next(steps)
    next(steps)
    qkv = model.transformer.layers[0].attn.qkv_net.weight
    copies = weight_copies()  # (the stream's scope, open in this thread while it runs)
    assert (id(qkv), "t") in copies  # made by the first generated token
    list(steps)
    assert len(copies) == 0 and weight_copies() is None  # dropped when the stream ends: training never reads one


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3, modeling.SMALL_ROWS + 1])
@pytest.mark.parametrize("scope", [True, False], ids=["transposed", "plain"])
def test_one_token_steps_equal_the_layers_path(variant, rows, scope, monkeypatch):
    """A cached one-token step runs the model's step (txl.kernels.decode), one loop over the layers' weights; it
    computes what the layers' own path computes (fast_decode off), step after step over a sliding memory, with left
    padding in the batch, and it reads weights changed in place; asked for the hidden states (every other step), it
    gives each layer's output as the layers do."""
    model = lm(**VARIANTS[variant], mem_len=10)
    n = model.config.n_token
    prompt = torch.randint(0, n, (rows, 7))
    padding = torch.zeros(rows, 7, dtype=torch.bool)
    padding[0, :3] = True  # the first row's prompt is shorter
    ids = torch.randint(0, n, (rows, 20))
    caches = {fast: KVCache(model.config, rows, 10, max_segment=7) for fast in (True, False)}
    decode = kernels_decode._step
    with torch.no_grad(), modeling.transposed_weights() if scope else contextlib.nullcontext():
        for t in range(-1, ids.shape[1]):
            if t == 12:  # weights changed in place between two steps
                for p in model.parameters():
                    p.mul_(1.1)
            out, hidden = {}, {}
            for fast, cache in caches.items():
                set_backends(fast_decode=fast)
                called = []
                monkeypatch.setattr(kernels_decode, "_step", spy(decode, called))
                if t < 0:
                    out[fast] = model(prompt, cache=cache, padding=padding, return_log_probs=True).log_probs
                else:
                    step = model(ids[:, t : t + 1], cache=cache, return_log_probs=True, output_hidden_states=t % 2 == 1)
                    out[fast], hidden[fast] = step.log_probs[:, -1], step.hidden_states
                    # the fast path ran exactly when it is on (twice at its first use in this process: checked
                    # against the reference, then run; which test of a worker comes first decides where)
                    assert called == [True] * fast or (fast and called == [True, True] and t == 0), (t, called)
            torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)
            if t >= 0 and t % 2 == 1:
                assert len(hidden[True]) == len(hidden[False]) == model.config.n_layer + 1
                torch.testing.assert_close(hidden[True], hidden[False], atol=1e-5, rtol=1e-5)
    assert caches[True].start > 0  # the window slid
    for a, b in ((caches[True].k, caches[False].k), (caches[True].v, caches[False].v)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def spy(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(True)
        return fn(*args, **kwargs)

    return wrapped


def test_one_token_steps_read_the_weights_of_the_model_that_runs_them(monkeypatch):
    """The weights a cache's one-token steps read are looked up once per cache, for the model that runs the step:
    another model stepping on the same cache uses its own."""
    a, b = lm(), lm()
    prompt, tok = torch.randint(0, 97, (2, 6)), torch.randint(0, 97, (2, 1))
    out = {}
    for fast in (True, False):
        set_backends(fast_decode=fast)
        cache = KVCache(a.config, 2, 16, max_segment=6)
        with torch.no_grad():
            a(prompt, cache=cache)
            a(tok, cache=cache)
            out[fast] = b(tok, cache=cache, return_log_probs=True).log_probs
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)


def _replace_linear(m):
    old = m.transformer.layers[0].attn.qkv_net
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    new.weight.copy_(old.weight * 2)
    m.transformer.layers[0].attn.qkv_net = new


def _replace_parameter(m):
    ff = m.transformer.layers[1].ff.layer_1
    ff.weight = torch.nn.Parameter(ff.weight * 1.5)


def _remove_bias(m):
    m.transformer.layers[1].ff.layer_2.register_parameter("bias", None)


@pytest.mark.parametrize("change", [_replace_linear, _replace_parameter, _remove_bias])
def test_a_module_or_weight_replaced_between_two_steps_is_read(change):
    """A module or a parameter replaced between two one-token steps on one cache (after the native step's plan was
    made): the next step computes what the changed model's layers compute (the plan is remade)."""
    base = lm(n_layer=2)
    prompt, tok = torch.randint(0, 97, (2, 6)), torch.randint(0, 97, (2, 1))
    out = {}
    for fast in (True, False):
        set_backends(fast_decode=fast)
        m = copy.deepcopy(base)
        cache = KVCache(m.config, 2, 16, max_segment=6)
        with torch.no_grad():
            m(prompt, cache=cache)
            for _ in range(3):
                m(tok, cache=cache)
            change(m)
            out[fast] = m(tok, cache=cache, return_log_probs=True).log_probs
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)


def test_sampling_during_training_leaves_the_model_training():
    """A model sampled from (or mapped) in the middle of training goes on training with its dropout: generation and
    attention maps run in eval mode and give the mode back, also when the stream is left early."""
    from txl.infer.attention_maps import attention_maps

    model = TransformerXLLM(debug_config(dropout=0.5, dropatt=0.5))  # training mode, heavy dropout
    prompt = torch.randint(0, 97, (1, 6))
    evaluated = generate(model.eval(), prompt, 20, temperature=0.0)
    model.train()
    assert generate(model, prompt, 20, temperature=0.0).equal(evaluated) and model.training  # (no dropout inside)
    assert model.generate(prompt, max_new_tokens=5).shape == (1, 11) and model.training
    steps = stream(model, prompt, 20, temperature=0.0)
    next(steps)
    assert not model.training  # while the stream runs
    steps.close()
    assert model.training
    attention_maps(model, np.arange(30) % 97, tgt_len=10, mem_len=10)
    assert model.training


def test_head_mask_silences_heads_as_hugging_face_does(tmp_path, monkeypatch):
    """``head_mask`` ([n_head] or [n_layer, n_head], Hugging Face's): HF 4.46's log-probabilities with the same mask,
    from its zero memory, on converted checkpoints (through the explicit attention: the fused paths decline a mask); a
    head of 0 gets no weights; all ones changes nothing."""
    for hf, _, ours in hf_and_converted(tmp_path, monkeypatch):
        cfg = ours.config
        torch.manual_seed(0)
        x = torch.randint(0, cfg.n_token, (2, 9))
        zeros = [torch.zeros(2, cfg.mem_len, cfg.d_model)] * cfg.n_layer
        masks = [
            torch.ones(cfg.n_layer, cfg.n_head),
            torch.rand(cfg.n_head).round(),
            torch.rand(cfg.n_layer, cfg.n_head),
        ]
        masks[0][0, 1] = 0.0
        with torch.no_grad():
            for hm in masks:
                theirs = hf(x, head_mask=hm).prediction_scores  # [B, T, V], log-probabilities
                out = ours(x, mems=zeros, head_mask=hm, return_log_probs=True, output_attentions=True)
                torch.testing.assert_close(out.log_probs, theirs, rtol=1e-5, atol=1e-5)
            silenced = ours(x, head_mask=masks[0], output_attentions=True).attentions
            assert silenced[0][:, 1].abs().max() == 0 and silenced[0][:, 0].abs().max() > 0
            plain, ones = ours(x, x), ours(x, x, head_mask=torch.ones(cfg.n_head))
            torch.testing.assert_close(ones.losses, plain.losses)
        with pytest.raises(ValueError, match="head_mask must be"):
            ours(x, head_mask=torch.ones(cfg.n_head + 1))


@pytest.mark.parametrize("key", sorted(HF_FIXTURES))
def test_inputs_embeds_and_head_mask_on_the_base_model_as_hugging_face(tmp_path, monkeypatch, key):
    """The base model (no softmax head), fed vectors (``inputs_embeds``, as an agent's observations) with a
    ``head_mask``: HF 4.46's TransfoXLModel's last hidden state, hidden states and memories, from its zero memory,
    over two segments, on every parity fixture (converted by `txl convert hf`)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.conftest import ROOT
    from txl.cli import main

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from model_speed import patched_hf

    transformers.logging.set_verbosity_error()
    fixture = HF_FIXTURES[key]
    with warnings.catch_warnings():  # (HF's notes on its deprecated model)
        warnings.simplefilter("ignore")
        hf = patched_hf().TransfoXLModel(transformers.TransfoXLConfig.from_pretrained(fixture)).eval()
    state = load_file(fixture / "model.safetensors")
    loaded = hf.load_state_dict({k.removeprefix("transformer."): v for k, v in state.items()}, strict=False)
    assert not loaded.missing_keys  # (the softmax's weights are the unexpected ones)
    main(["convert", "hf", str(fixture), str(tmp_path / "txl")])
    ours = TransformerXLLM.from_pretrained(tmp_path / "txl").transformer.eval()
    cfg = ours.config
    torch.manual_seed(0)
    hm = torch.rand(cfg.n_layer, cfg.n_head)
    theirs_mems, ours_mems = None, [torch.zeros(2, cfg.mem_len, cfg.d_model)] * cfg.n_layer
    with torch.no_grad():
        for _ in range(2):
            e = torch.randn(2, 7, cfg.d_model)
            theirs = hf(inputs_embeds=e, mems=theirs_mems, head_mask=hm, output_hidden_states=True)
            out = ours(inputs_embeds=e, mems=ours_mems, head_mask=hm, output_hidden_states=True)
            torch.testing.assert_close(out.last_hidden_state, theirs.last_hidden_state, rtol=1e-5, atol=1e-5)
            for a, b in zip(out.hidden_states, theirs.hidden_states, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            for a, b in zip(out.mems, theirs.mems, strict=True):
                torch.testing.assert_close(a, b.transpose(0, 1), rtol=1e-5, atol=1e-5)
            theirs_mems, ours_mems = theirs.mems, out.mems


@pytest.mark.parametrize("rows", [[1, 0, 0, 2], [0, 1, 2, 3], [3, 3, 3, 3], [2, 0], [1, 1, 0, 2, 3, 3]])
def test_select_reorders_the_window_and_take_leaves_the_cache_as_it_was(rows):
    """KVCache.select keeps these rows in this order: the window's keys, values and padding are the gathered rows'
    (in place when the number of rows is kept, moving only the rows that change; new buffers otherwise). take()
    gives the same rows in a new cache and leaves its own unchanged, even for as many rows."""
    from tests.conftest import debug_config
    from txl.model.cache import KVCache

    cfg = debug_config()
    cache = KVCache(cfg, 4, 20, 8, positions=30)
    cache.k.normal_(), cache.v.normal_()
    cache.padding.random_(0, 2)
    cache.start, cache.end = 3, 17
    k, v, pad = cache.k.clone(), cache.v.clone(), cache.padding.clone()
    part = cache.take(rows)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and torch.equal(cache.padding, pad)
    for got in (part, cache.select(rows)):
        assert torch.equal(got.k[:, :, :, 3:17], k[:, rows, :, 3:17])
        assert torch.equal(got.v[:, :, :, 3:17], v[:, rows, :, 3:17])
        assert torch.equal(got.padding, pad[rows])
