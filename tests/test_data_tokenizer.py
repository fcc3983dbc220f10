"""Tokenizers give the reference pipeline's ids (vocabulary order, ties, Unicode whitespace, enwik8/text8 rules)
and their tokenizer.json loads in Hugging Face `tokenizers` with the same ids."""

from __future__ import annotations

import random

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from reference_data import RefVocab, prep_enwik8, prep_text8
from txl.data import DataError, FileRange, Tokenizer, prepare_corpus
from txl.data import readers as readers_mod
from txl.data import tokenizer as tok_mod
from txl.data.tokenizer import BYTE_CHARS, smallest_uint

# Python's str.split() whitespace that is not a line break in a text-mode file: includes the four that Rust's
# char::is_whitespace lacks (\x1c-\x1f), NBSP, ideographic space, the line/paragraph separators, NEL.
ODD_SPACES = ["\x1c", "\x1d", "\x1e", "\x1f", "\xa0", "\u3000", "\u2028", "\u2029", "\x85", "\t", "\x0b", "\x0c"]


def _words(rng: random.Random, n: int) -> list[str]:
    pool = ["the", "The", "cat", "Ünïcode", "naïve", "日本", "<unk>", "a", "of", "@-@", "ΣΑΣ", "b", "c", "x"]
    pool += [f"w{i}" for i in range(40)]
    return [rng.choice(pool) for _ in range(n)]


def _corpus(rng: random.Random, n_lines: int) -> str:
    lines = []
    for _ in range(n_lines):
        r = rng.random()
        if r < 0.1:
            lines.append("")
        elif r < 0.15:
            lines.append("   ")
        else:
            ws = [rng.choice([" ", " ", " ", *ODD_SPACES]) for _ in range(12)]
            words = _words(rng, rng.randint(1, 12))
            lines.append(" " + "".join(w + s for w, s in zip(words, ws, strict=False)))
    sep = rng.choice(["\n", "\r\n"])
    return sep.join(lines) + (sep if rng.random() < 0.5 else "")


def _write_splits(folder, texts: dict[str, str]):
    folder.mkdir(parents=True, exist_ok=True)
    for s, t in texts.items():
        (folder / f"{s}.txt").write_bytes(t.encode("utf-8"))
    return folder


