"""What a client that does not read, sends slowly or leaves can hold in a real `txl serve` process (the attacks of
../shared/research/serve_attack.md, B9, B10 and sv15, with their clients): streams nobody reads stay within their
memory bound and are closed after --stream_timeout; headers and bodies sent a byte at a time are cut off after
--header_timeout / --body_timeout with a 408; an idle connection closes after --keep_alive_timeout; a client that
leaves a score or a whole generation frees its row within a second."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from serve_helpers import start_server
from test_serve_fuzz import rss_mib

STREAM_TIMEOUT, HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE = 6.0, 2.0, 2.0, 2.0
BUFFER_TOKENS = 32
CLIENTS = 16
NEVER_READ_MIB = 48
"""The bound on what CLIENTS streams that are never read add to the server's resident memory (docs/serving.md: a
stream holds at most --stream_buffer_tokens tokens ahead of its client, with their log-probabilities, and its row's
memory; the rest of what it would send is never made)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from train_helpers import run_inprocess

    run = run_inprocess(tmp_path_factory.mktemp("conn"), train__max_steps=3, train__eval_interval=0)
    proc, url = start_server(
        run, "--max_batch", "140", "--max_queue", "140", "--max_prompt_tokens", "4096", "--max_new_tokens", "1024",
        "--stream_timeout", str(STREAM_TIMEOUT), "--header_timeout", str(HEADER_TIMEOUT),
        "--body_timeout", str(BODY_TIMEOUT), "--keep_alive_timeout", str(KEEP_ALIVE),
        "--stream_buffer_tokens", str(BUFFER_TOKENS),
    )  # fmt: skip
    yield proc, url
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    return s


def post(s: socket.socket, path: str, body: dict) -> None:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    s.sendall(head.encode() + data)


def closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the connection within ``seconds`` (and what it sent before)."""
    s.settimeout(0.2)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def idle(url: str, seconds: float = 20.0) -> float:
    """Seconds until /health shows nothing in flight."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if httpx.get(url + "/health").json()["active"] == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"still busy after {seconds} s: {httpx.get(url + '/health').json()}")


def unread_streams(url: str, body: dict, clients: int) -> list[socket.socket]:
    """``clients`` streamed completions whose clients never read (a 4 KiB receive buffer, as the attack's)."""
    out = [connect(url, 4096) for _ in range(clients)]
    for s in out:
        post(s, "/v1/completions", body | {"stream": True})
    return out


def test_streams_nobody_reads_hold_bounded_memory(served):
    """B10: CLIENTS streams of the attack's shape (n 8, logprobs 20, echo, max_tokens 1024) that nobody reads. The
    server's memory stays within the bound and stops growing (before: +5 MiB/s, every token's alternatives kept and
    every chunk queued); the clients leaving frees every row."""
    proc, url = served
    body = {"prompt": "ab cd", "n": 8, "logprobs": 20, "echo": True, "max_tokens": 1024}
    for s in unread_streams(url, body, 2):  # (a warm-up: the allocator's pools reach their size)
        time.sleep(1.5)
        s.close()
    idle(url)
    before = rss_mib(proc.pid)
    clients = unread_streams(url, body, CLIENTS)
    time.sleep(3)
    early = rss_mib(proc.pid) - before
    assert httpx.get(url + "/health").json()["active"] == 8 * CLIENTS
    time.sleep(5)
    late = rss_mib(proc.pid) - before
    assert late < NEVER_READ_MIB, f"{CLIENTS} unread streams grew the server by {late:.0f} MiB"
    # (before the fix it grew by ~25 MiB in these 5 s; on 2 busy cores the last streams still fill their buffers
    # here: 6-7 MiB was seen while the rest of the suite ran beside it, 2026-11-29)
    assert late - early < 12, f"the server kept growing: {early:.0f} -> {late:.0f} MiB in 5 s"
    for s in clients:
        s.close()
    assert idle(url, 10) < 3


