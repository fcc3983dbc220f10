"""Config validation, initialisation, save/load round trips, the heads and basic generation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.conftest import debug_config
from txl import (
    CheckpointError,
    TransformerXL,
    TransformerXLConfig,
    TransformerXLForSequenceClassification,
    TransformerXLLM,
)
from txl.infer.generation import filter_logits, generate


@pytest.mark.parametrize(
    "field, value",
    [
        ("n_layer", 0),
        ("d_model", -4),
        ("n_head", 1.5),
        ("cutoffs", [50, 20]),
        ("cutoffs", [0, 20]),
        ("cutoffs", [20, 97]),
        ("tie_projs", [False]),
        ("dropout", 1.0),
        ("dropatt", -0.1),
        ("mem_len", -1),
        ("init", "xavier"),
        ("init_std", 0.0),
        ("div_val", 0),
    ],
)
def test_config_validation_names_the_field(field, value):
    extra = {"cutoffs": [20, 50]} if field == "tie_projs" else {}
    with pytest.raises(ValueError, match=rf"TransformerXLConfig\.{field} = "):
        debug_config(**{field: value, **extra})


def test_odd_d_model_needs_a_learned_position_table():
    """The sinusoid R (attn_type 0, 2) has a sin and a cos half: an odd d_model is refused at the config, not deep in
    the forward (where the reference fails); attn_type 1 and 3 learn their positions and build and train with it."""
    for attn_type in (0, 2):
        with pytest.raises(ValueError, match=rf"d_model = 33: must be even for attn_type {attn_type}"):
            debug_config(d_model=33, n_head=3, d_head=11, attn_type=attn_type)
    x = torch.randint(0, 84, (2, 9))
    for attn_type in (1, 3):
        model = TransformerXLLM(debug_config(d_model=33, n_head=3, d_head=11, attn_type=attn_type, max_klen=24))
        out = model(x[:, :8], x[:, 1:])
        out.loss.backward()
        assert model(x[:, :8], x[:, 1:], mems=out.mems).loss.isfinite()


def test_config_defaults_and_round_trip():
    cfg = debug_config(cutoffs=[20, 50], d_embed=None)
    assert cfg.d_embed == cfg.d_model and cfg.tie_projs == [False, True, True]
    assert TransformerXLConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown TransformerXLConfig field.*bogus"):
        TransformerXLConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="same_length"):
        debug_config(same_length=True, mem_len=0)


def test_initialisation_follows_the_reference():
    cfg = debug_config(n_token=3000, d_model=64, d_inner=256, cutoffs=[500, 1500], div_val=2, d_embed=64)
    cfg.init_std, cfg.proj_init_std = 0.02, 0.01
    model = TransformerXLLM(cfg)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    layer = model.transformer.layers[0]
    assert abs(layer.attn.qkv_net.weight.std().item() - 0.02) < 0.002
    assert abs(layer.attn.layer_norm.weight.mean().item() - 1.0) < 0.01
    assert 0.01 < layer.attn.layer_norm.weight.std().item() < 0.03  # N(1, init_std), not constant 1
    assert layer.ff.layer_1.bias.abs().max() == 0 and model.crit.cluster_bias.abs().max() == 0
    assert abs(model.transformer.word_emb.emb_projs[0].std().item() - 0.01) < 0.002
    assert abs(model.crit.out_projs[0].std().item() - 0.01) < 0.002
    assert abs(model.transformer.r_w_bias.std().item() - 0.02) < 0.01
    uniform = TransformerXLLM(debug_config(init="uniform", init_range=0.05))
    assert uniform.transformer.layers[0].ff.layer_1.weight.abs().max() <= 0.05
    torch.manual_seed(1)
    a = TransformerXLLM(debug_config()).state_dict()
    torch.manual_seed(1)
    b = TransformerXLLM(debug_config()).state_dict()
    assert all(a[k].equal(b[k]) for k in a)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"cutoffs": [20, 50], "div_val": 2, "d_embed": 32},
        {"cutoffs": [20, 50], "d_embed": 32},
        {"untie_r": True},
    ],
    ids=["plain", "div_val2", "one_table_proj", "untie_r"],
)
def test_save_load_round_trip(tmp_path, overrides):
    model = TransformerXLLM(debug_config(**overrides)).eval()
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "crit.out_layers.0.weight" not in keys  # tied tensors are stored once
    assert "transformer.word_emb.emb_layers.0.weight" in keys
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format"] == "txl" and config["architecture"] == "TransformerXLLM"
    loaded = TransformerXLLM.from_pretrained(tmp_path)
    assert not loaded.training
    emb, crit = loaded.transformer.word_emb, loaded.crit
    assert all(o.weight is e.weight for o, e in zip(crit.out_layers, emb.emb_layers, strict=True))
    for i, tie in enumerate(loaded.config.tie_projs):
        if len(crit.out_projs):
            assert (crit.out_projs[i] is emb.emb_projs[0 if loaded.config.div_val == 1 else i]) == tie
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        a, b = model(ids, ids, return_log_probs=True), loaded(ids, ids, return_log_probs=True)
    assert a.log_probs.equal(b.log_probs) and a.losses.equal(b.losses)
    # a tie survives training: one update moves both names
    loaded.train()
    loaded(ids, ids).loss.backward()
    with torch.no_grad():
        for p in loaded.parameters():
            p -= 0.1 * p.grad
    assert loaded.crit.out_layers[0].weight.equal(loaded.transformer.word_emb.emb_layers[0].weight)


def test_load_errors(tmp_path):
    TransformerXLLM(debug_config()).save_pretrained(tmp_path / "ok")
    with pytest.raises(CheckpointError, match="not found"):
        TransformerXLLM.from_pretrained(tmp_path / "nothing")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{\n  "format": "txl",\n  oops\n}')
    with pytest.raises(CheckpointError, match=r"config.json:3: invalid JSON"):
        TransformerXLLM.from_pretrained(bad)
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "n_layer": 3}))
    (bad / "model.safetensors").write_bytes((tmp_path / "ok" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"config.json: n_layer = 3, but .*model.safetensors holds 2 layers"):
        TransformerXLLM.from_pretrained(bad)  # (from the file's header, before the model is built)
    (bad / "config.json").write_text(json.dumps({**cfg, "d_inner": 40}))
    with pytest.raises(CheckpointError, match=r"config.json: d_inner = 40, but .*model.safetensors holds 32 in its"):
        TransformerXLLM.from_pretrained(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "d_head": 4, "n_head": 2 * cfg["n_head"]}))
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: .*r_w_bias: file"):
        TransformerXLLM.from_pretrained(bad)  # (every other shape: from the model built on the meta device)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        TransformerXLLM.from_pretrained(bad)


def test_base_model_and_classifier_round_trip(tmp_path):
    base = TransformerXL(debug_config()).eval()
    base.save_pretrained(tmp_path / "base")
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        assert base(ids).last_hidden_state.equal(
            TransformerXL.from_pretrained(tmp_path / "base")(ids).last_hidden_state
        )
    cls = TransformerXLForSequenceClassification(debug_config(num_labels=3, pad_token_id=0)).eval()
    cls.save_pretrained(tmp_path / "cls")
    with torch.no_grad():
        assert cls(ids).logits.equal(
            TransformerXLForSequenceClassification.from_pretrained(tmp_path / "cls")(ids).logits
        )


@pytest.mark.parametrize("mmap", [False, True])
def test_another_architecture_s_checkpoint_loads_its_body(tmp_path, mmap):
    """As Hugging Face's from_pretrained: the base model from a language model's checkpoint (its body; the head is
    left out), a classifier from a language model or base model (its body, the classification head initialised
    anew with a warning); a language model from a checkpoint without its head is one error saying what to load."""
    import warnings

    from txl import CheckpointError

    cfg = debug_config(n_token=120, cutoffs=[30, 80], div_val=2, init_std=0.3)  # (tied embedding and projections)
    lm = TransformerXLLM(cfg).eval()
    lm.save_pretrained(tmp_path / "lm")
    TransformerXL(cfg).save_pretrained(tmp_path / "base")
    ids = torch.randint(0, 120, (2, 7))
    tol = {"atol": 1e-5, "rtol": 0} if mmap else {"atol": 0, "rtol": 0}  # (mmap: unaligned tensors, last bits)
    with torch.no_grad():
        body = lm.transformer(ids).last_hidden_state
        base = TransformerXL.from_pretrained(tmp_path / "lm", mmap=mmap)
        torch.testing.assert_close(base(ids).last_hidden_state, body, **tol)
        for source in ("lm", "base"):
            torch.manual_seed(0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                clf = TransformerXLForSequenceClassification.from_pretrained(tmp_path / source, num_labels=3, mmap=mmap)
            assert any("classification head" in str(w.message) and "newly initialised" in str(w.message)
                       for w in caught)  # fmt: skip
            expected = TransformerXL.from_pretrained(tmp_path / source)(ids).last_hidden_state
            torch.testing.assert_close(clf.transformer(ids).last_hidden_state, expected, **tol)
            assert (
                clf.score.weight.shape == (3, cfg.d_model) and 0.25 < float(clf.score.weight.std()) < 0.35
            )  # init_std
            assert bool(torch.isfinite(clf(ids).logits).all())
    clf.save_pretrained(tmp_path / "clf")
    for source, message in [("clf", "txl predict classifies with it"), ("base", "load it as TransformerXL$")]:
        with pytest.raises(CheckpointError, match=f"without the language-model head \\(crit.\\*\\).*{message}"):
            TransformerXLLM.from_pretrained(tmp_path / source, mmap=mmap)


def test_classifier_pools_last_non_padding_token():
    cfg = debug_config(n_token=150, num_labels=3, pad_token_id=0, cutoffs=[30, 90], d_embed=32, div_val=2)
    model = TransformerXLForSequenceClassification(cfg).eval()
    a = torch.randint(1, 150, (5,))
    b = torch.randint(1, 150, (8,))
    batch = torch.zeros(2, 8, dtype=torch.long)
    batch[0, :5], batch[1] = a, b
    with torch.no_grad():
        out = model(batch, labels=torch.tensor([0, 2]))
        alone_a = model(a[None]).logits
        alone_b = model(b[None]).logits
    assert out.logits.shape == (2, 3)  # works with d_embed != d_model (HF's head crashed there)
    torch.testing.assert_close(out.logits[0], alone_a[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out.logits[1], alone_b[0], atol=1e-6, rtol=0)
    expected = torch.nn.functional.cross_entropy(out.logits, torch.tensor([0, 2]))
    torch.testing.assert_close(out.loss, expected)
    reg = TransformerXLForSequenceClassification(debug_config(n_token=150, num_labels=1))
    out = reg(batch, labels=torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(
        out.loss, torch.nn.functional.mse_loss(out.logits.squeeze(-1), torch.tensor([0.5, -1.0]))
    )
    multi = TransformerXLForSequenceClassification(debug_config(n_token=150, num_labels=3))
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    out = multi(batch, labels=targets)
    torch.testing.assert_close(out.loss, torch.nn.functional.binary_cross_entropy_with_logits(out.logits, targets))


def test_greedy_generation_with_memory_equals_recomputation():
    model = TransformerXLLM(debug_config(mem_len=64)).eval()
    prompt = torch.randint(0, 97, (2, 7))
    ids = generate(model, prompt, 10, temperature=0.0)
    assert ids.shape == (2, 17) and ids[:, :7].equal(prompt)
    with torch.no_grad():  # recompute each step from scratch, no memory
        expected = prompt
        for _ in range(10):
            nxt = model(expected, return_log_probs=True).log_probs[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    assert ids.equal(expected)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert generate(model, prompt, 5, generator=g1).equal(generate(model, prompt, 5, generator=g2))


def test_generate_cli(tmp_path, capsys):
    from txl.cli import main

    model = TransformerXLLM(debug_config(mem_len=32)).eval()
    model.save_pretrained(tmp_path)
    main(
        [
            "generate",
            "--model",
            str(tmp_path),
            "--prompt_ids",
            "[5, 6, 7]",
            "--max_new_tokens",
            "6",
            "--temperature",
            "0",
        ]
    )
    printed = json.loads(capsys.readouterr().out)
    expected = generate(model, torch.tensor([[5, 6, 7]]), 6, temperature=0.0)[0, 3:].tolist()
    assert printed == {"prompt_ids": [5, 6, 7], "new_ids": expected, "reading": {"mem_len": 32, "clamp_len": -1,
                                                                                   "same_length": False}}  # fmt: skip
    short = ["generate", "--model", str(tmp_path), "--max_new_tokens", "6", "--temperature", "0"]
    main([*short, "--prompt_ids", "5,6,7"])  # as on a shell: commas, no brackets
    assert json.loads(capsys.readouterr().out) == printed
    main([*short, "--prompt_ids", "5"])  # one id: a prompt of one token
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [5]
    main([*short, "--prompt_ids", "5,6,7", "--stop_ids", f"{expected[2]},{expected[2]}"])
    assert json.loads(capsys.readouterr().out)["new_ids"] == expected[: expected.index(expected[2]) + 1]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tmp_path / "missing"), "--prompt_ids", "[1]"])
    assert exit_info.value.code == 2 and "txl: error:" in capsys.readouterr().err


def test_sampling_parameters_are_checked():
    model = TransformerXLLM(debug_config(mem_len=8)).eval()
    prompt = torch.randint(0, 97, (1, 3))
    for bad, match in [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=match):
            generate(model, prompt, 2, **bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    assert generate(model, prompt, 0).equal(prompt)


def test_filter_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    probs = logits.softmax(-1)[0]  # 0.09, 0.67, 0.24, 0.03
    assert probs[1] < 0.8 < probs[1] + probs[2]
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[True, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=1e-12)).tolist() == [[True, False, True, True]]  # best stays
    peaked = torch.tensor([[0.0, 200.0, -5.0]])  # the best token's probability rounds to 1 in fp32
    assert torch.isinf(filter_logits(peaked, top_p=0.5)).tolist() == [[True, False, True]]


def test_from_pretrained_reads_into_aligned_parameters_and_casts(tmp_path):
    """Loading reads the file into the model's own (aligned) parameters: bit-identical outputs; `dtype` casts;
    a truncated or inconsistent file is one error naming it."""
    model = TransformerXLLM(debug_config(div_val=2)).eval()
    model.save_pretrained(tmp_path)
    loaded = TransformerXLLM.from_pretrained(tmp_path)
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())  # (not memory-mapped: same GEMM paths)
    half = TransformerXLLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    ref = dict(model.named_parameters())
    assert all(p.equal(ref[n].to(torch.bfloat16)) for n, p in half.named_parameters())
    emb, crit = half.transformer.word_emb, half.crit
    assert all(o.weight is e.weight for o, e in zip(crit.out_layers, emb.emb_layers, strict=True))  # ties kept
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors: bad entry .* within the file"):
        TransformerXLLM.from_pretrained(tmp_path)
    weights.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        TransformerXLLM.from_pretrained(tmp_path)


def test_from_pretrained_mmap_is_close_and_private(tmp_path):
    model = TransformerXLLM(debug_config(div_val=2)).eval()
    model.save_pretrained(tmp_path)
    mapped = TransformerXLLM.from_pretrained(tmp_path, mmap=True)
    emb, crit = mapped.transformer.word_emb, mapped.crit
    assert all(o.weight is e.weight for o, e in zip(crit.out_layers, emb.emb_layers, strict=True))
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        a, b = model(ids, ids, return_log_probs=True), mapped(ids, ids, return_log_probs=True)
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)  # (not bit-exact: unaligned)
    mapped.train()  # the mapping is private: training writes to memory, never to the file
    before = (tmp_path / "model.safetensors").read_bytes()
    mapped(ids, ids).loss.backward()
    torch.optim.SGD(mapped.parameters(), lr=0.1).step()
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_the_readme_library_example_runs_as_written(tmp_path, monkeypatch):
    """The README's "Using the library" block, executed as a user pastes it: its names mean what it says."""
    from tests.conftest import ROOT

    text = (ROOT / "README.md").read_text()
    block = text.split("## Using the library", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    model, x, ids = scope["model"], scope["x"], scope["ids"]
    assert ids.shape == (1, 60) and ids[0, :10].equal(x[0, :10])  # the prompt, then 50 new tokens
    assert scope["out"].log_probs.shape == (8, 64, 256) and len(scope["mems"]) == 6
    saved = TransformerXLLM.from_pretrained(tmp_path / "my-model")
    theirs = model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in saved.state_dict().items())