@pytest.mark.parametrize("dataset", ["wt103", "wt2", "ptb"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_word_ids_match_reference_rewrite(tmp_path, dataset, seed):
    rng = random.Random(seed)
    texts = {s: _corpus(rng, n) for s, n in [("train", 300), ("valid", 60), ("test", 60)]}
    if dataset == "wt103":  # valid/test words must exist in a train-only vocabulary (no unk for WT103's rule)
        texts["train"] += "\n" + " ".join(set(texts["valid"].split()) | set(texts["test"].split()))
    folder = _write_splits(tmp_path / "d", texts)
    lower = dataset == "ptb"
    ref = RefVocab(special=["<eos>"], lower_case=lower)
    for s in ["train"] if dataset == "wt103" else ["train", "valid", "test"]:
        ref.count_file(folder / f"{s}.txt")
    ref.build_vocab()
    corpus = prepare_corpus(path=str(folder), dataset=dataset, cache_dir=str(tmp_path / "c"), log=lambda m: None)
    assert corpus.tokenizer.symbols == ref.idx2sym
    for s in ("train", "valid", "test"):
        assert corpus.splits[s].tolist() == ref.encode_file(folder / f"{s}.txt"), s
    hf = HFTokenizer.from_file(str(corpus.path / "tokenizer.json"))
    for line in texts["valid"].replace("\r\n", "\n").split("\n")[:-1]:
        if lower and "Σ" in line:  # Python's lower() has the final-sigma rule, tokenizers' Lowercase does not
            continue
        assert hf.encode(line).ids == [ref.get_idx(t) for t in ref.tokenize(line, add_eos=True)], repr(line)


def test_ties_keep_first_seen_order_not_alphabetical(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("zeta beta alpha\nalpha zeta beta\ngamma\n")  # zeta/beta/alpha tie at 2: first-seen order
    tok = Tokenizer.build("word", [FileRange(f)], line_end="eos")
    assert tok.symbols == ["<eos>", "zeta", "beta", "alpha", "gamma"]
    ref = RefVocab(special=["<eos>"], lower_case=False)
    ref.count_file(f)
    ref.build_vocab()
    assert tok.symbols == ref.idx2sym
    # char level: same rule ("b" and "a" tie at 2; "b" was seen first)
    g = tmp_path / "c.txt"
    g.write_text("bacab")
    assert Tokenizer.build("char", [FileRange(g)]).symbols == ["b", "a", "c"]


def test_min_freq_and_max_size_follow_most_common(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a a a b b c\nd d d d e\n")
    for kw in [dict(min_freq=2), dict(max_size=3), dict(min_freq=3, max_size=10)]:
        tok = Tokenizer.build("word", [FileRange(f)], line_end="eos", **kw)
        ref = RefVocab(special=["<eos>"], lower_case=False, **kw)
        ref.count_file(f)
        ref.build_vocab()
        assert tok.symbols == ref.idx2sym, kw


def test_enwik8_paper_mode_equals_reference_and_byte_mode_is_identity(tmp_path):
    rng = np.random.default_rng(0)
    raw = bytes(rng.choice([10, 32, 60, 97, 101, 200, 13, 0, 255, 133, 28], size=5000).tolist())
    (tmp_path / "raw").write_bytes(raw)
    prepped = tmp_path / "prepped.txt"
    prepped.write_text(prep_enwik8(raw))
    ref = RefVocab(special=[], lower_case=True)  # enwik8: defaults, add_eos=False
    ref.count_file(prepped, add_eos=False)
    ref.build_vocab()
    fr = FileRange(tmp_path / "raw")
    paper = Tokenizer.build("byte", [fr], drop_newlines=True)
    assert [int(s) for s in ref.idx2sym] == [BYTE_CHARS.index(s) for s in paper.symbols]
    assert 10 not in [BYTE_CHARS.index(s) for s in paper.symbols]
    ids = np.concatenate(list(paper.encode_file(fr)))
    assert ids.tolist() == ref.encode_file(prepped, add_eos=False)
    full = Tokenizer.build("byte", [fr])
    assert full.vocab_size == 256 and np.concatenate(list(full.encode_file(fr))).tolist() == list(raw)


def test_text8_rule_strip_and_char_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(readers_mod, "HELDOUT_CHARS", 200)
    rng = random.Random(0)
    text = " " + " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 8))) for _ in range(400))
    text += " "
    (tmp_path / "text8").write_text(text)
    parts = {"train": text[:-400], "valid": text[-400:-200], "test": text[-200:]}
    ref = RefVocab(lower_case=True)
    for s, part in parts.items():
        (tmp_path / f"{s}.ref").write_text(prep_text8(part))
        ref.count_file(tmp_path / f"{s}.ref", add_eos=False)
    ref.build_vocab()
    corpus = prepare_corpus(path=str(tmp_path / "text8"), dataset="text8", cache_dir=str(tmp_path / "c"), log=print)
    assert corpus.tokenizer.symbols == [" " if s == "_" else s for s in ref.idx2sym]
    for s in parts:
        assert corpus.splits[s].tolist() == ref.encode_file(tmp_path / f"{s}.ref", add_eos=False), s


def test_lm1b_vocab_file_and_double_eos(tmp_path):
    vocab = tmp_path / "1b_word_vocab.txt"
    vocab.write_text("<S> 100\n</S> 100\n<UNK> 50\nthe 40\ncat 3\nsat 2\nthe 1\n")
    data = tmp_path / "shard"
    data.write_text("the cat sat\nthe dog\n\n")
    tok = Tokenizer.from_vocab_file(vocab)
    ref = RefVocab(vocab_file=vocab, lower_case=False)
    ref.build_vocab()
    assert tok.symbols == ref.idx2sym and tok.unk_token == "<UNK>"
    ids, lengths = zip(*tok.encode_sentences(FileRange(data)), strict=True)
    sents = ref.encode_file(data, ordered=False, add_double_eos=True)
    assert np.concatenate(ids).tolist() == [i for s in sents for i in s]
    assert [n for ls in lengths for n in ls] == [len(s) for s in sents]
    hf = HFTokenizer.from_file(str(tok.save(tmp_path / "tok")))
    assert hf.encode("the cat sat").ids == sents[0]
    assert hf.encode("the cat sat\nthe dog\n").ids == sents[0] + sents[1]  # each line a sentence, as in the shards


@pytest.mark.parametrize(
    "build",
    [
        lambda f: Tokenizer.build("word", [f], line_end="eos"),
        lambda f: Tokenizer.build("word", [f], line_end="eos", lower_case=True, specials=["<eos>", "<unk>"]),
        lambda f: Tokenizer.build("char", [f]),
        lambda f: Tokenizer.build("byte", [f]),
        lambda f: Tokenizer.build("byte", [f], drop_newlines=True),
    ],
    ids=["word", "word-lower-unk", "char", "byte", "byte-paper"],
)
def test_tokenizer_json_roundtrip_and_hf_parity(tmp_path, build):
    rng = random.Random(3)
    text = _corpus(rng, 80).replace("ΣΑΣ", "ΑΒ")  # Python lower() knows final sigma, tokenizers does not
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode())
    tok = build(FileRange(f))
    path = tok.save(tmp_path / "out")
    again = Tokenizer.load(path)
    assert again == tok and again.symbols == tok.symbols
    hf = HFTokenizer.from_file(str(path))
    assert hf.get_vocab() == {s: i for i, s in enumerate(tok.symbols)}
    # a text of several lines (blank ones, CRLF, with and without a final line end): the ids of the text as a file
    first = text.replace("\r\n", "\n").split("\n")[0]
    crlf = text.replace("\n", "\r\n", 3) if tok.kind != "byte" else text  # (bytes are read as they are)
    for whole in (text, text + "\n\n" + first, "\n" + crlf + "\n\n"):
        f.write_bytes(whole.encode())
        as_file = [int(i) for chunk in tok.encode_file(FileRange(f)) for i in chunk]
        assert hf.encode(whole).ids == as_file
    for line in text.replace("\r\n", "\n").split("\n")[:-1]:
        ids = hf.encode(line).ids
        ours = tok.encode(line)
        if tok.line_end == "eos":
            ours = ours + [tok.token_to_id("<eos>")]
        assert ids == ours, repr(line)
        if tok.kind != "word":
            want = line.lower() if tok.lower_case else line
            assert hf.decode(ids) == want == tok.decode(ids)


def test_file_encoding_equals_prompt_encoding_and_decode_roundtrip(tmp_path):
    text = "First line here\n\nsecond  line\nlast"
    f = tmp_path / "t.txt"
    f.write_text(text)
    word = Tokenizer.build("word", [FileRange(f)], line_end="eos")
    file_ids = np.concatenate(list(word.encode_file(FileRange(f)))).tolist()
    assert file_ids == word.encode(text + "\n")  # the file's last line gets <eos> too
    assert word.decode(word.encode(text)) == "First line here\n\nsecond line\nlast"
    char = Tokenizer.build("char", [FileRange(f)])
    assert char.decode(char.encode(text)) == text
    byte = Tokenizer.bytes256()
    assert byte.decode(byte.encode("héllo\n")) == "héllo\n" and byte.encode("é") == [0xC3, 0xA9]


def test_decode_takes_tensors_and_refuses_ids_outside_the_vocabulary():
    import torch

    byte = Tokenizer.bytes256()
    rows = torch.tensor([byte.encode("hi there"), byte.encode("ho there")])
    assert byte.decode(rows[0]) == "hi there" and byte.decode(np.array(byte.encode("é"))) == "é"
    assert byte.batch_decode(rows) == ["hi there", "ho there"]
    with pytest.raises(ValueError, match=r"one sequence of ids, got shape \(2, 8\): batch_decode"):
        byte.decode(rows)
    for bad in (-1, 256):  # (a negative id read the vocabulary from its end)
        with pytest.raises(ValueError, match=f"token id {bad} is outside this vocabulary of 256 symbols"):
            byte.decode([104, bad])
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            byte.stream_decoder().push(bad)


def test_smallest_dtype():
    assert [smallest_uint(n).name for n in (27, 256, 257, 65536, 65537, 267_735)] == [
        "uint8",
        "uint8",
        "uint16",
        "uint16",
        "uint32",
        "uint32",
    ]


def test_long_single_line_is_cut_at_whitespace_with_same_ids(tmp_path, monkeypatch):
    monkeypatch.setattr(tok_mod, "BLOCK_BYTES", 64)
    import txl.data.text as text_mod

    monkeypatch.setattr(text_mod, "BLOCK_BYTES", 64)
    rng = random.Random(1)
    line = " ".join(_words(rng, 3000))
    f = tmp_path / "one_line.txt"
    f.write_text(line + "\nshort\n" + line)
    tok = Tokenizer.build("word", [FileRange(f)], line_end="eos")
    ref = RefVocab(special=["<eos>"], lower_case=False)
    ref.count_file(f)
    ref.build_vocab()
    assert tok.symbols == ref.idx2sym
    chunks = list(tok.encode_file(FileRange(f), errors="strict"))
    assert len(chunks) > 20  # the long lines were cut at whitespace, not held whole
    assert np.concatenate(chunks).tolist() == ref.encode_file(f)


@pytest.mark.parametrize("block", [2, 3, 5, 7])
def test_crlf_and_multibyte_chars_across_block_boundaries(tmp_path, monkeypatch, block):
    import txl.data.text as text_mod

    monkeypatch.setattr(text_mod, "BLOCK_BYTES", block)
    text = "ab\r\ncd\r\n\r\né日\r\n🙂x\ry\r\n"
    (tmp_path / "crlf.txt").write_bytes(text.encode())
    (tmp_path / "lf.txt").write_bytes(text.replace("\r\n", "\n").replace("\r", "\n").encode())
    tok = Tokenizer.build("char", [FileRange(tmp_path / "lf.txt")])
    a, b = (np.concatenate(list(tok.encode_file(FileRange(tmp_path / n)))).tolist() for n in ("crlf.txt", "lf.txt"))
    assert a == b and tok.decode(a) == text.replace("\r\n", "\n").replace("\r", "\n")


def test_unknown_word_without_unk_names_word_and_line(tmp_path):
    train, other = tmp_path / "a.txt", tmp_path / "b.txt"
    train.write_text("known words only\n")
    other.write_text("known\nwords known\nonly mystery\n")
    tok = Tokenizer.build("word", [FileRange(train)], line_end="eos", unk_token=None)
    with pytest.raises(DataError, match=r"b\.txt:3: word 'mystery' is not in the vocabulary"):
        list(tok.encode_file(FileRange(other)))
    char = Tokenizer.build("char", [FileRange(train)])
    with pytest.raises(DataError, match=r"b\.txt:3: character 'm' is not in the vocabulary"):
        list(char.encode_file(FileRange(other)))
    with_unk = Tokenizer.build("word", [FileRange(train)], line_end="eos", specials=["<eos>", "<unk>"])
    ids = np.concatenate(list(with_unk.encode_file(FileRange(other))))
    assert with_unk.symbols[ids[-2]] == "<unk>"


def test_stream_decoder_peek_takes_nothing(tmp_path):
    """peek gives what push would give, and the decoder goes on as if it had not been asked (a UTF-8 sequence
    split over byte tokens, a word's separator and line end)."""
    f = tmp_path / "t.txt"
    f.write_text("aé b\nab cd\nef gh\n", encoding="utf-8")
    for tok in (Tokenizer.bytes256(), Tokenizer.build("word", [FileRange(f)], line_end="eos")):
        text = "aé b" if tok.kind == "byte" else "ab cd\nef gh"
        ids = tok.encode(text)
        dec, pieces = tok.stream_decoder(), []
        for i in ids:
            for other in ids:
                dec.peek(other)
            want = dec.peek(i)
            pieces.append(dec.push(i))
            assert pieces[-1] == want
        assert "".join(pieces) + dec.flush() == tok.decode(ids) == text
        assert "" in pieces or tok.kind == "word"  # (the first byte of é alone is no text yet)
