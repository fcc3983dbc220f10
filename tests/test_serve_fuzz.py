"""`txl serve` attacked: fuzzed from its own OpenAPI schema with Schemathesis (for every endpoint a fixed, seeded
number of generated requests, valid ones and invalid ones: wrong types, out-of-range values, missing and extra fields;
each must get no 5xx, a status, content type and body as the schema documents them, and an answer within its
timeout), and soaked (slow: minutes of many concurrent clients mixing valid and invalid requests, streams they leave,
requests that used to kill the engine). The server is a real `txl serve` process, as users run it."""

from __future__ import annotations

import os
import sys
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from serve_helpers import start_server  # noqa: E402

EXAMPLES = 60
"""Generated requests per endpoint and mode (valid, invalid)."""
TIMEOUT = 60
"""Seconds a request may take (the server's limits below keep each one far shorter)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from train_helpers import run_inprocess

    return run_inprocess(tmp_path_factory.mktemp("fuzz"), train__max_steps=5, train__eval_interval=0)


@pytest.fixture(scope="module")
def served(run):
    limits = [
        "--max_new_tokens",
        "32",
        "--max_prompt_tokens",
        "64",
        "--max_score_tokens",
        "512",
        "--max_mem_len",
        "256",
        "--max_tgt_len",
        "128",
        "--max_queue",
        "8",
        "--unknown",
        "replace",
    ]  # fmt: skip  (any generated text is read: the requests reach the engine)
    proc, url = start_server(run, *limits)
    yield url
    proc.terminate()
    assert proc.wait(timeout=60) == 0  # (and it shuts down cleanly after all of it)


def operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_covers_every_endpoint(served):
    labels = {op.label for op in operations(served)}
    assert labels >= {"POST /v1/generate", "POST /v1/completions", "POST /v1/score", "POST /tokenize",
                      "POST /detokenize", "GET /health", "GET /v1/models", "GET /v1/model"}  # fmt: skip


def reach_engine(case):
    """A valid case whose text the model reads (the schema's prompts are mostly empty or both/neither of prompt and
    prompt_ids, which stop at validation): every other field as generated, so the engine sees them all."""
    body = case.body if isinstance(case.body, dict) else {}
    if case.path == "/v1/generate":
        body.pop("prompt_ids", None)
        body["prompt"] = (body.get("prompt") or "") + "ab cd"
    elif case.path == "/v1/score":
        body.pop("ids", None)
        body["text"] = (body.get("text") or "") + "ab cd"
    elif case.path == "/v1/completions":
        body["prompt"], body["model"] = "ab cd", "txl"
        for refused in ("suffix", "best_of"):
            body.pop(refused, None)
    case.body = body
    return case


@pytest.mark.parametrize("mode", ["valid", "invalid", "engine"])
def test_every_endpoint_answers_as_its_schema_says(served, mode):
    """valid and invalid: requests as the schema allows and as it does not, on every endpoint; engine: valid
    requests to the endpoints that run the model, their text made one the model reads (most of them then run)."""
    failures, tried, statuses = [], 0, []
    for op in operations(served):
        if mode == "invalid" and not op.get_request_payload_content_types():
            continue  # (an endpoint that takes nothing has no invalid input)
        if mode == "engine" and op.path not in ("/v1/generate", "/v1/score", "/v1/completions"):
            continue
        tried += 1
        strategy = op.as_strategy(generation_mode=GenerationMode.NEGATIVE if mode == "invalid" else
                                  GenerationMode.POSITIVE)  # fmt: skip
        if mode == "engine":
            strategy = strategy.map(reach_engine)

        @given(case=strategy)
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def check(case):
            # positive_data_acceptance is left out: a request the schema allows may still be refused (400) for what
            # only the model knows, e.g. characters outside its vocabulary or more prompt tokens than the limit.
            response = case.call_and_validate(
                base_url=served, timeout=TIMEOUT, excluded_checks=[schemathesis.checks.positive_data_acceptance]
            )
            statuses.append(response.status_code)

        try:
            check()
        except Exception as e:  # (every endpoint is tried; the failures are reported together)
            failures.append(f"{op.label}: {e}")
    assert tried >= 3 and not failures, "\n\n".join(failures)
    if mode == "engine":  # (the model really ran for most of them)
        assert statuses.count(200) > len(statuses) / 3, sorted(statuses)


SOAK_SECONDS = float(os.environ.get("TXL_SOAK_SECONDS", "120"))
SOAK_CLIENTS = 24
RSS_GROWTH_MIB = 150
"""How much the server's resident memory may grow over the soak, after a warm-up (caches, allocator pools)."""


def rss_mib(pid: int) -> float:
    status = open(f"/proc/{pid}/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


@pytest.mark.slow
def test_soak_many_clients_mixing_valid_and_invalid_requests(run):
    """SOAK_SECONDS of SOAK_CLIENTS concurrent clients (benchmarks/serve_load.py's soak mix): streamed and JSON
    generations, streams left after a few events, invalid requests, generations whose penalties leave no token (the
    request that used to kill the engine), scores, streamed completions. No 5xx, no transport error, every stream that
    was not left ends with its final event and [DONE], every error in OpenAI's shape; afterwards /health is ok with
    nothing running, a greedy request gives the tokens it gave before, and the server's memory grew by less than
    RSS_GROWTH_MIB."""
    import httpx

    from train_helpers import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from serve_load import SOAK_KINDS, soak_mix
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    proc, url = start_server(run, "--max_batch", "8", "--max_queue", "32", "--max_new_tokens", "300")
    try:
        body = {"prompt": "ab cd", "max_new_tokens": 50, "temperature": 0}
        before = httpx.post(url + "/v1/generate", json=body, timeout=60).json()["token_ids"]
        assert not soak_mix(url, 4, 5)["problems"]  # (a warm-up: caches and allocator pools reach their size)
        rss_before = rss_mib(proc.pid)
        result = soak_mix(url, SOAK_CLIENTS, SOAK_SECONDS, seed=1)
        assert not result["problems"], result["problems"][:10]
        counts = result["counts"]
        assert {k.split()[0] for k in counts} == set(SOAK_KINDS), counts
        assert counts.get("no_token_left error invalid_request_error", 0) > 0 and counts.get("vanish left", 0) > 0
        assert counts.get("invalid 400", 0) > 0 and counts.get("invalid 404", 0) > 0 and result["requests"] > 200
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(url + "/health").json() == {"status": "ok", "active": 0, "waiting": 0}
        assert httpx.post(url + "/v1/generate", json=body, timeout=60).json()["token_ids"] == before
        growth = rss_mib(proc.pid) - rss_before
        assert growth < RSS_GROWTH_MIB, f"RSS grew by {growth:.0f} MiB over the soak"
        print(f"soak: {result['requests']} requests in {SOAK_SECONDS:g} s, RSS growth {growth:.1f} MiB, {counts}")
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