def test_tokenizer_call_feeds_model_generate_as_in_hugging_face(tmp_path):
    """``model.generate(**tok(texts, padding=True, return_tensors="pt"))``: left padding masked, every row as if
    it were alone."""
    import numpy as np

    from txl import Tokenizer
    from txl.data import FileRange

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n")
    tok = Tokenizer.build("char", [FileRange(corpus)])
    model = TransformerXLLM(debug_config(n_token=tok.vocab_size, mem_len=12)).eval()
    texts = ["the fox", "a lazy brown dog jumps"]
    enc = tok(texts, padding=True, return_tensors="pt")
    n = len(texts[1])
    assert enc.input_ids.shape == enc["attention_mask"].shape == (2, n)
    assert enc.attention_mask[0].tolist() == [0] * (n - 7) + [1] * 7 and enc.input_ids[1].tolist() == tok.encode(
        texts[1]
    )
    out = model.generate(**enc, max_new_tokens=15)
    for row, text in enumerate(texts):
        alone = model.generate(**tok(text, return_tensors="pt"), max_new_tokens=15)
        assert out[row, n:].equal(alone[0, len(text) :]), text
    assert tok.batch_decode(out[:, n:]) == [tok.decode(r) for r in out[:, n:]]
    single = tok("the fox")  # lists, as HF gives them for one text
    assert single == {"input_ids": tok.encode("the fox"), "attention_mask": [1] * 7}
    assert tok(texts, padding=True, return_tensors="np")["input_ids"].dtype == np.int64
    with pytest.raises(ValueError, match="pass padding=True"):
        tok(texts, return_tensors="pt")
    with pytest.raises(ValueError, match="return_tensors = 'tf'"):
        tok("the", return_tensors="tf")