def test_a_stream_nobody_reads_is_closed_after_the_stream_timeout(served):
    """Chunks larger than the connection's buffers (the echo of a long prompt with its log-probabilities): the send
    waits, and after --stream_timeout the connection is closed and its rows freed."""
    _, url = served
    idle(url)
    body = {"prompt": "ab cd " * 600, "n": 4, "logprobs": 20, "echo": True, "max_tokens": 1024}
    clients = unread_streams(url, body, 2)
    time.sleep(STREAM_TIMEOUT - 2)
    assert httpx.get(url + "/health").json()["active"] == 8  # (waiting for their clients)
    # (nothing read meanwhile: reading would let the stream go on. The timeout counts from the send that waits, which
    # comes after the echo's log-probabilities are made: ~7 s on a 2-core AVX2 EPYC, 13 s in all before the rows were
    # freed there; without the timeout they are never freed)
    deadline = time.monotonic() + STREAM_TIMEOUT + 30
    while httpx.get(url + "/health").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(url + "/health").json()["active"] == 0  # (cut off, their rows freed)
    for s in clients:
        assert closed_within(s, 5)[0]  # (what was in the buffers, then the end)
    ok = httpx.post(url + "/v1/generate", json={"prompt": "ab", "max_new_tokens": 3}, timeout=30)
    assert ok.status_code == 200


