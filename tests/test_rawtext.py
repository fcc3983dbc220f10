"""Raw text in and out (issue 15): HF TransfoXLTokenizer's Moses pipeline recorded in tokenizer.json and reproduced
id for id on raw text, detokenised decoding and streaming, the text8 normaliser, the byte/char policy for symbols
outside the vocabulary, `txl tokenize`, and training on a raw-text folder."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from txl.data import Tokenizer
from txl.data.errors import DataError
from txl.data.rawtext import Moses, Text8
from txl.interop.hf_vocab import convert_hf_tokenizer

transformers = pytest.importorskip("transformers")  # installed by `make test` (the bench extra)

CORPUS_EXTRA = [
    "It's 1,000-year-old. He paid $3.50 for 23,000 people, don't you think?",
    '"Yes," she said -- e-mail me at a@b.com (or not). The 1990s were 3.5 times as long; 10% more!',
    "Mr. Smith's dog isn't here: it's over there... [citation needed] & so on / etc.",
    "an old man , an old year",  # (HF counts the vocabulary on whitespace: "old" on its own without ../shared too)
]
SENTENCES = [
    "It's 1,000-year-old.",
    "He paid $3.50 for 23,000 people.",
    "1,000,000.50 and 3.14159 and 1.000.000",
    "don't  you\tthink?",
    "I can't, won't and shouldn't.",
    '"Yes," she said -- e-mail me.',
    "She said 'hello' to him.",
    "« quotes » and ‘smart’ “double” quotes",
    "em—dash and en–dash and a - spaced hyphen",
    "Ellipsis... and … unicode ellipsis",
    "<unk> and <eos> written literally",
    "<UNK> in capitals",
    "",
    "    ",
    "\t \t",
    "日本語のテキスト",
    "emoji 😀 and 🎉!",
    "http://example.com/a-b?x=1,2&y=3.4",
    "e-mail: someone@example.org",
    "ROMEO. What, ho! Apothecary!",
    "KING HENRY. Once more unto the breach, dear friends, once more;",
    "A 10% rise, from $1.5m to $2,000,000.",
    "Hyphenated-words-in-a-row and re-entry",
    "(parentheses) [brackets] {braces}",
    "Question? Exclamation! Semicolon; colon:",
    "Tab\tseparated\tvalues",
    "multiple     spaces    here",
    "O'Neil and O'Brien's",
    "50-50 and 1-2-3",
    "The year 1990s, the '90s",
    "Ünïcödé àccents and façade",
    "a.b.c. U.S.A. e.g. i.e.",
    "x = y + z * 2 / 4",
    "#hashtag @mention $dollar %percent ^caret",
]


def hf_and_txl(tmp_path: Path, lower_case: bool = False):
    """A tokenizer built by transformers' own TransfoXLTokenizer from raw text, saved (vocab.pkl) and reloaded as
    HF users do, and txl's conversion of that folder."""
    logging.getLogger("transformers").setLevel(logging.CRITICAL)
    from transformers import TransfoXLTokenizer

    corpus = tmp_path / "corpus.txt"
    shakespeare = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare" / "valid.txt"
    base = shakespeare.read_text(encoding="utf-8")[:60_000] if shakespeare.is_file() else ""
    corpus.write_text(base + "\n" + "\n".join(CORPUS_EXTRA * 2) + "\n", encoding="utf-8")
    hf = TransfoXLTokenizer(special=["<eos>", "<unk>"], lower_case=lower_case)
    hf.count_file(str(corpus), add_eos=False)
    hf.build_vocab()
    hf.save_pretrained(tmp_path / "hf")
    os.environ["TRUST_REMOTE_CODE"] = "True"
    try:
        hf = TransfoXLTokenizer.from_pretrained(tmp_path / "hf")
    finally:
        del os.environ["TRUST_REMOTE_CODE"]
    return hf, convert_hf_tokenizer(tmp_path / "hf", trust_pickle=True)