def test_attention_mask_reads_padded_rows_as_if_alone():
    """Hugging Face's ``attention_mask`` (1 = token, 0 = padding) in every model class: the same as ``padding``;
    the language model's real positions and the classifier's logits equal each text read alone, with left padding
    and (classifier) right padding."""
    torch.manual_seed(0)
    cfg = debug_config(num_labels=3, init_std=0.3)
    short, long = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 11))
    left = torch.cat([torch.cat([torch.full((1, 6), 7), short], 1), long])  # [2, 11]
    mask = torch.ones_like(left)
    mask[0, :6] = 0
    lm = TransformerXLLM(cfg).eval()
    with torch.no_grad():
        got = lm(left, attention_mask=mask, return_log_probs=True).log_probs
        torch.testing.assert_close(got[0, 6:], lm(short, return_log_probs=True).log_probs[0])
        torch.testing.assert_close(got[1], lm(long, return_log_probs=True).log_probs[0])
        assert got.equal(lm(left, padding=mask == 0, return_log_probs=True).log_probs)
        assert not torch.allclose(lm(left, return_log_probs=True).log_probs[0, 6:], got[0, 6:])  # (it matters)
        # with a memory, a [B, T] mask takes the memory's positions as tokens
        mems = lm(long.expand(2, -1)).mems
        with_mem = lm(left, mems=mems, attention_mask=mask, return_log_probs=True).log_probs
        padding = torch.cat([torch.zeros(2, mems[0].shape[1], dtype=torch.bool), mask == 0], 1)
        assert with_mem.equal(lm(left, mems=mems, padding=padding, return_log_probs=True).log_probs)
    with pytest.raises(ValueError, match="not both"):
        lm(left, attention_mask=mask, padding=mask == 0)
    clf = TransformerXLForSequenceClassification(cfg).eval()
    right = torch.cat([torch.cat([short, torch.full((1, 6), 7)], 1), long])
    with torch.no_grad():
        alone = torch.cat([clf(short).logits, clf(long).logits])
        torch.testing.assert_close(clf(left, attention_mask=mask).logits, alone)
        torch.testing.assert_close(clf(right, attention_mask=mask.flip(1)).logits, alone)
        assert not torch.allclose(clf(right).logits, alone)  # without the mask, row 0 is read up to its padding


