"""`txl serve` fuzzed from its own OpenAPI schema with Schemathesis: for every endpoint a fixed, seeded number of
generated requests, valid ones and invalid ones (wrong types, out-of-range values, missing and extra fields). Each
must get no 5xx, a status, content type and body as the schema documents them, and an answer within its timeout.
The server is a real `txl serve` process, as users run it."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from serve_helpers import start_server  # noqa: E402

EXAMPLES = 25
"""Generated requests per endpoint and mode (valid, invalid)."""
TIMEOUT = 60
"""Seconds a request may take (the server's limits below keep each one far shorter)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from train_helpers import run_inprocess

    run = run_inprocess(tmp_path_factory.mktemp("fuzz"), train__max_steps=5, train__eval_interval=0)
    limits = ["--max_new_tokens", "32", "--max_prompt_tokens", "64", "--max_score_tokens", "512", "--max_mem_len",
              "256", "--max_tgt_len", "128", "--max_queue", "8"]  # fmt: skip
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


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_every_endpoint_answers_as_its_schema_says(served, mode):
    failures, tried = [], 0
    for op in operations(served):
        if mode == GenerationMode.NEGATIVE and not op.get_request_payload_content_types():
            continue  # (an endpoint that takes nothing has no invalid input)
        tried += 1

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def check(case):
            # positive_data_acceptance is left out: a request the schema allows may still be refused (400) for what
            # only the model knows, e.g. characters outside its vocabulary or more prompt tokens than the limit.
            case.call_and_validate(
                base_url=served, timeout=TIMEOUT, excluded_checks=[schemathesis.checks.positive_data_acceptance]
            )

        try:
            check()
        except Exception as e:  # (every endpoint is tried; the failures are reported together)
            failures.append(f"{op.label}: {e}")
    assert tried >= 5 and not failures, "\n\n".join(failures)