@pytest.mark.parametrize("lower_case", [False, True])
def test_raw_text_gives_hf_ids_and_hf_detokenised_text(tmp_path, lower_case):
    hf, ours = hf_and_txl(tmp_path, lower_case)
    assert isinstance(ours.raw_text, Moses) and ours.raw_text.specials == ("<unk>", "<eos>")
    assert len(SENTENCES) >= 30
    for s in SENTENCES:
        ids = ours.encode(s)
        assert ids == hf.encode(s), s
        # decoding: HF's detokeniser over the vocabulary's own symbols (HF's ids for them can clash, see below);
        # a literal <eos> is a line end for txl (one line per <eos>, as in the files), a word for HF
        lines = [
            hf.convert_tokens_to_string(ln.split()) for ln in " ".join(ours.symbols[i] for i in ids).split("<eos>")
        ]
        assert ours.decode(ids) == "\n".join(lines), s
    roundtrip = "It's 1,000-year-old."
    assert ours.decode(ours.encode(roundtrip)) == (roundtrip.lower() if lower_case else roundtrip)
    assert ours.encode("1,000-year-old") == [ours.token_to_id(t) for t in "1 @,@ 000 @-@ year @-@ old".split()]
    # after the reload HF's added <formula> takes the id of a real symbol: HF encodes <formula> as that symbol and
    # decodes the symbol as <formula>. txl keeps the real symbol.
    clash = hf.convert_tokens_to_ids("<formula>")
    real = ours.symbols[clash]
    assert real != "<formula>" and hf.convert_ids_to_tokens(clash) == "<formula>"
    assert ours.decode([clash]) == hf.convert_tokens_to_string([real]) and "<formula>" not in ours.symbols
    assert ours.encode("<formula>") == [ours.unk_id] != hf.encode("<formula>") == [clash]
    # several lines: the line-end symbol per line, as in the training files (HF drops the line structure)
    two = ours.encode("It's old.\nHe paid $3.50.")
    assert two == [*ours.encode("It's old."), ours.token_to_id("<eos>"), *ours.encode("He paid $3.50.")]
    assert ours.decode(two) == ("It's old.\nHe paid $3.50.".lower() if lower_case else "It's old.\nHe paid $3.50.")