def test_lm_output_has_hugging_faces_logits_names():
    model = TransformerXLLM(debug_config()).eval()
    x = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        out = model(x, return_log_probs=True)
        assert out.logits is out.log_probs and out.prediction_scores is out.log_probs
        assert torch.allclose(out.logits.exp().sum(-1), torch.ones(2, 6))
        with pytest.raises(AttributeError, match="return_log_probs=True"):
            _ = model(x).logits


def test_config_from_dict_names_hugging_faces_fields():
    with pytest.raises(ValueError, match=r"vocab_size \(Hugging Face's vocab_size is n_token here; txl convert hf"):
        TransformerXLConfig.from_dict({"vocab_size": 100, "n_layer": 2})
    with pytest.raises(ValueError, match=r"unknown TransformerXLConfig field\(s\): n_layers$"):
        TransformerXLConfig.from_dict({"n_layers": 2})


def test_config_takes_hugging_faces_names_and_saves_alone(tmp_path):
    """TransformerXLConfig(vocab_size=..., tie_word_embeddings=...) as HF's TransfoXLConfig takes them; both names
    read and set the same field; a config saves and loads alone (config.json), also from a model's folder."""
    from dataclasses import replace

    cfg = TransformerXLConfig(vocab_size=120, cutoffs=[20, 60], div_val=2, tie_word_embeddings=False, mem_len=9)
    assert (cfg.n_token, cfg.vocab_size, cfg.tie_weight, cfg.tie_word_embeddings) == (120, 120, False, False)
    assert "vocab_size" not in cfg.to_dict() and replace(cfg, d_model=32).n_token == 120
    cfg.vocab_size = 130
    assert cfg.n_token == 130 and TransformerXLLM(cfg).crit.n_token == 130
    with pytest.raises(TypeError, match="give n_token or Hugging Face's name vocab_size, not both"):
        TransformerXLConfig(vocab_size=100, n_token=100)
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_layers'"):
        TransformerXLConfig(n_layers=3)
    path = cfg.save_pretrained(tmp_path / "cfg")
    assert path.name == "config.json" and TransformerXLConfig.from_pretrained(tmp_path / "cfg") == cfg
    model = TransformerXLLM(debug_config(mem_len=5))
    model.save_pretrained(tmp_path / "model")
    assert TransformerXLConfig.from_pretrained(tmp_path / "model") == model.config
    with pytest.raises(ValueError, match="not a txl checkpoint config"):
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text('{"vocab_size": 10}')
        TransformerXLConfig.from_pretrained(tmp_path / "hf")


