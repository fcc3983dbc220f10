"""`txl serve` against hostile and unlucky clients: each defect found by trying it so is a test of its own (a valid
request that killed the engine, non-finite scores streamed as text, a score's work sized by its settings instead of
its text, --max_batch counted per memory length, engine state read from other threads, SIGTERM under load, errors
OpenAI's clients cannot read, an unknown model accepted, a key in the URL, /docs from a CDN, text edges, a busy
port), and what the server now does instead."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from serve_helpers import error_of, events, free_port, start_server  # noqa: E402
from txl.infer.generation import Penalties, generate  # noqa: E402
from txl.serve.app import ServeLimits, create_app  # noqa: E402
from txl.serve.engine import Engine, Generation  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from train_helpers import run_inprocess

    return run_inprocess(tmp_path_factory.mktemp("robust"), train__max_steps=20, train__eval_interval=0)


@pytest.fixture(scope="module")
def client(run):
    with TestClient(create_app(run, ServeLimits(max_new_tokens=300, max_prompt_tokens=100))) as c:
        yield c


@pytest.fixture()
def model(run):
    from txl import TransformerXLLM
    from txl.train.checkpoint import resolve_model_dir

    return TransformerXLLM.from_pretrained(resolve_model_dir(run)).eval()


def greedy(server, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([server.tokenizer.encode(prompt)])
    return generate(server.model, ids, n, temperature=0.0)[0, ids.shape[1] :].tolist()


def test_beam_search_and_the_library_follow_the_same_rule_for_bans(client, model):
    """serve_attack.md: beam search used to answer 200 with banned tokens once the bans ruled out every token ("K"
    121 times under no_repeat_ngram_size 1; logit_bias -100 on every token generated anyway). Now every mode gives
    the same 400, through the server and in the library (NoTokenLeftError), and a ban that leaves some tokens is
    obeyed by every beam."""
    from txl.infer.generation import NoTokenLeftError, beam_search, stream

    body = {"prompt": "ab cd", "max_new_tokens": 300, "no_repeat_ngram_size": 1, "num_beams": 3, "temperature": 0}
    res = client.post("/v1/generate", json=body)
    assert res.status_code == 400 and "no token is left for new token" in error_of(res), res.text
    everything = {str(i): -100 for i in range(model.config.n_token)}  # (sv4: -100 on every token)
    res = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5, "logit_bias": everything})
    assert res.status_code == 400 and "no token is left" in error_of(res), res.text
    ids = torch.tensor([[1, 2]])
    for run in (
        lambda: beam_search(model, ids, 300, num_beams=3, penalties=Penalties(no_repeat_ngram_size=1), mem_len=16),
        lambda: list(stream(model, ids, 300, temperature=0.0, penalties=Penalties(no_repeat_ngram_size=1), mem_len=16)),
        lambda: list(stream(model, ids, 300, temperature=1.0, penalties=Penalties(no_repeat_ngram_size=1), mem_len=16)),
    ):
        with pytest.raises(NoTokenLeftError, match="no token is left"):
            run()
    n = model.config.n_token
    out = beam_search(model, ids, n - 2, num_beams=3, penalties=Penalties(no_repeat_ngram_size=1), mem_len=16)
    new = out[0, 2:].tolist()
    assert len(new) == len(set(new)) and not {1, 2} & set(new)  # (every token once, the ban obeyed to the end)


def test_penalties_that_leave_no_token_end_that_request_alone(client, model):
    """no_repeat_ngram_size 1 with sampling: once every symbol has occurred no token is left. That used to raise in
    the engine's thread, which died: the request and every later one hung while /health said ok. Now the request ends
    with an error (a 400: it asked for the impossible) and the engine serves the next one."""
    server = client.app.state.server
    engine = Engine(model, max_batch=2)
    done, got = threading.Semaphore(0), []
    request = Generation(
        [1, 2], 500, lambda t: done.release() if t is None else got.append(t), mem_len=16, temperature=1.0, seed=0,
        penalties=Penalties(no_repeat_ngram_size=1),
    )  # fmt: skip
    engine.submit(request)
    assert done.acquire(timeout=60), "the request never ended: the engine's thread died"
    assert request.finish_reason == "error" and request.error_status == 400 and "no token is left" in request.error
    assert len(got) == len(set(got)) and len(set(got) | {1, 2}) == model.config.n_token  # (each symbol once)
    after = Generation([1, 2], 5, lambda t: done.release() if t is None else None, mem_len=16, temperature=0.0)
    engine.submit(after)
    assert done.acquire(timeout=60) and after.finish_reason == "length"
    engine.shutdown()

    body = {"prompt": "ab cd", "max_new_tokens": 300, "temperature": 1.0, "seed": 3, "no_repeat_ngram_size": 1}
    final = events(client, body)[-1]  # (then data: [DONE], which events() checks)
    assert final["done"] and final["finish_reason"] == "error" and "no token is left" in final["error"]["message"]
    assert final["error"]["type"] == "invalid_request_error" and len(final["token_ids"]) < 300
    assert "no token is left for new token" in error_of(client.post("/v1/generate", json=body))
    greedy_body = body | {"temperature": 0}  # (greedy too: the library's argmax would repeat token 0)
    assert "no token is left" in error_of(client.post("/v1/generate", json=greedy_body))
    with client.stream(
        "POST",
        "/v1/completions",
        json={"prompt": "ab", "max_tokens": 300, "stream": True, "logit_bias": {str(i): -100 for i in range(3)}},
    ) as res:
        assert res.status_code == 200  # (-100 is not -inf: a biased token can still come)
    assert client.get("/health").json()["status"] == "ok" and server.engine._thread.is_alive()
    fresh = client.post("/v1/generate", json={"prompt": "ab cd", "max_new_tokens": 20, "temperature": 0}).json()
    assert fresh["token_ids"] == greedy(server, "ab cd", 20)


def test_non_finite_log_probabilities_end_the_request_with_an_error(run):
    """A model that gives NaN: the request ends with an error naming it (no tokens streamed as text with
    finish_reason length), on every endpoint; the server goes on."""
    app = create_app(run)
    model = app.state.server.model
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with TestClient(app) as c:
        body = {"prompt": "ab cd", "max_new_tokens": 20, "temperature": 0}
        healthy = c.post("/v1/generate", json=body).json()["token_ids"]
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        try:
            final = events(c, body)[-1]
            assert final["finish_reason"] == "error" and final["token_ids"] == []
            assert "non-finite log-probabilities for new token 1" in final["error"]["message"]
            assert "non-finite" in error_of(c.post("/v1/generate", json=body), 500)
            assert "non-finite losses" in error_of(c.post("/v1/score", json={"text": "ab cd ef"}), 500)
            with c.stream("POST", "/v1/completions", json={"prompt": "ab", "stream": True}) as res:
                lines = [x[6:] for x in res.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]" and "non-finite" in json.loads(lines[-2])["error"]["message"]
            beam = c.post("/v1/generate", json=body | {"num_beams": 2})
            assert beam.status_code == 500 or beam.json()["finish_reason"] == "length"  # (no crash either way)
        finally:
            model.load_state_dict(saved)
        assert c.get("/health").json()["status"] == "ok"
        assert c.post("/v1/generate", json=body).json()["token_ids"] == healthy


def test_score_work_comes_from_the_text_and_runs_beside_generations(client, model, monkeypatch):
    """/v1/score with a huge tgt_len used to size its K/V cache from tgt_len (a 2-token text with tgt_len 10,000,000
    asked for ~229 GiB) and ran whole on the engine's thread. Now tgt_len and mem_len are bounded by the server's
    limits, the cache by the text (the same result as the settings asked for), and a long score runs one segment
    per engine step: a generation sent meanwhile ends first."""
    import txl.infer.evaluate
    from txl.infer.evaluate import evaluate, evaluate_steps

    server = client.app.state.server
    assert "tgt_len: 10000000 is more than the limit 2048" in error_of(
        client.post("/v1/score", json={"text": "ab", "tgt_len": 10_000_000})
    )
    assert "mem_len: 100000 is more than the limit 8192" in error_of(
        client.post("/v1/score", json={"text": "ab", "mem_len": 100_000})
    )
    text = "ab cd ef gh ij kl"
    ids = np.asarray(server.tokenizer.encode(text))
    settings = {"tgt_len": 2000, "mem_len": 8000, "clamp_len": -1, "same_length": True}
    expected = evaluate(server.model, ids, batch_size=1, **settings).loss
    sizes, real = [], txl.infer.evaluate.KVCache

    def sized(config, batch, mem_len, max_segment=1, **kw):
        sizes.append((mem_len, max_segment))
        return real(config, batch, mem_len, max_segment, **kw)

    monkeypatch.setattr(txl.infer.evaluate, "KVCache", sized)
    res = client.post("/v1/score", json={"text": text} | settings).json()
    assert sizes == [(len(ids) - 1, len(ids) - 1)]  # (not 8,000 + 2,000 positions per layer)
    assert res["loss"] == pytest.approx(expected, abs=1e-6) and res["settings"]["tgt_len"] == 2000
    monkeypatch.undo()

    engine = Engine(model, max_batch=4)
    order, done = [], threading.Event()
    long_text = np.random.default_rng(0).integers(0, model.config.n_token, 3000)

    def scoring():
        steps = evaluate_steps(model, long_text, batch_size=1, tgt_len=8, mem_len=16)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value
            order.append("segment")
            yield

    future = engine.call_steps(scoring)
    while not order:
        time.sleep(0.001)
    engine.submit(Generation([1, 2], 10, lambda t: done.set() if t is None else order.append("token"), mem_len=8,
                             temperature=0.0))  # fmt: skip
    assert done.wait(60) and not future.done()  # the generation ended while the score ran on
    first = order.index("token")
    assert order[first : first + 20].count("segment") <= 11  # (one segment per step, not the whole score between)
    assert future.result(timeout=120).tokens == len(long_text) - 1
    engine.shutdown()


def test_max_batch_counts_rows_across_memory_lengths(model):
    """Batches are kept per memory length, which the client chooses: 8 requests with 8 memory lengths used to run
    as 8 batches at once even with max_batch 2. Now at most max_batch requests run at once, whatever their memory
    lengths, the others wait their turn, and each still gets the tokens it gets alone."""
    engine = Engine(model, max_batch=2, max_queue=16)
    running, peak, lock = set(), [0], threading.Lock()
    got = {k: [] for k in range(8)}
    done = threading.Semaphore(0)

    def emit(k):
        def f(t):
            with lock:
                if t is None:
                    running.discard(k)
                    done.release()
                else:
                    running.add(k)
                    got[k].append(t)
                    peak[0] = max(peak[0], len(running))

        return f

    for k in range(8):
        engine.submit(Generation([1, 2, 3], 12, emit(k), mem_len=4 + k, temperature=0.0))
    for _ in range(8):
        assert done.acquire(timeout=60)
    engine.shutdown()
    assert peak[0] == 2
    for k in range(8):
        alone = generate(model, torch.tensor([[1, 2, 3]]), 12, temperature=0.0, mem_len=4 + k)[0, 3:].tolist()
        assert got[k] == alone


class EngineOnly(dict):
    """A dict that only the engine's thread may read or change (the engine's batches)."""

    def _check(self) -> None:
        assert threading.current_thread().name == "txl-engine", f"read from {threading.current_thread().name}"

    for _name in ("__iter__", "__len__", "__getitem__", "__setitem__", "__delitem__", "get", "values", "items",
                  "keys", "pop", "__contains__"):  # fmt: skip
        locals()[_name] = (lambda name: lambda self, *a, **k: (self._check(), getattr(dict, name)(self, *a, **k))[1])(
            _name
        )


def test_engine_state_is_read_only_on_its_thread(client):
    """/health and request admission read the engine's counts while its thread adds and removes batches: they used
    to iterate its batches without the lock (a race); now they read counts it publishes under the lock."""
    engine = client.app.state.server.engine
    while engine.active:
        time.sleep(0.01)
    engine._batches = EngineOnly(engine._batches)
    results = []

    def generate_with(mem_len: int) -> None:
        body = {"prompt": "ab cd", "max_new_tokens": 40, "temperature": 0, "mem_len": mem_len}
        results.append(client.post("/v1/generate", json=body).status_code)

    threads = [threading.Thread(target=generate_with, args=(8 + k,)) for k in range(6)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(client.get("/health").json()["active"])
    for t in threads:
        t.join()
    assert results == [200] * 6 and max(seen) >= 1 and client.get("/health").json()["active"] == 0


def test_an_engine_that_dies_is_reported_and_ends_every_request(run, monkeypatch):
    """If the engine's thread fails anyway (outside any one request), the requests waiting get an error, /health
    says so (503) and later requests get 503, instead of hanging."""
    app = create_app(run)
    with TestClient(app) as c:
        engine = app.state.server.engine

        def broken():
            raise RuntimeError("broken admission")

        monkeypatch.setattr(engine, "_admit", broken)
        res = c.post("/v1/generate", json={"prompt": "ab", "max_new_tokens": 5})
        assert "the engine failed (RuntimeError: broken admission)" in error_of(res, 500)
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "broken admission" in health.json()["error"]["message"]
        assert "the engine failed" in error_of(c.post("/v1/generate", json={"prompt": "ab"}), 503)
        assert "the engine failed" in error_of(c.post("/v1/score", json={"text": "ab cd"}), 503)


@pytest.mark.slow
def test_a_server_whose_engine_dies_exits_non_zero(run):
    """`txl serve` whose engine's thread fails exits with code 1 (not a server that hangs while /health says ok)."""
    import subprocess

    import httpx

    from train_helpers import ROOT

    code = (
        "import sys\nfrom txl.serve.engine import Engine\n"
        "def broken(self):\n    raise RuntimeError('broken admission')\n"
        "Engine._admit = broken\nfrom txl.cli import main\nmain(sys.argv[1:])\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--model", str(run), "--port", str(port)],
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        res = httpx.post(url + "/v1/generate", json={"prompt": "ab", "max_new_tokens": 5}, timeout=30)
        assert res.status_code == 500 and "the engine failed" in res.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
        assert "txl serve: stopped: the engine failed (RuntimeError: broken admission)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_under_load_gives_every_client_a_final_event(run):
    """32 streaming clients x 1,000 tokens, then SIGTERM: requests after it get 503; every client gets a final event
    (its text complete, or finish_reason shutdown once the drain timeout has passed) and [DONE]; the exit code is 0;
    the log has no traceback. (It used to admit queued requests after the signal, cut streams without a final event,
    log CancelledError tracebacks and exit 0 all the same.)"""
    import subprocess

    import httpx

    proc, url = start_server(run, "--drain_timeout", "3", "--max_new_tokens", "1000", stderr=subprocess.PIPE, text=True)
    results = {}

    def client(i: int) -> None:
        body = {"prompt": "ab cd", "max_new_tokens": 1000, "seed": i, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/generate", json=body, timeout=120) as res:
                results[i] = (res.status_code, [x[6:] for x in res.iter_lines() if x.startswith("data: ")])
        except Exception as e:  # reported below
            results[i] = (None, repr(e))

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # (every client admitted: 8 running, 24 waiting)
            health = httpx.get(url + "/health").json()
            if health["active"] + health["waiting"] == 32:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            late = httpx.post(url + "/v1/generate", json={"prompt": "ab"}, timeout=10)
            assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
            assert httpx.get(url + "/health").status_code == 503
        except httpx.ConnectError:
            pass  # (already gone: nothing was admitted either)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=60) == 0
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    reasons = []
    for i, (status, lines) in results.items():
        assert status == 200 and lines[-1] == "[DONE]", (i, status, lines if isinstance(lines, str) else lines[-2:])
        final = json.loads(lines[-2])
        assert final["done"] and len(lines) == final["new_tokens"] + 2, i
        reasons.append(final["finish_reason"])
    assert len(results) == 32 and set(reasons) <= {"length", "shutdown"} and "shutdown" in reasons
    assert "Traceback" not in log and "CancelledError" not in log and "shutting down" in log


def test_openai_client_reads_the_errors(client, run):
    """The official openai client against the server: a model name it does not serve is a 404 NotFoundError with
    the server's message, code and param (it used to accept any name and echo it back); temperature beyond OpenAI's
    0-2 is a 400; the served name works."""
    openai = pytest.importorskip("openai")

    api = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="gpt-4", prompt="ab cd", max_tokens=5)
    assert "'gpt-4' is not served here" in e.value.message and e.value.code == "model_not_found"
    assert e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=run.name, prompt="ab cd", max_tokens=5, temperature=5)
    assert "temperature: Input should be less than or equal to 2" in e.value.message and e.value.param == "temperature"
    out = api.completions.create(model=run.name, prompt="ab cd", max_tokens=5, temperature=0)
    assert out.choices[0].text == client.app.state.server.tokenizer.decode(greedy(client.app.state.server, "ab cd", 5))


