"""`txl convert hf` imports Hugging Face's TransfoXL tokenizer: a vocabulary made in the test by transformers' own
TransfoXLTokenizer (vocab.pkl, read only with --trust-pickle and then by a restricted unpickler) or a vocab.txt
becomes tokenizer.json with HF's ids; pickles that would run code are refused without running anything."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import subprocess
import sys
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
import torch

from txl.cli import main
from txl.data import Tokenizer
from txl.interop.hf_vocab import RestrictedUnpickler, read_restricted_pickle
from txl.model.pretrained import CheckpointError

transformers = pytest.importorskip("transformers")  # installed by `make test` (the bench extra)

LINES = [
    "the king is dead , long live the king .",
    "the queen said : the king 's horse is lame .",
    "a horse ! a horse ! my kingdom for a horse !",
    "<unk> and the rest is silence .",
]


def hf_folder(tmp_path: Path, lower_case: bool = False) -> tuple[Path, object]:
    """An HF TransfoXL folder: a tokenizer built by transformers from a small corpus, and a tiny model over it."""
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(LINES * 3) + "\n")
    tok = TransfoXLTokenizer(special=["<eos>"], lower_case=lower_case)
    tok.count_file(str(corpus), add_eos=True)
    tok.build_vocab()
    tok._update_total_vocab_size()  # HF caches len(tok) at construction (a 4.46.3 bug)
    src = tmp_path / "hf"
    tok.save_pretrained(src)
    cfg = TransfoXLConfig(
        vocab_size=len(tok.idx2sym), cutoffs=[], d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=32, n_layer=2,
        div_val=1, mem_len=8, untie_r=True, same_length=False, clamp_len=-1, tie_word_embeddings=True,
        trainer_compatible=True,
    )  # fmt: skip
    torch.manual_seed(0)
    TransfoXLLMHeadModel(cfg).save_pretrained(src, safe_serialization=True)
    return src, tok


def test_vocab_pkl_needs_trust_then_gives_hf_ids(tmp_path, capsys):
    src, hf = hf_folder(tmp_path)
    assert (src / "vocab.pkl").exists() and not (src / "vocab.txt").exists()
    main(["convert", "hf", str(src), str(tmp_path / "plain")])
    printed = capsys.readouterr().out
    assert "tokenizer not imported" in printed and "pass --trust-pickle" in printed
    assert not (tmp_path / "plain" / "tokenizer.json").exists() and (tmp_path / "plain" / "model.safetensors").exists()

    main(["convert", "hf", "--trust-pickle", str(src), str(tmp_path / "out")])
    assert "tokenizer:" in capsys.readouterr().out
    ours = Tokenizer.load(tmp_path / "out" / "tokenizer.json")
    assert ours.symbols == hf.idx2sym  # HF's order, specials included: the ids the model was trained with
    assert all(ours.token_to_id(s) == hf.sym2idx[s] for s in hf.idx2sym)
    assert ours.unk_token == "<unk>" and ours.eos_token == "<eos>"
    # HF 4.46.3 gives its added tokens the ids 0..2 at construction, before the vocabulary exists: "<unk>" typed
    # literally encodes to id 1 ("the" here). txl keeps the vocabulary's id.
    assert hf.convert_tokens_to_ids("<unk>") == 1 != hf.sym2idx["<unk>"] == ours.token_to_id("<unk>")
    for line in [LINES[0], LINES[2], "the horse is the king ."]:  # (HF's Moses splits a lone 's: issue 15)
        expected = hf.encode(line, add_special_tokens=False)  # HF's Moses pipeline on already tokenized text
        assert ours.encode(line) == expected
        assert ours.encode(line + "\n") == [*expected, hf.sym2idx["<eos>"]]  # a line ends with <eos>
    assert ours.encode("the zebra") == hf.encode("the zebra", add_special_tokens=False)  # unknown word -> <unk>
    assert ours.encode("the zebra")[1] == hf.sym2idx["<unk>"]
    ids = ours.encode(LINES[0])
    # detokenised as HF does (its convert_tokens_to_string over the vocabulary's symbols: its ids clash, above)
    assert (
        ours.decode(ids)
        == hf.convert_tokens_to_string([hf.idx2sym[i] for i in ids])
        == "the king is dead, long live the king."
    )
    # the converted model now reads text: txl generate --prompt works
    main(["generate", "--model", str(tmp_path / "out"), "--prompt", "the king", "--max_new_tokens", "3", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_ids"] == hf.encode("the king", add_special_tokens=False) and len(record["new_ids"]) == 3
    # ... and txl eval scores a text with it (a model folder without run.json: settings from the model)
    main(["eval", "--model", str(tmp_path / "out"), "--data", str(tmp_path / "corpus.txt"), "--json"])
    scored = json.loads(capsys.readouterr().out)
    words = sum(len(line.split()) + 1 for line in (tmp_path / "corpus.txt").read_text().splitlines())
    assert scored["mem_len"] == 8 and math.isfinite(scored["ppl"]) and scored["tokens"] < words


def test_lower_case_and_plain_text_vocab(tmp_path, capsys):
    src, hf = hf_folder(tmp_path, lower_case=True)
    (src / "vocab.pkl").unlink()
    (src / "vocab.txt").write_text("".join(f"{s} 1\n" for s in hf.idx2sym))  # HF's vocab_file: first field per line
    main(["convert", "hf", str(src), str(tmp_path / "out")])  # no pickle: no trust needed
    ours = Tokenizer.load(tmp_path / "out" / "tokenizer.json")
    assert ours.symbols == hf.idx2sym and ours.lower_case
    assert ours.encode("The KING is dead") == hf.encode("The KING is dead", add_special_tokens=False)


def test_vocabulary_must_fit_the_model(tmp_path):
    src, hf = hf_folder(tmp_path)
    (src / "vocab.pkl").unlink()
    (src / "vocab.txt").write_text("".join(f"{s}\n" for s in hf.idx2sym[:-1]))
    with pytest.raises(SystemExit) as e:
        main(["convert", "hf", str(src), str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()


class Payload:
    """A pickle that runs ``call(*args)`` when loaded (what a malicious vocab.pkl does)."""

    def __init__(self, call, args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def payloads(sentinel: Path) -> dict[str, object]:
    touch = f"import pathlib; pathlib.Path({str(sentinel)!r}).write_text('ran')"
    return {
        "os.system": Payload(os.system, (f"touch {sentinel}",)),
        "builtins.exec": Payload(exec, (touch,)),
        "subprocess.run": Payload(subprocess.run, ([sys.executable, "-c", touch],)),
        "nested in HF state": {"idx2sym": ["a", "b"], "sym2idx": OrderedDict(a=0, b=1), "x": Payload(eval, (touch,))},
        "getattr chain": Payload(getattr, (Path(sentinel), "touch")),
    }


@pytest.mark.parametrize("kind", list(payloads(Path("x"))))
def test_code_in_a_vocab_pickle_is_refused_and_never_run(tmp_path, kind, capsys):
    src, _ = hf_folder(tmp_path)
    sentinel = tmp_path / "ran"
    (src / "vocab.pkl").write_bytes(pickle.dumps(payloads(sentinel)[kind]))
    with pytest.raises(SystemExit) as e:
        main(["convert", "hf", "--trust-pickle", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "refused to load" in err and "nothing in it was run" in err
    assert not sentinel.exists() and not (tmp_path / "out").exists()  # nothing ran, nothing was written
    main(["convert", "hf", str(src), str(tmp_path / "untrusted")])  # without trust the pickle is not even opened
    assert not sentinel.exists() and not (tmp_path / "untrusted" / "tokenizer.json").exists()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol_of_hf_state_reads(tmp_path, protocol):
    _, hf = hf_folder(tmp_path)
    state = hf.__dict__  # Moses objects, regexes, AddedTokens (which need protocol 2+), a Trie
    if protocol < 2:  # what a tokenizer of an old transformers version (no AddedToken objects) held
        state = {k: v for k, v in state.items() if not k.startswith("_") and k != "added_tokens_decoder"}
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(state, protocol=protocol))
    state = read_restricted_pickle(path)
    assert state["idx2sym"] == hf.idx2sym and state["sym2idx"] == hf.sym2idx
    assert isinstance(state["counter"], Counter) and state["counter"] == hf.counter


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_unpickler_admits_plain_data_only(tmp_path, protocol):
    data = {"a": [1, 2.5, "x", None, True], "b": (1, 2), "c": {3}, "d": frozenset({4}), "e": b"bytes"}
    assert RestrictedUnpickler(io.BytesIO(pickle.dumps(data, protocol=protocol))).load() == data
    with pytest.raises(pickle.UnpicklingError, match="refused to load torch"):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(torch.zeros(2), protocol=max(protocol, 2)))).load()
    bad = tmp_path / "vocab.pkl"
    bad.write_bytes(pickle.dumps(data, protocol=protocol)[:-5])
    with pytest.raises(CheckpointError, match="not a readable vocabulary pickle"):
        read_restricted_pickle(bad)
