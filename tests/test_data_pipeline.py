"""Readers for every layout, the id cache (reuse, invalidation, corruption), iterators (reference batches, exact
state restore, rank sharding) and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from reference_data import ref_ordered_batches, ref_stream_batches
from txl.data import (
    DataError,
    OrderedIterator,
    SentenceStreamIterator,
    find_splits,
    prepare_corpus,
)
from txl.data import readers as readers_mod

SPLITS = ("train", "valid", "test")


def _prep(tmp_path, path, dataset, logs=None, **kw):
    return prepare_corpus(
        path=str(path),
        dataset=dataset,
        cache_dir=str(tmp_path / "cache"),
        log=(logs if logs is not None else []).append,
        **kw,
    )


def _texts(folder, names, content=lambda s: f"{s} text here\n"):
    for s, name in zip(SPLITS, names, strict=True):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content(s))
    return folder


# ------------------------------------------------------------------------------------------------ readers
@pytest.mark.parametrize(
    "dataset,names",
    [
        ("wt103", ["train.txt", "valid.txt", "test.txt"]),
        ("wt103", ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"]),
        ("wt103", [f"wikitext-103/wiki.{s}.tokens" for s in SPLITS]),
        ("wt2", [f"wikitext-2/wiki.{s}.tokens" for s in SPLITS]),
        ("ptb", [f"ptb.{s}.txt" for s in SPLITS]),
        ("ptb", [f"simple-examples/data/ptb.{s}.txt" for s in SPLITS]),
        ("custom", ["train.txt", "valid.txt", "test.txt"]),
        ("custom", [f"{s}/doc.txt" for s in SPLITS]),
    ],
)
def test_word_layouts(tmp_path, dataset, names):
    _texts(tmp_path, names)
    layout = find_splits(dataset, tmp_path)
    assert [r.path for s in SPLITS for r in layout.splits[s]] == [tmp_path / n for n in names]


def test_flat_folder_holds_out_last_documents(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i}\n")
    layout = find_splits("custom", tmp_path)
    names = {s: [r.path.name for r in layout.splits[s]] for s in SPLITS}
    assert names["test"] == ["doc38.txt", "doc39.txt"] and names["valid"] == ["doc36.txt", "doc37.txt"]
    assert len(names["train"]) == 36
    for f in list(tmp_path.glob("*.txt"))[2:]:
        f.unlink()
    with pytest.raises(DataError, match=rf"^{tmp_path}: 2 file\(s\) match '\*\.txt'.*at least 3 documents"):
        find_splits("custom", tmp_path)
    empty = tmp_path / "no_text"
    empty.mkdir()
    (empty / "notes.md").write_text("not a .txt file\n")
    with pytest.raises(DataError, match=rf"^{empty}: 0 file\(s\) match '\*\.txt'.*--data\.files, e\.g\. '\*\*/\*\.md'"):
        find_splits("custom", empty)  # (the folder is named, not "folder"; and how to read other files)


def test_min_freq_without_unk_says_why_a_symbol_is_missing(tmp_path):
    """data.min_freq on a char vocabulary (no <unk>): the symbol it left out is an error that names the setting;
    on a custom word vocabulary the rare words read as <unk>."""
    f = tmp_path / "book.txt"
    f.write_text("".join(f"abc abd line {i % 7} ab!\n" if i == 3 else f"abc abd line {i % 7}\n" for i in range(60)))
    with pytest.raises(DataError, match=r"book\.txt:4: character '!' .*here data\.min_freq / data\.max_size left it"):
        _prep(tmp_path, f, "custom", tokenizer="char", min_freq=2)
    corpus = _prep(tmp_path, f, "custom", tokenizer="word", min_freq=2)
    assert "ab!" not in corpus.tokenizer.symbols and corpus.tokenizer.unk_id is not None


def test_documents_of_another_kind(tmp_path, capsys):
    """--data.files: Markdown documents at any depth (hidden folders left out), also in train/ valid/ test/
    subfolders; through txl data prepare, and txl eval of a run trained so reads a folder the same way."""
    from train_helpers import run_inprocess
    from txl.cli import main

    docs = tmp_path / "docs"
    texts = {}
    for i in range(30):
        name = f"part{i // 10}/{'deep/' if i % 3 == 0 else ''}doc{i:02d}.md"
        texts[name] = "".join(f"line {j} of document {i}: abc def.\n" for j in range(5 + i))
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        (docs / name).write_text(texts[name])
    (docs / ".git").mkdir()
    (docs / ".git" / "HEAD.md").write_text("ref: refs/heads/main\n")  # hidden: never a document
    (docs / "readme.txt").write_text("not markdown\n")
    layout = find_splits("custom", docs, files="**/*.md")
    order = sorted(texts)  # part0/deep/doc00.md, part0/deep/doc03.md, ..., part2/doc29.md
    assert [r.path.relative_to(docs).as_posix() for s in SPLITS for r in layout.splits[s]] == order
    assert [r.path.relative_to(docs).as_posix() for r in layout.splits["test"]] == order[-2:]
    args = ["--data.path", str(docs), "--data.dataset", "custom", "--data.tokenizer", "char"]
    main(["data", "prepare", *args, "--data.files", "**/*.md", "--data.cache_dir", str(tmp_path / "cache")])
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"]["test"] == sum(len(texts[n]) for n in order[-2:])
    with pytest.raises(DataError, match="not a glob pattern relative to"):
        find_splits("custom", docs, files="/etc/*.md")
    split_docs = tmp_path / "split_docs"  # train/ valid/ test/ subfolders of Markdown documents
    for s in SPLITS:
        for i in range(2):
            (split_docs / s / "sub").mkdir(parents=True, exist_ok=True)
            (split_docs / s / "sub" / f"{i}.md").write_text(f"abc def {i}.\n" * (3 if s == "test" else 1))
    run = run_inprocess(tmp_path, data__path=docs, data__dataset="custom", data__tokenizer="char",
                        data__files="**/*.md", train__max_steps=2, train__eval_interval=0)  # fmt: skip
    capsys.readouterr()
    main(["eval", "--model", str(run), "--data", str(split_docs), "--json", "--tgt_len", "8", "--batch_size", "1"])
    record = json.loads(capsys.readouterr().out)
    assert record["tokens"] == len("abc def 0.\n" * 3) * 2 - 1  # the two test/sub/*.md documents


def test_single_text_file_holds_out_its_last_lines(tmp_path, capsys):
    """A custom dataset given as one file: its last ~5% of bytes test, the ~5% before valid, each cut at a line
    start (never inside a line, a CRLF pair or a UTF-8 character); the splits together are the whole file. Through
    `txl data prepare`: the char vocabulary and token counts of those splits."""
    from txl.cli import main

    ends = ["\n", "\r\n", "\r"]
    lines = [f"line {i} é – ünïcode{'x' * (i % 7)}{ends[i % 3]}" for i in range(300)]
    path = tmp_path / "book.txt"
    path.write_bytes("".join(lines).encode())
    data = path.read_bytes()
    layout = find_splits("custom", path)
    ranges = [layout.splits[s] for s in SPLITS]
    assert all(len(r) == 1 and r[0].path == path for r in ranges)
    cuts = [r[0].start for r in ranges] + [ranges[-1][0].stop()]
    assert cuts[0] == 0 and cuts[-1] == len(data) and cuts[1] < cuts[2] < cuts[3]
    assert [r[0].stop() for r in ranges[:-1]] == cuts[1:3]  # contiguous
    starts = {len("".join(lines[:i]).encode()) for i in range(len(lines))}
    assert cuts[1] in starts and cuts[2] in starts  # at line starts
    assert 0.89 < cuts[1] / len(data) < 0.91 and 0.94 < cuts[2] / len(data) < 0.96
    args = ["--data.path", str(path), "--data.dataset", "custom", "--data.tokenizer", "char"]
    main(["data", "prepare", *args, "--data.cache_dir", str(tmp_path / "cache")])
    report = json.loads(capsys.readouterr().out)
    pieces = zip(SPLITS, cuts[:-1], cuts[1:], strict=True)
    text = {s: data[a:b].decode().replace("\r\n", "\n").replace("\r", "\n") for s, a, b in pieces}
    assert report["kind"] == "char" and report["vocab_size"] == len(set("".join(text.values())))
    assert report["tokens"] == {s: len(text[s]) for s in SPLITS}
    one_line = tmp_path / "short.txt"
    one_line.write_text("a single line of text\n")
    with pytest.raises(DataError, match=rf"^{one_line}: too few lines to hold out valid and test text"):
        find_splits("custom", one_line)


@pytest.mark.parametrize("dataset", ["enwik8", "text8"])
def test_char_dataset_layouts(tmp_path, monkeypatch, dataset):
    monkeypatch.setattr(readers_mod, "HELDOUT_CHARS", 10)
    raw = b"  abc def ghi jkl mno pqr stu  "
    (tmp_path / dataset).write_bytes(raw)
    layout = find_splits(dataset, tmp_path / dataset)  # the raw file, last 10 / 10 bytes held out
    spans = {s: (r.start, r.end) for s, [r] in layout.splits.items()}
    if dataset == "enwik8":
        n = len(raw)
        assert spans == {"train": (0, n - 20), "valid": (n - 20, n - 10), "test": (n - 10, n)}
    else:  # text8: each split stripped like prep_text8.py's part.strip()
        parts = {"train": raw[:-20], "valid": raw[-20:-10], "test": raw[-10:]}
        for s, (a, b) in spans.items():
            assert raw[a:b] == parts[s].strip()
    g = tmp_path / "getdata"
    g.mkdir()
    for s in SPLITS:
        (g / f"{s}.txt.raw").write_bytes(b" xy z ")
        (g / f"{s}.txt").write_text("120 121 32 122" if dataset == "enwik8" else "x y _ z")
    layout = find_splits(dataset, g)
    assert all(r.path.name.endswith(".txt.raw") for [r] in layout.splits.values())
    for f in g.glob("*.raw"):
        f.unlink()
    with pytest.raises(DataError, match=f"space-separated format of prep_{dataset}.py"):
        find_splits(dataset, g)


def _lm1b_tree(root, n_train=3, sentences=("a b c", "b c", "c a a b", "a")):
    base = root / readers_mod.LM1B_ROOT
    (base / readers_mod.LM1B_TRAIN).mkdir(parents=True)
    (base / readers_mod.LM1B_HELDOUT).mkdir(parents=True)
    for k in range(n_train):
        lines = [sentences[(k + i) % len(sentences)] for i in range(7 + k)]
        (base / readers_mod.LM1B_TRAIN / f"news.en-{k + 1:05d}-of-00100").write_text("\n".join(lines) + "\n")
    for k in range(3):
        (base / readers_mod.LM1B_HELDOUT / f"news.en.heldout-{k:05d}-of-00050").write_text(f"a b\nc {k}\n")
    (root / readers_mod.LM1B_VOCAB).write_text("<S> 9\n</S> 9\n<UNK> 1\na 5\nb 4\nc 3\n")
    return root


def test_lm1b_layout_valid_shard(tmp_path):
    _lm1b_tree(tmp_path)
    layout = find_splits("lm1b", tmp_path, valid_shard=2)
    assert [r.path.name for r in layout.splits["train"]] == [f"news.en-{k:05d}-of-00100" for k in (1, 2, 3)]
    assert layout.splits["test"][0].path.name.startswith("news.en.heldout-00000")
    assert layout.splits["valid"][0].path.name.startswith("news.en.heldout-00002")
    corpus = _prep(tmp_path, tmp_path, "lm1b", valid_shard=2)
    assert corpus.tokenizer.unk_token == "<UNK>"
    unk, s = corpus.tokenizer.unk_id, corpus.tokenizer.token_to_id("<S>")
    shard = corpus.splits["valid"][0]
    assert [shard.sentence(i).tolist() for i in range(len(shard))] == [[s, 3, 4, s], [s, 5, unk, s]]
    with pytest.raises(DataError, match="valid_shard must be in 0..49"):
        find_splits("lm1b", tmp_path, valid_shard=50)


def test_missing_data_says_how_to_get_it(tmp_path):
    with pytest.raises(DataError, match="txl data get wt103"):
        find_splits("wt103", tmp_path)
    with pytest.raises(DataError, match="no such file or folder"):
        find_splits("wt103", tmp_path / "nope")


# -------------------------------------------------------------------------------------------------- cache
def _shakespeare_like(folder):
    folder.mkdir(exist_ok=True)
    for s, n in [("train", 400), ("valid", 60), ("test", 60)]:
        (folder / f"{s}.txt").write_text("".join(f"Line {i} of {s}: to be or not to be.\n" for i in range(n)))
    return folder


def test_cache_is_reused_then_rebuilt_when_a_source_changes(tmp_path):
    data = _shakespeare_like(tmp_path / "d")
    logs = []
    first = _prep(tmp_path, data, "shakespeare", logs)
    assert any("no cache yet" in m for m in logs)
    assert first.splits["train"].dtype == np.uint8 and isinstance(first.splits["train"], np.memmap)
    assert sorted({p.suffix for p in first.path.iterdir() if p.name != ".lock"}) == [".bin", ".json"]  # no pickle
    logs.clear()
    again = _prep(tmp_path, data, "shakespeare", logs)
    assert logs == [] and np.array_equal(again.splits["valid"], first.splits["valid"])
    with open(data / "valid.txt", "a") as f:
        f.write("a new line!\n")
    with pytest.raises(DataError, match="stale: .*valid.txt changed size"):
        _prep(tmp_path, data, "shakespeare", on_stale="error")
    logs.clear()
    rebuilt = _prep(tmp_path, data, "shakespeare", logs)
    assert any("rebuilding" in m and "valid.txt changed" in m for m in logs)
    assert len(rebuilt.splits["valid"]) == len(first.splits["valid"]) + len("a new line!\n")


def test_cache_same_size_edit_and_settings_change_are_detected(tmp_path):
    data = _shakespeare_like(tmp_path / "d")
    _prep(tmp_path, data, "shakespeare")
    p = data / "test.txt"
    b = bytearray(p.read_bytes())
    b[3] = ord("X")  # same size, new content, new mtime
    p.write_bytes(bytes(b))
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    with pytest.raises(DataError, match=r"test.txt changed \(sha256\)"):
        _prep(tmp_path, data, "shakespeare", on_stale="error")
    _prep(tmp_path, data, "shakespeare")
    with pytest.raises(DataError, match=r"settings changed \(kind, line_end"):
        _prep(tmp_path, data, "shakespeare", tokenizer="word", on_stale="error")


@pytest.mark.parametrize("damage", ["flip", "truncate", "tokenizer", "no-meta", "meta-garbage"])
def test_corrupt_or_unfinished_cache_is_never_used(tmp_path, damage):
    data = _shakespeare_like(tmp_path / "d")
    good = _prep(tmp_path, data, "shakespeare")
    want = np.array(good.splits["train"])
    folder = good.path
    del good
    if damage == "flip":
        arr = bytearray((folder / "train.bin").read_bytes())
        arr[100] ^= 1
        (folder / "train.bin").write_bytes(bytes(arr))
    elif damage == "truncate":
        with open(folder / "train.bin", "r+b") as f:
            f.truncate(50)
    elif damage == "tokenizer":
        tj = json.loads((folder / "tokenizer.json").read_text())
        tj["model"]["vocab"] = dict(reversed(list(tj["model"]["vocab"].items())))
        (folder / "tokenizer.json").write_text(json.dumps(tj))
    elif damage == "no-meta":
        (folder / "meta.json").unlink()
    else:
        (folder / "meta.json").write_text("{not json")
    if damage != "no-meta":
        with pytest.raises(DataError, match="stale"):
            _prep(tmp_path, data, "shakespeare", on_stale="error")
    logs = []
    fixed = _prep(tmp_path, data, "shakespeare", logs)
    assert np.array_equal(fixed.splits["train"], want)
    assert logs and ("rebuilding" in logs[0] or "did not finish" in logs[0])


# ---------------------------------------------------------------------------------------------- iterators
@pytest.mark.parametrize("bsz,bptt,ext", [(4, 7, 0), (3, 5, 2), (1, 50, 0)])
def test_ordered_iterator_equals_reference_batchify(bsz, bptt, ext):
    data = np.arange(1000, 1000 + 203, dtype=np.uint16)
    ours = [(b.input.tolist(), b.target.tolist()) for b in OrderedIterator(data, bsz, bptt, ext_len=ext)]
    ref = list(ref_ordered_batches(data.tolist(), bsz, bptt, ext))
    assert ours == ref and len(OrderedIterator(data, bsz, bptt)) == len(ref)


@pytest.mark.parametrize("varlen", [False, True])
def test_ordered_state_restore_gives_identical_next_batches(varlen):
    data = np.random.default_rng(0).integers(0, 50, size=3000).astype(np.uint8)
    make = lambda: OrderedIterator(data, 4, 16, varlen=varlen, seed=7)  # noqa: E731
    one_epoch = list(make())
    gen = make().forever()
    full = [next(gen) for _ in range(2 * len(one_epoch) + 3)]  # into the third epoch
    assert [b.epoch for b in full].count(0) == len(one_epoch)
    if varlen:
        lens = [b.seq_len for b in one_epoch[:-1]]  # the last one is cut by the end of the text
        assert len(set(lens)) > 3 and min(lens) >= 5 and max(lens) <= 16 + 15 and 8 in lens
    for cut in (0, 5, len(one_epoch) - 1, len(one_epoch), len(one_epoch) + 1, len(full) - 1):
        it2 = make()
        g2 = it2.forever()
        for _ in range(cut):
            next(g2)
        state = json.loads(json.dumps(it2.state_dict()))  # survives JSON
        it3 = make()
        it3.load_state_dict(state)
        g3 = it3.forever()
        for want in full[cut:]:
            got = next(g3)
            assert torch.equal(got.input, want.input) and torch.equal(got.target, want.target)
            assert (got.epoch, got.index) == (want.epoch, want.index)


def test_ordered_state_mismatch_is_an_error():
    it = OrderedIterator(np.arange(100), 2, 5)
    with pytest.raises(DataError, match="batch_size=2"):
        OrderedIterator(np.arange(100), 4, 5).load_state_dict(it.state_dict())


@pytest.mark.parametrize("world", [2, 4])
def test_rank_sharding_partitions_the_global_batch(world):
    data = np.arange(5000) % 997
    glob = list(OrderedIterator(data, 8, 10, varlen=True, seed=3))
    shards = [list(OrderedIterator(data, 8, 10, varlen=True, seed=3, rank=r, world_size=world)) for r in range(world)]
    assert all(len(s) == len(glob) for s in shards)
    for k, g in enumerate(glob):
        assert torch.equal(torch.cat([s[k].input for s in shards]), g.input)
        assert torch.equal(torch.cat([s[k].target for s in shards]), g.target)
    with pytest.raises(DataError, match="not divisible"):
        OrderedIterator(data, 6, 10, rank=0, world_size=4)


def _shards():
    from txl.data import SentenceShard

    rng = np.random.default_rng(1)
    out = []
    for _ in range(3):
        sents = [np.concatenate([[0], rng.integers(1, 30, size=rng.integers(0, 9)), [0]]) for _ in range(40)]
        starts = np.concatenate([[0], np.cumsum([len(s) for s in sents])])
        out.append(SentenceShard(np.concatenate(sents), starts))
    return out


def test_sentence_stream_equals_reference_and_restores_exactly():
    shards = _shards()
    ref = list(ref_stream_batches([shards[0].sentence(i).tolist() for i in range(len(shards[0]))], 4, 6))
    ours = list(SentenceStreamIterator(shards[:1], 4, 6, shuffle=False))
    assert [(b.input.tolist(), b.target.tolist()) for b in ours] == ref
    it = SentenceStreamIterator(shards, 4, 6, seed=5)
    full = [b for _ in range(2) for b in it]
    one = SentenceStreamIterator(shards[:1], 4, 6, seed=5)  # one shard: its sentences are reshuffled every epoch
    assert [b.input.tolist() for b in one] != [b.input.tolist() for b in one]
    fixed = SentenceStreamIterator(shards, 4, 6, shuffle=False)
    assert [b.input.tolist() for b in fixed] == [b.input.tolist() for b in fixed]
    for cut in (1, 7, len(full) // 2 + 1):
        it2 = SentenceStreamIterator(shards, 4, 6, seed=5)
        seen = 0
        while seen < cut:
            for _ in it2:
                seen += 1
                if seen == cut:
                    break
        it3 = SentenceStreamIterator(shards, 4, 6, seed=5)
        it3.load_state_dict(json.loads(json.dumps(it2.state_dict())))
        nxt = next(it3.forever())
        assert torch.equal(nxt.input, full[cut].input) and torch.equal(nxt.target, full[cut].target)
    parts = [list(SentenceStreamIterator(shards, 4, 6, seed=5, rank=r, world_size=2)) for r in range(2)]
    first_epoch = full[: len(parts[0])]
    for k, g in enumerate(first_epoch):
        assert torch.equal(torch.cat([parts[0][k].input, parts[1][k].input]), g.input)


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kind", ["char", "word"])
def test_non_utf8_byte_names_file_line_offset_and_replace_works(tmp_path, kind):
    data = _shakespeare_like(tmp_path / "d")
    p = data / "valid.txt"
    p.write_bytes(b"fine line\nsecond \xff line\n")
    with pytest.raises(DataError, match=r"valid.txt:2: invalid UTF-8 byte 0xff at byte offset 17 .*--encoding_errors"):
        _prep(tmp_path, data, "shakespeare", tokenizer=kind)
    corpus = _prep(tmp_path, data, "shakespeare", tokenizer=kind, encoding_errors="replace", vocab_from="all")
    assert "\ufffd" in corpus.tokenizer.decode(corpus.splits["valid"])
    raw = _prep(tmp_path, data, "shakespeare", tokenizer="byte")  # bytes need no decoding
    assert 0xFF in raw.splits["valid"].tolist()


def test_empty_split_and_too_short_corpus(tmp_path):
    data = _shakespeare_like(tmp_path / "d")
    (data / "test.txt").write_text("")
    with pytest.raises(DataError, match="the test split is empty"):
        _prep(tmp_path, data, "shakespeare")
    (data / "test.txt").write_text("abc")
    corpus = _prep(tmp_path, data, "shakespeare")
    with pytest.raises(DataError, match="3 tokens cannot fill 2 columns"):
        OrderedIterator(corpus.splits["test"], 2, 8)


def test_crlf_and_bom_read_like_plain_lf(tmp_path):
    lf = _shakespeare_like(tmp_path / "lf")
    crlf = tmp_path / "crlf"
    crlf.mkdir()
    for s in SPLITS:
        text = (lf / f"{s}.txt").read_bytes()
        (crlf / f"{s}.txt").write_bytes(b"\xef\xbb\xbf" + text.replace(b"\n", b"\r\n"))
    for kind in ("char", "word"):
        a = prepare_corpus(path=str(lf), dataset="shakespeare", tokenizer=kind, cache_dir=str(tmp_path / kind / "a"))
        b = prepare_corpus(path=str(crlf), dataset="shakespeare", tokenizer=kind, cache_dir=str(tmp_path / kind / "b"))
        assert a.tokenizer.symbols == b.tokenizer.symbols
        for s in SPLITS:
            assert np.array_equal(a.splits[s], b.splits[s]), (kind, s)


def test_a_100mb_single_line_is_encoded_in_bounded_memory(tmp_path):
    """text8 is one 100 MB line; preparing it must not hold the line (or its ids) in memory at once."""
    src = tmp_path / "text8"
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    with open(src, "wb") as f:
        for _ in range(25):
            f.write(letters[rng.integers(0, 27, size=4_000_000)].tobytes())
    script = textwrap.dedent(f"""
        import resource, numpy as np
        from txl.data import prepare_corpus
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        c = prepare_corpus(path={str(src)!r}, dataset="text8", cache_dir={str(tmp_path / "c")!r}, log=lambda m: None)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        n = c.n_tokens("train") + c.n_tokens("valid") + c.n_tokens("test")
        print(n, c.tokenizer.vocab_size, (after - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    n_tokens, vocab, grew_mib = map(int, out)
    assert vocab == 27 and 99_999_000 < n_tokens <= 100_000_000
    assert grew_mib < 200, f"peak RSS grew by {grew_mib} MiB while encoding a 100 MB line"