def test_docs_work_offline_and_errors_have_one_shape(client):
    """/docs is a page of the server's own (FastAPI's fetched Swagger UI from a CDN: blank offline); unknown paths
    and methods, bad JSON and too-large bodies answer in OpenAI's error shape."""
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" not in page.text and "https://" not in page.text and "http://" not in page.text
    assert "POST /v1/generate" in page.text and "max_new_tokens" in page.text and "no_repeat_ngram_size" in page.text
    schema = client.get("/openapi.json").json()
    assert "422" not in schema["paths"]["/v1/generate"]["post"]["responses"]  # (bad bodies are 400s)
    assert {"400", "429", "503"} <= set(schema["paths"]["/v1/generate"]["post"]["responses"])
    fields = schema["components"]["schemas"]["GenerateRequest"]["properties"]  # (the server's limits, documented)
    assert fields["max_new_tokens"]["maximum"] == 300 and fields["stop"]["maxItems"] == 16
    assert "GET /nothing: not found" in error_of(client.get("/nothing"), 404)
    assert "method not allowed" in error_of(client.get("/v1/generate"), 405)
    bad_json = client.post("/v1/generate", content=b"{", headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(bad_json)
    # the types the schema says (found by the fuzzer: true was read as 1): an integer may be written 3.0
    for field, value in [("max_new_tokens", True), ("max_new_tokens", "3"), ("max_new_tokens", 2.5), ("stream", 1),
                         ("prompt_ids", [True])]:  # fmt: skip
        body = {"prompt": None, "prompt_ids": [1, 2]} if field == "prompt_ids" else {"prompt": "ab"}
        assert f"{field}" in error_of(client.post("/v1/generate", json=body | {field: value}))
    whole = client.post("/v1/generate", json={"prompt": "ab", "max_new_tokens": 3.0, "temperature": 0})
    assert whole.status_code == 200 and whole.json()["new_tokens"] == 3
    assert "tokens.0" in error_of(client.post("/detokenize", json={"tokens": [True]}))


def test_body_size_is_bounded(run):
    app = create_app(run, ServeLimits(max_body_bytes=2048))
    with TestClient(app) as c:
        res = c.post("/v1/generate", json={"prompt": "ab " * 2000})
        assert "larger than the server's limit of 2,048 bytes" in error_of(res, 413)
        chunks = (b'{"prompt": "' + b"a" * 1000, b"a" * 1000, b"a" * 1000 + b'"}')  # (chunked: no content-length)
        res = c.post("/v1/score", content=iter(chunks), headers={"content-type": "application/json"})
        assert "max_body_bytes" in error_of(res, 413)
        assert c.post("/v1/generate", json={"prompt": "ab", "max_new_tokens": 3}).status_code == 200


def test_prompts_read_like_training_files(client, run):
    """A prompt or scored text with CRLF line ends reads as with LF (as training files are read); a character
    outside the vocabulary (a tab) is a 400 that names the request field and server option that read it anyway,
    which work."""
    server = client.app.state.server
    lf = client.post("/v1/generate", json={"prompt": "ab\ncd", "max_new_tokens": 10, "temperature": 0}).json()
    for ending in ("\r\n", "\r"):
        crlf = client.post("/v1/generate", json={"prompt": f"ab{ending}cd", "max_new_tokens": 10, "temperature": 0})
        assert crlf.status_code == 200 and crlf.json()["token_ids"] == lf["token_ids"]
    score_lf = client.post("/v1/score", json={"text": "ab\ncd ef"}).json()["loss"]
    assert client.post("/v1/score", json={"text": "ab\r\ncd ef"}).json()["loss"] == score_lf
    with pytest.raises(ValueError):  # (a tab is not in this vocabulary)
        server.tokenizer.encode("\t")
    message = error_of(client.post("/v1/generate", json={"prompt": "ab\tcd"}))
    assert message.startswith("prompt: ") and '"unknown": "replace"' in message and "--unknown replace" in message
    assert "txl tokenize" not in message  # (the library's own advice, which the API does not offer)
    replaced = client.post("/v1/generate", json={"prompt": "ab\tcd", "unknown": "replace", "temperature": 0,
                                                 "max_new_tokens": 10})  # fmt: skip
    spaced = client.post("/v1/generate", json={"prompt": "ab cd", "temperature": 0, "max_new_tokens": 10})
    assert replaced.json()["token_ids"] == spaced.json()["token_ids"]
    assert client.post("/tokenize", json={"prompt": "a\tb", "unknown": "replace"}).json()["count"] == 3
    assert "unknown: Input should be 'error' or 'replace'" in error_of(
        client.post("/v1/score", json={"text": "ab", "unknown": "bogus"})
    )
    with TestClient(create_app(run, unknown="replace")) as c:
        assert c.post("/v1/score", json={"text": "ab\tcd"}).status_code == 200
        assert "not in the vocabulary" in error_of(c.post("/v1/score", json={"text": "ab\tcd", "unknown": "error"}))


def test_cli_port_is_checked_before_anything_is_printed(run, capsys):
    """A busy port used to print the server's URL and then fail; a port out of range was uvicorn's traceback."""
    import socket

    from txl.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--model", str(run), "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "http://" not in err
    assert f"--port {port}: cannot listen there: it is in use (another server?): pick another --port" in err
    assert len(err.strip().splitlines()) == 1
    for args, message in [
        (["--port", "70000"], "--port = 70000: must be in [0, 65535]"),
        (["--max_tgt_len", "0"], "--max_tgt_len = 0: must be >= 1"),
        (["--drain_timeout", "-1"], "--drain_timeout = -1.0: must be >= 0"),
        (["--unknown", "maybe"], "--unknown"),
    ]:
        with pytest.raises(SystemExit):
            main(["serve", "--model", str(run), *args])
        assert message in capsys.readouterr().err


def test_temperatures_beyond_float32_sample_as_the_numbers_allow(client):
    """temperature 5e-324 (found by the fuzzer) is 0 in float32: the scores were divided by zero, sampling raised and
    the request failed with a 500. Now it samples as greedily as the numbers allow: the greedy text."""
    from txl.infer.generation import choose

    log_probs = torch.log_softmax(torch.randn(3, 50), -1)
    assert choose(log_probs, 5e-324, 0, 1.0, torch.Generator().manual_seed(0)).tolist() == log_probs.argmax(-1).tolist()
    body = {"prompt": "ab cd", "max_new_tokens": 20, "temperature": 5e-324, "seed": 1}
    res = client.post("/v1/generate", json=body)
    assert res.status_code == 200 and res.json()["token_ids"] == greedy(client.app.state.server, "ab cd", 20)
    out = client.post("/v1/completions", json={"prompt": "ab cd", "max_tokens": 5, "temperature": 5e-324})
    assert out.status_code == 200
    # and one above float32's largest (also found by the fuzzer): -inf / inf was NaN where a penalty ruled a token out
    huge = body | {"temperature": 1.7e305, "repetition_penalty": 1.5e308, "max_new_tokens": 20}
    assert client.post("/v1/generate", json=huge).status_code == 200


def test_an_ngram_size_longer_than_the_text_bans_nothing(client):
    """no_repeat_ngram_size = (prompt + text so far) + 1 (found by the fuzzer): the n-grams were cut from a shorter
    history (a 500); as in Hugging Face's, a history shorter than n holds no n-gram to repeat."""
    history = torch.tensor([[1, 2, 3, 4]])
    scores = torch.log_softmax(torch.randn(1, 10), -1)
    for n in (5, 6):
        assert torch.equal(Penalties(no_repeat_ngram_size=n).apply(scores, history, 2), scores)
    body = {"prompt": "ab cd", "max_new_tokens": 12, "temperature": 0}
    for n in (6, 7, 11):
        res = client.post("/v1/generate", json=body | {"no_repeat_ngram_size": n})
        assert res.status_code == 200, res.text
    assert res.json()["token_ids"][:5] == greedy(client.app.state.server, "ab cd", 5)  # (nothing banned that early)