def test_pipeline_is_saved_in_tokenizer_json_and_used_by_the_cli(tmp_path):
    hf, ours = hf_and_txl(tmp_path)
    model = tmp_path / "model"
    ours.save(model)
    saved = json.loads((model / "tokenizer.json").read_text())
    assert saved["model"]["txl"]["raw_text"]["type"] == "moses"
    assert Tokenizer.from_pretrained(model) == ours  # the settings come back
    import tokenizers  # the file still loads in HF's tokenizers (which reads already-tokenized text)

    assert tokenizers.Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        "the king", add_special_tokens=False
    ).ids == hf.encode("the king")
    text = "It's 1,000-year-old. He paid $3.50!"
    run = [sys.executable, "-m", "txl", "tokenize", "--model", str(model), "--text", text]
    assert subprocess.run([*run, "--ids"], capture_output=True, text=True, check=True).stdout.split() == [
        str(i) for i in hf.encode(text)
    ]
    shown = json.loads(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
    assert shown == hf.tokenize(text)
    ids = " ".join(map(str, hf.encode(text)))
    back = subprocess.run([*run[:-2], "--decode", "--text", ids], capture_output=True, text=True, check=True)
    assert back.stdout == text + "\n"
    res = subprocess.run([*run[:-2], "--ids"], input="don't stop\n", capture_output=True, text=True, check=True)
    assert res.stdout.split() == [str(i) for i in [*hf.encode("don't stop"), ours.token_to_id("<eos>")]]


def test_stream_gives_whole_detokenised_words(tmp_path):
    _, ours = hf_and_txl(tmp_path)
    ids = ours.encode('It\'s 1,000-year-old. He paid $3.50 for 23,000 people.\n"Yes," she said.')
    dec = ours.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == ours.decode(ids)
    assert "1,000-year-old." in [p.strip() for p in pieces]  # never "1" then ",000"
    assert not any(p.strip() in ("1", "23", "3", "@,@", "@-@", "year") for p in pieces)
    # any sequence of symbols: the pieces add up to decode()
    rng = random.Random(0)
    pool = [*"1 @,@ 000 @.@ 5 @-@ old year \" ' 's n't ( ) , . ! ? $ % -- : ; <unk> <eos> the king".split()]
    pool = [s for s in pool if ours.token_to_id(s) is not None]
    for _ in range(300):
        seq = [ours.token_to_id(rng.choice(pool)) for _ in range(rng.randint(0, 14))]
        dec = ours.stream_decoder()
        assert "".join([dec.push(i) for i in seq] + [dec.flush()]) == ours.decode(seq), [ours.symbols[i] for i in seq]


def test_text8_normaliser():
    t8 = Text8()
    assert t8.normalize("Hello, World! 42 café") == "hello world four two caf "
    assert t8.normalize("<b>Bold</b>\nnew line\t1st") == " b bold b new line one st"
    assert t8.normalize("emoji 😀 \u0130stanbul \u212a") == "emoji stanbul "  # ASCII letters only, as wikifil.pl's tr
    letters = [" ", *"abcdefghijklmnopqrstuvwxyz"]
    tok = Tokenizer("char", letters, raw_text=Text8())
    ids = tok.encode("In 1984, Orwell wrote.")
    assert tok.decode(ids) == "in one nine eight four orwell wrote "
    with pytest.raises(DataError, match="text8 normaliser needs a char"):
        Tokenizer("word", ["a"], raw_text=Text8())


def test_symbols_outside_the_vocabulary(tmp_path):
    # an enwik8-style byte tokenizer in paper mode: the bytes of the training text, newlines dropped
    train = tmp_path / "train.txt"
    train.write_text("plain ascii text, <markup> & [[links]]?\nsecond line\n", encoding="utf-8")
    from txl.data.text import FileRange

    tok = Tokenizer.build("byte", [FileRange(train)], drop_newlines=True, specials=[])
    assert tok.decode(tok.encode("plain\ntext")) == "plaintext"  # newlines dropped, as in the paper's data
    with pytest.raises(DataError, match=r"byte 0xc3 at byte offset 4 is not in the vocabulary"):
        tok.encode("lain\u00e9 text")
    with pytest.raises(DataError, match=r"byte 0xf0 at byte offset 1 "):
        tok.encode("a\U0001f600")
    replaced = tok.with_unknown("replace")
    assert replaced.decode(replaced.encode("lain\u00e9?")) == "lain  ?"  # each unknown byte a space
    question = tok.with_unknown("replace", "?")
    assert question.decode(question.encode("x\u00e9")) == "x??"
    chars = Tokenizer("char", list(" abc?"))
    with pytest.raises(DataError, match=r"character 'd' \(U\+0064\) at character 3"):
        chars.encode("abcd")
    assert chars.with_unknown("replace", "?").decode(chars.with_unknown("replace", "?").encode("abcd")) == "abc?"
    # the policy is saved with the tokenizer
    chars.with_unknown("replace", "?").save(tmp_path / "m")
    assert Tokenizer.load(tmp_path / "m").encode("dab") == chars.encode("?ab")


def test_train_on_a_raw_text_folder_with_moses(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    text = "\n".join(CORPUS_EXTRA * 20) + "\n"
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_text(text, encoding="utf-8")
    run = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "txl", "train", "--config", "configs/debug.yaml", "--data.path", str(data),
         "--data.dataset", "custom", "--data.raw_text", "moses", "--run_dir", str(run), "--train.max_steps", "2"],
        check=True, capture_output=True, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    tok = Tokenizer.from_pretrained(run)
    assert isinstance(tok.raw_text, Moses) and tok.raw_files
    assert {"@,@", "@-@", "'t", "'s", "$"} <= set(tok.symbols)  # the files were read through Moses
    assert "1,000-year-old." not in tok.symbols and "don't" not in tok.symbols
    assert tok.unk_id is not None and tok.decode(tok.encode(CORPUS_EXTRA[0])) == CORPUS_EXTRA[0]
    # the same files read as already tokenized (the default) give whitespace words instead
    from txl.data.text import FileRange

    words = next(tok.encode_file(FileRange(data / "valid.txt"), raw=False))
    assert words[0] == tok.unk_id  # "It's" is not a Moses symbol


def test_converted_model_reads_and_writes_raw_text_through_the_cli(tmp_path, capsys):
    """`txl convert hf --trust-pickle` of an HF folder made from raw text: generate takes a raw prompt (HF's ids) and
    prints detokenised text, streamed or not; eval scores a raw document through Moses."""
    import torch
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel

    from txl.cli import main

    hf, ours = hf_and_txl(tmp_path)
    cfg = TransfoXLConfig(
        vocab_size=len(hf.idx2sym), cutoffs=[], d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=32, n_layer=2,
        div_val=1, mem_len=16, untie_r=True, same_length=False, clamp_len=-1, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    TransfoXLLMHeadModel(cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = tmp_path / "txl"
    main(["convert", "hf", "--trust-pickle", str(tmp_path / "hf"), str(out)])
    capsys.readouterr()
    prompt = "It's 1,000-year-old. He paid $3.50"
    main(["generate", "--model", str(out), "--prompt", prompt, "--max_new_tokens", "12", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_ids"] == hf.encode(prompt)
    tok = Tokenizer.from_pretrained(out)
    full = tok.decode(record["prompt_ids"] + record["new_ids"])
    assert full.startswith("It's 1,000-year-old. He paid $3.50") and "@,@" not in full
    for stream in ("true", "false"):  # printed text: detokenised, the same streamed or not
        main(["generate", "--model", str(out), "--prompt", prompt, "--max_new_tokens", "12", "--stream", stream])
        assert capsys.readouterr().out == full + "\n"
    doc = tmp_path / "doc.txt"
    doc.write_text(CORPUS_EXTRA[0] + "\n" + CORPUS_EXTRA[1] + "\n", encoding="utf-8")
    main(["eval", "--model", str(out), "--data", str(doc), "--raw_text", "--json", "--batch_size", "1"])
    raw = json.loads(capsys.readouterr().out)
    main(["eval", "--model", str(out), "--data", str(doc), "--json", "--batch_size", "1"])
    plain = json.loads(capsys.readouterr().out)
    moses_tokens = len(tok.encode(doc.read_text(encoding="utf-8")))
    assert raw["tokens"] == moses_tokens - 1 and plain["tokens"] < raw["tokens"]  # (the first token is context)