def test_inputs_embeds_equals_feeding_the_embeddings_output():
    """``inputs_embeds`` (Hugging Face's argument) in place of ids: the word embedding's output gives the same losses,
    memories and classification logits as the ids; its gradient reaches the embeddings (soft prompts); exactly one
    of the two is taken, of the model's width."""
    torch.manual_seed(0)
    cfg = debug_config(n_token=60, d_model=24, d_embed=24, n_head=3, d_head=8, d_inner=32, n_layer=2, mem_len=5,
                       cutoffs=[20, 40], div_val=2, num_labels=3)  # fmt: skip
    lm = TransformerXLLM(cfg).eval()
    x = torch.randint(0, 60, (2, 7))
    by_ids = lm(x, labels=x)
    embeds = lm.transformer.word_emb(x).detach().requires_grad_()
    by_embeds = lm(inputs_embeds=embeds, labels=x)
    torch.testing.assert_close(by_embeds.losses, by_ids.losses, rtol=0, atol=0)
    for a, b in zip(by_embeds.mems, by_ids.mems, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    by_embeds.loss.backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0
    nxt = torch.randint(0, 60, (2, 4))
    follow = lm(inputs_embeds=lm.transformer.word_emb(nxt), mems=by_ids.mems, labels=nxt).losses
    torch.testing.assert_close(follow, lm(nxt, mems=by_ids.mems, labels=nxt).losses, rtol=0, atol=0)
    clf = TransformerXLForSequenceClassification(cfg).eval()
    torch.testing.assert_close(clf(inputs_embeds=clf.transformer.word_emb(x)).logits, clf(x).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="give input_ids or inputs_embeds"):
        lm(x, inputs_embeds=embeds)
    with pytest.raises(ValueError, match="give input_ids or inputs_embeds"):
        lm()
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[batch, seq_len, d_model=24\]"):
        lm(inputs_embeds=torch.zeros(2, 7, 5))