def test_a_slow_reader_gets_every_token(served):
    """A client that reads slowly (its generation waits for it, again and again) still gets the whole stream."""
    _, url = served
    body = {"prompt": "ab cd", "max_new_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        whole = client.post("/v1/generate", json=body | {"stream": False}).json()["token_ids"]
        got = []
        with client.stream("POST", "/v1/generate", json=body) as res:
            for k, line in enumerate(res.iter_lines()):
                if k % 40 == 0:
                    time.sleep(0.3)
                if line.startswith("data: {") and '"token_id"' in line:
                    got.append(json.loads(line[6:])["token_id"])
    assert got == whole


def test_slow_headers_and_bodies_are_cut_off(served):
    _, url = served
    slow_headers = [connect(url) for _ in range(40)]
    for s in slow_headers:
        s.sendall(b"POST /v1/generate HTTP/1.1\r\n")
    slow_body = connect(url)
    slow_body.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    silent = connect(url)  # (connects and sends nothing)
    t0 = time.monotonic()
    for _ in range(3):  # (a byte now and then: each connection keeps trickling)
        time.sleep(0.5)
        for s in slow_headers:
            s.sendall(b"X")
    for s in [*slow_headers, silent]:
        closed, got = closed_within(s, HEADER_TIMEOUT + 2 - (time.monotonic() - t0))
        assert closed and got.startswith(b"HTTP/1.1 408"), got[:80]
    closed, got = closed_within(slow_body, BODY_TIMEOUT + 2)
    assert closed and b"408" in got.split(b"\r\n")[0]
    assert time.monotonic() - t0 < max(HEADER_TIMEOUT, BODY_TIMEOUT) + 2
    assert httpx.get(url + "/health").status_code == 200


def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(served):
    _, url = served
    s = connect(url)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    closed, got = closed_within(s, KEEP_ALIVE + 3)
    assert got.startswith(b"HTTP/1.1 200") and closed
    assert KEEP_ALIVE - 0.5 < time.monotonic() - t0 < KEEP_ALIVE + 2


@pytest.mark.parametrize("what", ["score", "generate"])
def test_a_client_that_leaves_frees_its_row_within_a_second(served, what):
    _, url = served
    idle(url)
    s = connect(url)
    if what == "score":
        post(s, "/v1/score", {"text": "ab cd ef " * 3000, "tgt_len": 4, "mem_len": 4})
    else:
        post(s, "/v1/generate", {"prompt": "ab", "max_new_tokens": 1024})
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").json()["active"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    s.close()
    assert idle(url, 5) < 1.0


def test_head_is_get_without_the_body(served):
    _, url = served
    res = httpx.head(url + "/health")
    assert res.status_code == 200 and res.content == b""


class _Callers:
    """The engine's callers of a test: each generation's tokens, whether it ended, and a caller that takes its tokens
    as they come (``takes``) or never."""

    def __init__(self):
        import collections
        import threading

        self.got, self.gens = collections.defaultdict(list), {}
        self.ended = collections.defaultdict(threading.Event)

    def emit(self, name, takes: bool):
        def f(tok):
            if tok is None:
                self.ended[name].set()
            else:
                self.got[name].append(tok)
                if takes:
                    self.gens[name].took()

        return f


def _engine_model():
    import torch

    from tests.conftest import debug_config
    from txl import TransformerXLLM

    torch.manual_seed(0)
    return TransformerXLLM(debug_config(n_token=40, d_model=16, d_embed=16, n_head=2, d_head=8, d_inner=24,
                                        n_layer=2, mem_len=8)).eval()  # fmt: skip


def test_a_generation_whose_caller_takes_nothing_waits_and_then_gives_the_same_tokens():
    """The engine's backpressure: a generation whose caller has not taken max_unread tokens is parked (its memory
    kept apart, its row freed for others) and makes nothing more; once the caller takes half of them it rejoins the
    batch and goes on with exactly the tokens it gives alone (greedy), and so do the requests beside it."""
    import torch

    from txl.infer.generation import generate
    from txl.serve.engine import Engine, Generation

    model = _engine_model()
    engine = Engine(model, max_batch=4, max_unread=6)
    callers = _Callers()
    got, ended, gens, emit = callers.got, callers.ended, callers.gens, callers.emit

    gens["a"] = Generation([1, 2, 3], 40, emit("a", True), mem_len=8, temperature=0.0)
    gens["b"] = Generation([4, 5], 30, emit("b", False), mem_len=8, temperature=0.0)
    for g in gens.values():
        engine.submit(g)
    assert ended["a"].wait(30)  # (a goes on beside b, which waits)
    time.sleep(0.3)
    assert len(got["b"]) == 6 and gens["b"].unread == 6 and not ended["b"].is_set()
    assert engine.active == 1 and engine.rows == 0  # (parked: its row given to others, up to max_parked of them)
    gens["b"].took(2)  # (not yet half)
    time.sleep(0.3)
    assert len(got["b"]) == 6
    gens["b"].took(1)  # (3 left unread: half of 6)
    deadline = time.monotonic() + 30
    while not ended["b"].is_set():  # (now a caller that keeps up)
        gens["b"].took(gens["b"].unread)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    engine.shutdown()
    for name, prompt, n in (("a", [1, 2, 3], 40), ("b", [4, 5], 30)):
        alone = generate(model, torch.tensor([prompt]), n, temperature=0.0, mem_len=8)[0, len(prompt) :].tolist()
        assert got[name] == alone, name


def test_requests_read_two_ways_are_refused_and_the_connection_closed(served):
    """serve_attack.md B7: with two Authorization headers the last one won; B8: a body framed by both Content-Length
    and Transfer-Encoding was read by its chunks and the bytes after it served as a second request (a proxy reading
    the length would see one). B3: JSON with trailing garbage named a character offset as the field; B5: /docs/
    redirected."""
    _, url = served
    s = connect(url)
    s.sendall(b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n")
    closed, got = closed_within(s, 5)
    assert closed and got.startswith(b"HTTP/1.1 400") and b"two Authorization headers" in got
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b'{"prompt": "ab", "max_new_tokens": 1}'
    s = connect(url)
    s.sendall(
        b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n" + smuggled
    )
    closed, got = closed_within(s, 5)
    assert closed and got.startswith(b"HTTP/1.1 400") and b"Content-Length and Transfer-Encoding" in got
    assert got.count(b"HTTP/1.1") == 1  # (the request after it was never served)
    res = httpx.post(url + "/v1/generate", content=b'{"prompt": "ab"} 42', headers={"Content-Type": "application/json"})
    assert res.status_code == 400 and res.json()["error"]["param"] is None
    assert "not valid JSON" in res.json()["error"]["message"]
    assert httpx.get(url + "/docs/").status_code == 404 and httpx.get(url + "/v1/model/").status_code == 404


@pytest.mark.slow  # (~80 s: the slow reader reads its ~5 MB stream at 320 KB/s)
def test_a_slow_reader_and_normal_clients_share_the_server(tmp_path):
    """Round 5's s1 (a soak): one client reads an n=8 stream (logprobs 20, echo) 16 KB every 0.05 s, and meanwhile
    other clients ask for 5 greedy tokens, one after another. Before, the slow reader's 8 parked generations held all
    8 rows of --max_batch for as long as it read and the plain requests timed out after 70 s; now a parked generation
    gives its row to others, so every plain request is answered within seconds, the slow reader still gets every
    token of its 8 choices, and nothing is left in flight at the end."""
    import threading

    from train_helpers import run_inprocess

    run = run_inprocess(tmp_path, train__max_steps=3, train__eval_interval=0)
    proc, url = start_server(run, "--max_batch", "8", "--max_queue", "16", "--stream_buffer_tokens", "16",
                             "--max_new_tokens", "400", "--max_prompt_tokens", "4096")  # fmt: skip
    try:
        # (the echo of a long prompt with 20 alternatives per token: more than the sockets' buffers hold, so the
        # generations wait for the reader, parked, as the probe's did)
        body = {"prompt": "ab cd " * 300, "n": 8, "logprobs": 20, "echo": True, "max_tokens": 60, "stream": True}
        slow = connect(url, 4096)
        post(slow, "/v1/completions", body)
        received, done = bytearray(), threading.Event()

        def read_slowly():
            slow.settimeout(0.5)
            while not done.is_set():
                try:
                    chunk = slow.recv(16384)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                received.extend(chunk)
                if b"data: [DONE]" in received[-64:]:
                    break
                time.sleep(0.05)
            done.set()

        reader = threading.Thread(target=read_slowly, daemon=True)
        reader.start()
        time.sleep(2)  # (the slow reader's 8 choices are parked by now)
        waits = []
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not done.is_set():
                t0 = time.monotonic()
                res = client.post("/v1/generate", json={"prompt": "ab", "max_new_tokens": 5, "temperature": 0})
                assert res.status_code == 200 and len(res.json()["token_ids"]) == 5, res.text
                waits.append(time.monotonic() - t0)
        assert len(waits) >= 3 and max(waits) < 5, waits  # (before: the first one waited 70 s, then timed out)
        reader.join(timeout=240)
        assert done.is_set(), "the slow reader never got the end of its stream"
        text = bytes(received).decode("utf-8", "replace")
        assert text.count('"finish_reason":"length"') + text.count('"finish_reason": "length"') == 8, text[-2000:]
        assert idle(url, 20) < 20
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("reads", [False, True])
def test_a_new_caller_gets_a_row_when_every_caller_holds_one_and_the_parked_room_is_full(reads):
    """CI's sv20 failure: every running row belonged to a caller holding one, and the parked room (max_parked) was
    full of another caller's n choices; a plain request waited until a running generation ended (8-15 s on CI, bound
    5 s). Now, after fair_wait, one of the parked choices ends (503: "not read" if its caller does not read, "the
    server is full" if it does) so that a running row can be parked for the new caller; that row rejoins later and
    every other generation ends with all its tokens."""
    from txl.serve.engine import Engine, Generation

    engine = Engine(_engine_model(), max_batch=2, max_unread=4, max_parked=2, fair_wait=0.1)
    callers = _Callers()
    got, ended, gens, emit = callers.got, callers.ended, callers.gens, callers.emit
    for i in range(2):  # (one caller's n=2, not read: both park, filling the parked room)
        gens[f"g{i}"] = Generation([1 + i, 2], 50, emit(f"g{i}", False), mem_len=8, temperature=0.0, group="g")
        engine.submit(gens[f"g{i}"])
    deadline = time.monotonic() + 30
    while engine.rows or engine.active < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if reads:  # (its caller now reads: resumable, but no row is free for them)
        for i in range(2):
            gens[f"g{i}"].took(gens[f"g{i}"].unread)
    for name in ("a", "b"):  # (two callers holding one row each, for long)
        gens[name] = Generation([3], 4000, emit(name, True), mem_len=8, temperature=0.0)
        engine.submit(gens[name])
    time.sleep(0.3)
    t0 = time.monotonic()
    gens["c"] = Generation([4, 5], 3, emit("c", True), mem_len=8, temperature=0.0)
    engine.submit(gens["c"])
    assert ended["c"].wait(10) and time.monotonic() - t0 < 2.0, "a new caller waited for a running generation to end"
    assert not (ended["a"].is_set() and ended["b"].is_set())  # (they ran all along: c did not wait for them)
    ended_g = [g for g in ("g0", "g1") if ended[g].is_set()]
    assert len(ended_g) == 1 and gens[ended_g[0]].error_status == 503
    assert ("the server is full" if reads else "had not read") in gens[ended_g[0]].error
    deadline = time.monotonic() + 120
    while not all(ended[n].is_set() for n in ("a", "b", "g0", "g1")):
        for g in ("g0", "g1"):
            gens[g].took(gens[g].unread)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    engine.shutdown()
    assert len(got["a"]) == len(got["b"]) == 4000 and len(got["c"]) == 3
    left = ({"g0", "g1"} - set(ended_g)).pop()
    assert gens[left].finish_reason == "length" and len(got[left]) == 50


def test_parked_generations_give_their_rows_to_others():
    """s1 in the engine: 8 generations whose caller takes nothing fill max_batch 8 and park; a plain request then
    runs at once beside them (before, it waited for as long as they were parked). More parked than max_parked hold
    their rows again; once their caller takes their tokens the parked ones end with the tokens they give alone."""
    import torch

    from txl.infer.generation import generate
    from txl.serve.engine import Engine, Generation

    model = _engine_model()
    engine = Engine(model, max_batch=8, max_unread=4, max_parked=8)
    callers = _Callers()
    got, ended, gens, emit = callers.got, callers.ended, callers.gens, callers.emit

    for i in range(8):
        gens[i] = Generation([1 + i, 2], 20, emit(i, False), mem_len=8, temperature=0.0)
        engine.submit(gens[i])
    deadline = time.monotonic() + 30
    while sum(len(got[i]) for i in range(8)) < 8 * 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert engine.rows == 0 and engine.active == 8  # (all 8 parked: no row held)
    gens[8] = Generation([3, 4, 5], 6, emit(8, True), mem_len=8, temperature=0.0)
    engine.submit(gens[8])
    assert ended[8].wait(10), "a plain request waited behind parked generations"
    engine.max_parked = 0  # (beyond max_parked, parked generations hold their rows again: 8 of 8)
    time.sleep(0.2)
    gens[9] = Generation([6], 3, emit(9, True), mem_len=8, temperature=0.0)
    engine.submit(gens[9])
    time.sleep(0.5)
    assert not ended[9].is_set() and engine.waiting == 1
    engine.max_parked = 8
    assert ended[9].wait(10)
    deadline = time.monotonic() + 60
    while not all(ended[i].is_set() for i in range(8)):  # (now a caller that keeps up)
        for i in range(8):
            gens[i].took(gens[i].unread)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    engine.shutdown()
    for i in list(range(8)) + [8, 9]:
        prompt, n = gens[i].prompt_ids, gens[i].max_new_tokens
        alone = generate(model, torch.tensor([prompt]), n, temperature=0.0, mem_len=8)[0, len(prompt) :].tolist()
        assert got[i] == alone, i
