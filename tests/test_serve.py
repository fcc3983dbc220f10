"""`txl serve`: every endpoint through an in-process client on a tiny trained model, the batching engine against
generation alone, bad input, limits and the API key; a real server under concurrent clients and SIGTERM (slow)."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from serve_helpers import error_of, events, start_server  # noqa: E402
from txl.infer.generation import generate  # noqa: E402
from txl.serve.app import ServeLimits, create_app  # noqa: E402
from txl.serve.engine import Engine, Generation, QueueFull  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from train_helpers import run_inprocess

    return run_inprocess(tmp_path_factory.mktemp("serve"), train__max_steps=20, train__eval_interval=0)


@pytest.fixture(scope="module")
def client(run):
    with TestClient(create_app(run, ServeLimits(max_new_tokens=200, max_prompt_tokens=50))) as c:
        yield c


def test_health_model_and_page(client, run):
    assert client.get("/health").json() == {"status": "ok", "active": 0, "waiting": 0}
    info = client.get("/v1/model").json()
    model = client.app.state.server.model
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["config"]["n_layer"] == 2 and info["tokenizer"]["kind"] == "char" and info["metric"] == "bpc"
    assert info["training_metrics"]["train"]["step"] == 20
    page = client.get("/")
    assert (
        page.status_code == 200
        and '<button id="generate">' in page.text
        and "http" not in page.text.split("<script>")[0].replace("http-equiv", "")
    )  # no asset fetched from elsewhere
    assert client.get("/openapi.json").json()["paths"].keys() >= {"/v1/generate", "/v1/score", "/v1/model"}


def test_generate_equals_the_library_and_is_deterministic(client):
    server = client.app.state.server
    prompt = "ab cd"
    greedy = client.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 30, "temperature": 0}).json()
    ids = torch.tensor([server.tokenizer.encode(prompt)])
    expected = generate(server.model, ids, 30, temperature=0.0)[0, ids.shape[1] :].tolist()
    assert greedy["token_ids"] == expected and greedy["finish_reason"] == "length"
    assert greedy["text"] == server.tokenizer.decode(expected)
    body = {"prompt": prompt, "max_new_tokens": 40, "seed": 7, "temperature": 1.0}
    a, b = (client.post("/v1/generate", json=body).json() for _ in range(2))
    c = client.post("/v1/generate", json=body | {"seed": 8}).json()
    assert a["token_ids"] == b["token_ids"] and a["token_ids"] != c["token_ids"]
    stream = events(client, body)
    assert [e["token_id"] for e in stream[:-1]] == a["token_ids"]  # the same tokens, in order, each once
    assert "".join(e["text"] for e in stream[:-1]) == a["text"] == stream[-1]["text"]
    assert stream[-1]["done"] and stream[-1]["new_tokens"] == 40 and stream[-1]["tokens_per_s"] > 0
    by_ids = client.post("/v1/generate", json=body | {"prompt": None, "prompt_ids": ids[0].tolist()}).json()
    assert by_ids["token_ids"] == a["token_ids"]


def test_stop_strings_end_the_text_before_them(client):
    base = {"prompt": "ab cd", "max_new_tokens": 60, "temperature": 0}
    full = client.post("/v1/generate", json=base).json()["text"]
    stop = full[10:13]  # a string that the greedy text contains
    cut = full.index(stop)
    res = client.post("/v1/generate", json=base | {"stop": [stop, "@@"]}).json()
    assert res["text"] == full[:cut] and res["finish_reason"] == "stop"
    stream = events(client, base | {"stop": [stop]})
    assert "".join(e["text"] for e in stream[:-1]) == full[:cut] == stream[-1]["text"]
    assert stream[-1]["finish_reason"] == "stop"


def test_beam_search_equals_the_library_and_leaves_other_requests_alone(client):
    """num_beams > 1: the best beam of txl.infer.generation.beam_search (and not the greedy text), streamed as the same
    tokens, cut before a stop string; a greedy request sent meanwhile still gets its own tokens."""
    from txl.infer.generation import beam_search

    server = client.app.state.server
    base = {"prompt": "ab cd", "max_new_tokens": 30, "temperature": 0}
    ids = torch.tensor([server.tokenizer.encode("ab cd")])
    with torch.no_grad():
        best = beam_search(server.model, ids, 30, num_beams=4, length_penalty=0.5)[0, ids.shape[1] :].tolist()
    greedy = client.post("/v1/generate", json=base).json()
    results = {}

    def greedy_meanwhile():
        results["greedy"] = client.post("/v1/generate", json=base | {"max_new_tokens": 60}).json()

    side = threading.Thread(target=greedy_meanwhile)
    side.start()
    beam = client.post("/v1/generate", json=base | {"num_beams": 4, "length_penalty": 0.5}).json()
    side.join(timeout=60)
    assert beam["token_ids"] == best and beam["finish_reason"] == "length" and len(best) == 30
    assert beam["text"] == server.tokenizer.decode(best)
    assert results["greedy"]["token_ids"][:30] == greedy["token_ids"]
    assert best != greedy["token_ids"]  # (the search found another text than greedy decoding)
    stream = events(client, base | {"num_beams": 4, "length_penalty": 0.5})
    assert [e["token_id"] for e in stream[:-1]] == best and stream[-1]["text"] == beam["text"]
    stop = beam["text"][8:11]
    cut = client.post("/v1/generate", json=base | {"num_beams": 4, "length_penalty": 0.5, "stop": [stop]}).json()
    assert cut["text"] == beam["text"][: beam["text"].index(stop)] and cut["finish_reason"] == "stop"
    for body, message in [
        ({"num_beams": 2, "temperature": 0.7}, "num_beams: beam search finds the likeliest text: give temperature 0"),
        ({"num_beams": 9}, "num_beams: 9 is more than the server's max_batch 8"),
        ({"num_beams": 0}, "num_beams: Input should be greater than or equal to 1"),
    ]:
        res = client.post("/v1/generate", json=base | body)
        assert message in error_of(res), res.json()


def test_openai_completions_equal_txl_generate(client, run):
    """OpenAI's completions API as its clients send it: the same tokens as /v1/generate, its response layout and
    usage, the stream's chunks ending with [DONE], stop as a string, echo, token-id prompts; fields txl cannot honour
    are refused by name, fields of the client's own ignored."""
    base = {"prompt": "ab cd", "max_new_tokens": 30, "temperature": 0}
    ours = client.post("/v1/generate", json=base).json()
    body = {"model": run.name, "prompt": "ab cd", "max_tokens": 30, "temperature": 0, "user": "u1", "n": 1}
    res = client.post("/v1/completions", json=body | {"logit_bias": {}, "some_client_field": 3})
    assert res.status_code == 200, res.text
    out = res.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == run.name
    assert client.post("/v1/completions", json=body | {"model": "txl"}).json()["model"] == "txl"  # (the alias)
    assert out["choices"] == [{"text": ours["text"], "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert out["usage"] == {"prompt_tokens": ours["prompt_tokens"], "completion_tokens": 30, "total_tokens": 30 + 5}
    assert (
        client.post("/v1/completions", json={"prompt": "ab cd", "temperature": 0}).json()["usage"]["completion_tokens"]
        == 16
    )  # OpenAI's default max_tokens
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
        lines = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ours["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 30
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]) and len({c["id"] for c in chunks}) == 1
    stop = ours["text"][10:13]
    cut = client.post("/v1/completions", json=body | {"stop": stop}).json()["choices"][0]
    assert cut["text"] == ours["text"][: ours["text"].index(stop)] and cut["finish_reason"] == "stop"
    echoed = client.post("/v1/completions", json=body | {"echo": True}).json()["choices"][0]["text"]
    assert echoed == "ab cd" + ours["text"]
    ids = client.app.state.server.tokenizer.encode("ab cd")
    for prompt in (ids, [ids], ["ab cd"]):
        assert (
            client.post("/v1/completions", json=body | {"prompt": prompt}).json()["choices"][0]["text"] == ours["text"]
        )
    assert client.get("/v1/models").json()["data"] == [
        {"id": run.name, "object": "model", "created": 0, "owned_by": "txl"}
    ]
    for field, value, message in [
        ("best_of", 3, "best_of: not supported (give n"),
        ("logprobs", 21, "logprobs: Input should be less than or equal to 20"),
        ("n", 0, "n: Input should be greater than or equal to 1"),
        ("n", 65, "65 completions, more than the server's max_queue of 64"),
        ("presence_penalty", 3, "presence_penalty: Input should be less than or equal to 2"),
        ("logit_bias", {"10000": 1}, "logit_bias: token ids must be in [0, "),
        ("logit_bias", {"1": 200}, "logit_bias: a bias must be in [-100, 100]"),
        ("logit_bias", {"a": 1}, "logit_bias.a.[key]: Input should be a valid integer"),
        ("prompt", [1, 10_000], "prompt: ids must be in [0,"),
        ("prompt", [[1], [1, 10_000]], "prompt[1]: ids must be in [0,"),
        ("max_tokens", 10_000, "max_tokens: 10000 is more than the limit 200"),
        ("temperature", 2.5, "temperature: Input should be less than or equal to 2"),  # (OpenAI's range, 0 to 2)
        ("stop", ["x"] * 17, "stop: 17 stop strings, more than the limit of 16"),
        ("stop", "x" * 300, "stop: a stop string of 300 characters, more than the limit 256"),
        ("n", 129, "n: n = 129 with 1 prompt(s) is 129 completions, more than the server's max_queue of 64"),
    ]:
        res = client.post("/v1/completions", json=body | {field: value})
        assert message in error_of(res), (field, res.text)
        param = res.json()["error"]["param"]
        assert param.split(".")[0].split("[")[0] == field, res.json()
    res = client.post("/v1/completions", json=body | {"model": "gpt-4"})  # (not echoed back as if served)
    assert "'gpt-4' is not served here" in error_of(res, 404) and res.json()["error"]["code"] == "model_not_found"


def completion(client, body: dict) -> dict:
    res = client.post("/v1/completions", json=body)
    assert res.status_code == 200, res.text
    return res.json()


def streamed_choices(client, body: dict) -> tuple[dict[int, list[dict]], dict]:
    """The chunks of a streamed completion by choice index, and the last chunk (with the usage)."""
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as res:
        lines = [line[6:] for line in res.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        (ch,) = c["choices"]
        by_index.setdefault(ch["index"], []).append(ch)
    return by_index, chunks[-1]


def test_openai_logprobs_are_the_models(client):
    """logprobs: each token's log-probability and its most likely alternatives (the token itself among them), the
    model's own (one forward pass over prompt and completion); with echo the prompt's tokens' too (the first has
    none); tokens that join into the text with offsets into it; only the text's tokens when a stop string cuts it;
    echo with max_tokens 0 scores the prompt alone; streamed chunks carry the same entries."""
    server = client.app.state.server
    tok, model = server.tokenizer, server.model
    prompt = "ab cd"
    new = client.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 8, "temperature": 0}).json()
    ids = tok.encode(prompt) + new["token_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids]), return_log_probs=True).log_probs[0, :-1]  # [T - 1, V]: t predicts t + 1
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3, "echo": True}
    (choice,) = completion(client, body)["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == prompt + new["text"] and "".join(lp["tokens"]) == choice["text"]
    assert lp["tokens"] == [tok.decode([i]) for i in ids]
    assert lp["text_offset"] == [len(tok.decode(ids[:k])) for k in range(len(ids))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = expected.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-4)
    for t, top in enumerate(lp["top_logprobs"][1:]):
        best = expected[t].topk(3)
        keys = [tok.decode([i]) for i in best.indices.tolist()]
        assert list(top)[:3] == keys and torch.allclose(torch.tensor(list(top.values())[:3]), best.values, atol=1e-4)
        assert top[lp["tokens"][t + 1]] == pytest.approx(lp["token_logprobs"][t + 1], abs=1e-6)
    n_prompt = len(tok.encode(prompt))
    for t in range(n_prompt, len(ids)):  # greedy: each new token is its place's most likely one
        assert lp["token_logprobs"][t] == pytest.approx(max(lp["top_logprobs"][t].values()), abs=1e-6)
    plain = completion(client, body | {"echo": False})["choices"][0]["logprobs"]
    assert plain["tokens"] == lp["tokens"][n_prompt:] and plain["text_offset"] == list(range(8))
    assert plain["token_logprobs"] == pytest.approx(lp["token_logprobs"][n_prompt:], abs=1e-5)
    only = completion(client, body | {"max_tokens": 0})
    assert only["choices"][0]["text"] == prompt and only["choices"][0]["finish_reason"] == "length"
    assert only["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:n_prompt])
    assert only["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
    sampled = body | {"echo": False, "temperature": 1.0, "seed": 3}
    text = completion(client, sampled)["choices"][0]["text"]
    stop = text[3:5]
    cut = completion(client, sampled | {"stop": stop})["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    assert "".join(cut["logprobs"]["tokens"]) == cut["text"]
    assert len(cut["logprobs"]["token_logprobs"]) == len(cut["text"])
    by_index, last = streamed_choices(client, body)
    chunks = by_index[0]
    assert chunks[0]["text"] == prompt and chunks[0]["logprobs"]["tokens"] == lp["tokens"][:n_prompt]
    entries = [c["logprobs"] for c in chunks[1:] if c["logprobs"]]
    assert [e["tokens"][0] for e in entries] == lp["tokens"][n_prompt:]
    assert [e["text_offset"][0] for e in entries] == lp["text_offset"][n_prompt:]
    assert [e["token_logprobs"][0] for e in entries] == pytest.approx(lp["token_logprobs"][n_prompt:], abs=1e-5)
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 8


def test_openai_several_prompts_and_n(client):
    """A list of prompts and n > 1: one choice per prompt and sample, in order (prompt-major), each the completion
    its own request gives (sample k of a prompt seeded with seed + k); usage counts each prompt once; streamed, the
    chunks of every choice carry its index and join into its text, the last one with the usage of all."""
    body = {"prompt": ["ab", "cd e"], "n": 2, "max_tokens": 12, "seed": 5, "temperature": 1.0}
    out = completion(client, body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    alone = [
        completion(client, body | {"prompt": p, "n": 1, "seed": 5 + k})["choices"][0]["text"]
        for p in body["prompt"]
        for k in range(2)
    ]
    assert [c["text"] for c in out["choices"]] == alone and alone[0] != alone[1]
    assert out["usage"] == {"prompt_tokens": 2 + 4, "completion_tokens": 4 * 12, "total_tokens": 6 + 48}
    by_index, last = streamed_choices(client, body)
    assert sorted(by_index) == [0, 1, 2, 3]
    assert ["".join(c["text"] for c in by_index[k]) for k in range(4)] == alone
    assert all(chunks[-1]["finish_reason"] == "length" for chunks in by_index.values())
    assert last["usage"] == out["usage"]
    ids = client.app.state.server.tokenizer.encode("ab")
    by_ids = completion(client, body | {"prompt": [ids, ids], "n": 1})
    assert [c["text"] for c in by_ids["choices"]] == [alone[0], alone[0]]


def test_penalties_and_logit_bias_equal_the_library(client):
    """Hugging Face's repetition_penalty / no_repeat_ngram_size (/v1/generate) and OpenAI's presence_penalty /
    frequency_penalty / logit_bias (/v1/completions, /v1/generate) give the tokens of txl.infer.generation with the same
    Penalties; each changes the greedy text; a bias of -100 keeps a token out, +100 makes it every token."""
    from txl.infer.generation import Penalties

    server = client.app.state.server
    prompt = "ab cd"
    ids = torch.tensor([server.tokenizer.encode(prompt)])
    base = {"prompt": prompt, "max_new_tokens": 30, "temperature": 0}
    plain = client.post("/v1/generate", json=base).json()["token_ids"]
    cases = [
        {"repetition_penalty": 1.5},
        {"no_repeat_ngram_size": 2},
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"logit_bias": {plain[0]: -100}},
    ]
    for kw in cases:
        res = client.post("/v1/generate", json=base | kw).json()
        pen = Penalties(**{k: tuple(v.items()) if k == "logit_bias" else v for k, v in kw.items()})
        expected = generate(server.model, ids, 30, temperature=0.0, penalties=pen)[0, ids.shape[1] :].tolist()
        assert res["token_ids"] == expected and expected != plain, kw
    assert plain[0] not in client.post("/v1/generate", json=base | {"logit_bias": {plain[0]: -100}}).json()["token_ids"]
    forced = client.post("/v1/generate", json=base | {"logit_bias": {7: 100}}).json()["token_ids"]
    assert forced == [7] * 30
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.5}
    text = completion(client, body | {"logit_bias": {str(plain[0]): -100}})["choices"][0]["text"]
    pen = Penalties(presence_penalty=1.5, frequency_penalty=0.5, logit_bias=((plain[0], -100.0),))
    assert text == server.tokenizer.decode(generate(server.model, ids, 30, temperature=0.0, penalties=pen)[0, 5:])


def test_a_failed_choice_stops_the_others(client, monkeypatch):
    """A completion of several choices whose one generation fails answers 500 naming the failure, and the other
    choices' generations are cancelled (not left running for nobody)."""
    engine = client.app.state.server.engine
    bad = client.app.state.server.tokenizer.encode("cd")
    gens, real_submit, real_start = [], engine.submit, engine._start

    def submit(gen):
        gens.append(gen)
        real_submit(gen)

    def start(gen):
        return engine._finish(gen, "error", "boom") if gen.prompt_ids == bad else real_start(gen)

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "_start", start)
    res = client.post("/v1/completions", json={"prompt": ["ab", "cd"], "max_tokens": 200, "temperature": 0})
    assert error_of(res, 500) == "generation failed: boom"
    assert gens[0].cancelled
    deadline = time.monotonic() + 30
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gens[0].finish_reason == "stop" and gens[0].produced < 200


def test_vllm_tokenizer_endpoints(client):
    tok = client.app.state.server.tokenizer
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "\n" and info["bos_token"] is None and info["vocab_size"] == tok.vocab_size
    res = client.post("/tokenize", json={"prompt": "ab cd\n", "add_special_tokens": False}).json()
    assert res["tokens"] == tok.encode("ab cd\n") and res["count"] == 6
    assert client.post("/detokenize", json={"tokens": res["tokens"]}).json() == {"prompt": "ab cd\n"}
    bad = client.post("/detokenize", json={"tokens": [1, 10_000]})
    assert "tokens: ids must be in [0, " in error_of(bad)


def test_score_equals_txl_eval(client, run, tmp_path, capsys):
    from txl.cli import main

    text = (run.parent / "corpus" / "test.txt").read_text()[:700]
    (tmp_path / "t.txt").write_text(text)
    settings = {"tgt_len": 16, "mem_len": 24, "clamp_len": -1, "same_length": True}
    res = client.post("/v1/score", json={"text": text, "per_token": True} | settings).json()
    main(["eval", "--model", str(run), "--data", str(tmp_path / "t.txt"), "--batch_size", "1", "--json"]
         + [f"--{k}={str(v).lower()}" for k, v in settings.items()])  # fmt: skip
    record = json.loads(capsys.readouterr().out)
    assert res["loss"] == pytest.approx(record["loss"], abs=1e-6) and res["bpc"] == pytest.approx(record["bpc"])
    assert res["tokens"] == record["tokens"] == len(text) - 1 and res["settings"] == settings
    per = res["per_token"]
    assert "".join(t["text"] for t in per) == text and per[0]["logprob"] is None
    assert np.mean([-t["logprob"] for t in per[1:]]) == pytest.approx(res["loss"], abs=1e-5)
    zero = client.post("/v1/score", json={"text": text, "zero_memory": True} | settings).json()
    main(["eval", "--model", str(run), "--data", str(tmp_path / "t.txt"), "--batch_size", "1", "--json"]
         + [f"--{k}={str(v).lower()}" for k, v in settings.items()] + ["--zero_memory", "true"])  # fmt: skip
    assert zero["loss"] == pytest.approx(json.loads(capsys.readouterr().out)["loss"], abs=1e-6)
    assert zero["loss"] != pytest.approx(res["loss"], abs=1e-6)  # (the first segment reads the zeros)


@pytest.mark.parametrize(
    "body, message",
    [
        ("{bad json", "the request body is not valid JSON"),
        ("[1, 2]", "the request body must be a JSON object, sent with Content-Type: application/json"),
        (("text/plain", '{"prompt": "ab"}'), "the request body must be a JSON object, sent with Content-Type"),
        ({"prompt": "ab", "colour": 1}, "colour: unknown field"),
        ({"prompt": "ab", "temperature": "hot"}, "temperature: Input should be a valid number"),
        ({"prompt": "ab", "top_p": 0}, "top_p: Input should be greater than 0"),
        ({"prompt": "ab", "top_k": -1}, "top_k: Input should be greater than or equal to 0"),
        ({"prompt": "ab\u20ac"}, "prompt: character '\u20ac' (U+20AC) at character 2 is not in the vocabulary"),
        ({"prompt": "ab", "prompt_ids": [1]}, "prompt: give either prompt or prompt_ids"),
        ({"prompt_ids": [1, 10_000]}, "prompt_ids: ids must be in [0, "),
        ({"prompt": "ab", "max_new_tokens": 201}, "max_new_tokens: 201 is more than the limit 200"),
        ({"prompt": "a" * 51}, "prompt: 51 tokens, more than the limit of 50"),
        ({"prompt": "ab", "stop": [""]}, "stop.0: String should have at least 1 character"),
        ({"prompt": "ab", "mem_len": 0}, "mem_len: Input should be greater than or equal to 1"),
        ({"prompt": "ab", "mem_len": 10**9}, "mem_len: 1000000000 is more than the limit 8192"),
    ],
)
def test_bad_generate_requests_name_the_field(client, body, message):
    if isinstance(body, tuple):  # (content type, body)
        kw = {"content": body[1], "headers": {"content-type": body[0]}}
    elif isinstance(body, str):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        kw = {"json": body}
    res = client.post("/v1/generate", **kw)
    assert message in error_of(res), res.json()


def test_bad_score_requests(client):
    for body, message in [
        ({"text": "a"}, "text: needs at least 2 tokens"),
        ({"text": "ab", "tgt_len": 0}, "tgt_len: Input should be greater than or equal to 1"),
        ({"text": "ab", "mem_len": 0, "same_length": True}, "same_length = True: needs mem_len > 0"),
        ({}, "text: give either text or ids"),
        ({"text": "ab", "mem_len": 10**6}, "mem_len: 1000000 is more than the limit 8192"),
    ]:
        res = client.post("/v1/score", json=body)
        assert message in error_of(res), res.json()


def test_batched_generation_equals_each_request_alone(run):
    """Four greedy requests of different prompt lengths decoded together (continuous batching: they join at
    different steps and leave at different lengths) give exactly the tokens each gives alone."""
    from txl import TransformerXLLM
    from txl.train.checkpoint import resolve_model_dir

    model = TransformerXLLM.from_pretrained(resolve_model_dir(run))
    prompts = [[1, 2, 3], [4] * 20, [5, 6], list(range(1, 30))]
    lengths = [25, 40, 10, 33]
    got = [[] for _ in prompts]
    peak = []
    engine = Engine(model, max_batch=4)
    done = threading.Semaphore(0)

    def emit(i):
        def f(tok):
            if tok is None:
                done.release()
            else:
                got[i].append(tok)
                peak.append(engine.active)

        return f

    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.submit(Generation(p, n, emit(i), mem_len=16, temperature=0.0))
    for _ in prompts:
        assert done.acquire(timeout=60)
    engine.shutdown()
    assert max(peak) >= 3  # they really ran together
    for p, n, tokens in zip(prompts, lengths, got, strict=True):
        alone = generate(model, torch.tensor([p]), n, temperature=0.0, mem_len=16)[0, len(p) :].tolist()
        assert tokens == alone


def test_engine_queue_limit_and_shutdown(run):
    from txl import TransformerXLLM
    from txl.train.checkpoint import resolve_model_dir

    model = TransformerXLLM.from_pretrained(resolve_model_dir(run))
    engine = Engine(model, max_batch=1, max_queue=1)
    reasons = []
    gens = [Generation([1, 2], 100_000, lambda t: None, mem_len=8) for _ in range(2)]
    for g in gens:  # (callers that take their tokens: a parked generation, whose caller does not, frees its row)
        g.emit = lambda t, g=g: reasons.append(g.finish_reason) if t is None else g.took()
        engine.submit(g)  # one runs, one waits
        while not engine.active:
            time.sleep(0.001)
    with pytest.raises(QueueFull, match="the limit is 1"):
        engine.submit(Generation([1], 5, lambda t: None, mem_len=8))
    start = time.monotonic()
    engine.shutdown(timeout=0.5)  # the running one is cancelled after the grace time, the waiting one too
    assert time.monotonic() - start < 10 and sorted(reasons) == ["shutdown", "shutdown"]


def test_http_limits_disconnect_and_api_key(run):
    # (a first generation long enough to be running whatever the machine's speed: 150 tokens once ended, ~0.1 s,
    # before the second request arrived)
    app = create_app(run, ServeLimits(max_batch=1, max_queue=0, max_new_tokens=50_000), api_key="s3cret")
    key = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as c:
        for public in ("/health", "/", "/docs", "/openapi.json"):  # no key needed: nothing of the model's in them
            assert c.get(public).status_code == 200, public
        assert "Authorization: Bearer KEY" in error_of(c.get("/v1/model"), 401)
        assert c.get("/v1/model", headers=key).status_code == 200
        assert c.get("/v1/model", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # a key in the URL (it leaks into history, Referer headers and proxy logs) or in X-API-Key is not taken
        assert "a key in the URL is not read" in error_of(c.get("/v1/model?key=s3cret"), 401)
        assert c.get("/v1/model", headers={"X-API-Key": "s3cret"}).status_code == 401
        assert c.get("/v1/model", headers={"Authorization": "Basic s3cret"}).status_code == 401
        body = {"prompt": "ab", "max_new_tokens": 50_000, "stream": True}
        with c.stream("POST", "/v1/generate", json=body, headers=key) as res:
            lines = res.iter_lines()
            assert next(lines).startswith("data: ")  # it is running: the only slot is taken
            busy = c.post("/v1/generate", json={"prompt": "ab"}, headers=key)
            assert "busy" in error_of(busy, 429)
        # the client left after one token: its generation stops and frees the slot
        deadline = time.monotonic() + 10
        while c.get("/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/health").json()["active"] == 0
        assert c.post("/v1/generate", json={"prompt": "ab", "max_new_tokens": 3}, headers=key).status_code == 200
        # The schema declares the key; the public pages show nothing of where the model lives.
        schema = c.get("/openapi.json").json()
        assert schema["components"]["securitySchemes"]["bearer"] == {
            "type": "http", "scheme": "bearer", "description": "Authorization: Bearer KEY"
        }  # fmt: skip
        assert schema["paths"]["/v1/generate"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]
        for public in ("/openapi.json", "/docs", "/"):  # (the description named the checkpoint's folder)
            assert str(run) not in c.get(public).text, public


def test_the_schema_states_what_the_server_refuses(client):
    """An empty prompt or stop string, a score of fewer than 2 ids, a negative id: refused by the schema (400 naming
    the field), as /openapi.json says (a client, or a fuzzer, reads there what is accepted)."""
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    gen, score = schema["GenerateRequest"]["properties"], schema["ScoreRequest"]["properties"]
    assert gen["prompt"]["anyOf"][0]["minLength"] == 1 and gen["stop"]["items"]["minLength"] == 1
    assert gen["prompt_ids"]["anyOf"][0]["items"]["minimum"] == 0
    assert score["ids"]["anyOf"][0]["minItems"] == 2
    assert schema["CompletionRequest"]["properties"]["n"]["maximum"] == 64  # (max_queue: the one statement of it)
    for path, body, field in [
        ("/v1/generate", {"prompt": ""}, "prompt"),
        ("/v1/generate", {"prompt_ids": []}, "prompt_ids"),
        ("/v1/generate", {"prompt_ids": [-1]}, "prompt_ids.0"),
        ("/v1/generate", {"prompt": "ab", "stop": [""]}, "stop.0"),
        ("/v1/score", {"ids": [1]}, "ids"),
        ("/v1/score", {"ids": [1, -2]}, "ids.1"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ]:
        res = client.post(path, json=body)
        error_of(res, 400)
        assert res.json()["error"]["param"] == field, (path, body, res.json())
    for path, raw in [  # (JSON escapes: a client library refuses to encode a lone surrogate itself)
        ("/v1/generate", rb'{"prompt": "ab\ud800"}'),
        ("/tokenize", rb'{"prompt": "\udfff", "unknown": "replace"}'),
        ("/v1/completions", rb'{"prompt": ["ab", "\udfff"]}'),
    ]:
        message = error_of(client.post(path, content=raw, headers={"Content-Type": "application/json"}))
        assert "codec" not in message and ("a lone surrogate" in message or "valid string" in message), message


@pytest.mark.slow
def test_real_server_concurrent_clients_and_sigterm(run):
    """`txl serve` as a subprocess: 8 concurrent streaming clients all get complete, seeded streams; then SIGTERM
    ends it cleanly (exit code 0) while a long generation is still running."""
    import signal

    import httpx

    proc, url = start_server(run)
    results, errors = {}, []

    def client(i: int) -> None:
        try:
            body = {"prompt": "ab cd", "max_new_tokens": 60, "seed": i, "stream": True}
            with httpx.stream("POST", url + "/v1/generate", json=body, timeout=60) as res:
                evs = [json.loads(x[6:]) for x in res.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
            results[i] = evs
        except Exception as e:  # reported below
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and len(results) == 8
        for i, evs in results.items():
            assert evs[-1]["done"] and evs[-1]["new_tokens"] == 60 and len(evs) == 61, i
            again = httpx.post(url + "/v1/generate", json={"prompt": "ab cd", "max_new_tokens": 60, "seed": i},
                               timeout=60).json()  # fmt: skip
            assert again["token_ids"] == [e["token_id"] for e in evs[:-1]]  # batched or alone: the same tokens
        long = threading.Thread(target=client, args=(99,))
        long.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        long.join(timeout=30)
        assert not long.is_alive()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_web_page_in_a_real_browser(run, tmp_path):
    """Headless Chromium (Debian's, `make browser`) opens the page at phone width, generates (streamed text and
    tokens/s appear), scores a text (a heat strip), with no console errors; the screenshot is not blank."""
    import os
    import shutil

    pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from serve_helpers import page_in_chromium

    with page_in_chromium(run) as (browser, url):
        browser.get(url + "/")
        wait = WebDriverWait(browser, 60)
        wait.until(lambda b: "parameters" in b.find_element(By.ID, "model").text, "the model line")
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("ab cd ")
        browser.execute_script("document.getElementById('length').value = '80';")
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda b: "tokens/s" in b.find_element(By.ID, "gen-stats").text, "tokens/s")
        wait.until(lambda b: b.find_element(By.ID, "generate").is_enabled(), "the end of the stream")
        generated = browser.execute_script("return document.querySelector('#output span:nth-child(2)').textContent")
        assert len(generated) >= 40 and "80 tokens" in browser.find_element(By.ID, "gen-stats").text
        browser.execute_script("document.getElementById('length').value = '1000';")  # long enough to stop it
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda b: b.find_element(By.ID, "stop").is_enabled(), "the Stop button")
        wait.until(lambda b: "tokens/s" in b.find_element(By.ID, "gen-stats").text, "a running stream")
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda b: "stopped" in b.find_element(By.ID, "gen-stats").text, "stopped")
        assert int(browser.find_element(By.ID, "gen-stats").text.split()[0]) < 1000
        browser.execute_script("document.getElementById('score-text').value = arguments[0];", "ab cd " + generated)
        browser.find_element(By.ID, "score").click()
        wait.until(lambda b: "bpc" in b.find_element(By.ID, "score-stats").text, "the score")
        coloured = browser.execute_script("return document.querySelectorAll('#heat span[title]').length")
        assert coloured > 20
        width = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1]  # usable at phone width: nothing wider than the screen
        shot = tmp_path / "page.png"
        browser.save_screenshot(str(shot))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    assert pixels.shape[1] >= 300 and pixels.std() > 10  # not a blank page
    if os.environ.get("TXL_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["TXL_SCREENSHOT"])


def test_cli_refuses_remote_binding_and_bad_limits(run, capsys):
    from txl.cli import main

    for args, message in [
        (["--host", "0.0.0.0"], "--host 0.0.0.0: binding beyond this machine needs --allow_remote true"),
        (["--max_batch", "0"], "--max_batch = 0: must be >= 1"),
        (["--max_new_tokens", "0"], "--max_new_tokens = 0: must be >= 1"),
    ]:
        with pytest.raises(SystemExit):
            main(["serve", "--model", str(run), *args])
        assert message in capsys.readouterr().err


def test_limits_that_may_hold_more_than_the_machine_are_noted_at_start(run):
    """The limits bound each request, but max_batch rows of the longest memory and segment could hold more than the
    machine has: the system would stop the server, not a request's error. `txl serve` says so when it starts; the
    estimate counts a generation's cache by its prompt and answer, and a scored text's by its memory and segment."""
    from txl.cli.common import attention_pass_bytes
    from txl.cli.serve import limits_memory, limits_memory_note
    from txl.model.config import TransformerXLConfig

    cfg = TransformerXLConfig(n_token=100, n_layer=4, d_model=64, n_head=2, d_head=32, d_inner=64)
    position = 2 * 4 * 2 * 32 * 4  # keys and values of one position, every layer
    gen = ServeLimits(max_batch=2, max_prompt_tokens=100, max_new_tokens=20, max_mem_len=150, max_tgt_len=1)
    prompt_pass = attention_pass_bytes(cfg, 1, 100, 100)  # (one prompt's pass at a time: its [T, K] mask, its scores)
    assert prompt_pass >= 3 * 100 * 100
    # (a memory of prompt and answer, a prompt more; the larger of a prompt's pass and a step's log-probabilities;
    # max_batch rows and as many parked generations)
    generation = 2 * (120 + 100) * position
    assert limits_memory(cfg, gen) == 2 * 2 * generation + max(prompt_pass, 2 * 100 * 16)
    score = ServeLimits(max_batch=3, max_prompt_tokens=1, max_new_tokens=1, max_mem_len=100, max_tgt_len=50)
    parked = 16 * position  # (a generation's cache of a 1-token prompt and answer: 16 positions at least)
    assert limits_memory(cfg, score) == 3 * (2 * 150 * position + 2 * 50 * 150 * 4 + parked) + 3 * 100 * 16
    long = ServeLimits(max_batch=1, max_prompt_tokens=5000, max_new_tokens=1, max_mem_len=10, max_tgt_len=1)
    pieces = attention_pass_bytes(cfg, 1, 1024, 5000)  # (a long prompt is read in pieces of 1,024 positions)
    assert limits_memory(cfg, long) == 2 * 2 * (10 + 5000) * position + pieces
    assert limits_memory_note(cfg, score, free=10**9) is None
    note = limits_memory_note(cfg, score, free=1000)
    assert (
        note.startswith("at its limits (3 rows of --max_mem_len 100, --max_tgt_len 50") and "lower --max_batch" in note
    )
    proc, _ = start_server(run, "--max_batch", "100000", stderr=subprocess.PIPE, text=True)
    try:
        proc.terminate()
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert "txl serve: note: at its limits (100000 rows of --max_mem_len 8,192" in err, err


def test_engine_serves_absolute_position_models_one_at_a_time():
    """attn_type 2 has no K/V cache: the engine generates its requests one after another, each as `generate` does."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(attn_type=2)).eval()
    engine = Engine(model, max_batch=4)
    assert not engine.batched
    got = {0: [], 1: []}
    done = threading.Semaphore(0)
    for i, prompt in enumerate(([1, 2, 3], [7, 8])):

        def emit(t, out=got[i]):
            return done.release() if t is None else out.append(t)

        engine.submit(Generation(prompt, 12, emit, mem_len=8, temperature=0.0))
    for _ in range(2):
        assert done.acquire(timeout=60)
    engine.shutdown()
    for i, prompt in enumerate(([1, 2, 3], [7, 8])):
        assert (
            got[i] == generate(model, torch.tensor([prompt]), 12, temperature=0.0, mem_len=8)[0, len(prompt) :].tolist()
        )


@pytest.mark.parametrize("attn_type", [0, 2])
def test_engine_log_probs_are_the_models(attn_type):
    """A request's prompt and token log-probabilities (with the k most likely tokens) are those of one forward pass
    over prompt and new tokens, with a K/V cache (attn_type 0) and without one (2, generated alone)."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(attn_type=attn_type)).eval()
    engine = Engine(model, max_batch=4)
    assert engine.batched == (attn_type == 0)
    got, done = [], threading.Event()
    prompt = [1, 2, 3, 4]
    gen = Generation(prompt, 5, lambda t: done.set() if t is None else got.append(t), mem_len=32, temperature=1.0,
                     seed=1, logprobs=3, prompt_logprobs=True)  # fmt: skip
    engine.submit(gen)
    assert done.wait(60)
    engine.shutdown()
    ids = prompt + got
    with torch.no_grad():
        lp = model(torch.tensor([ids[:-1]]), mem_len=32, return_log_probs=True).log_probs[0]  # [T - 1, V]
    scores = gen.prompt_scores + gen.scores
    assert len(gen.prompt_scores) == len(prompt) - 1 and len(gen.scores) == len(got) == 5
    for t, (value, top) in enumerate(scores):
        assert value == pytest.approx(float(lp[t, ids[t + 1]]), abs=1e-5)
        best = lp[t].topk(3)
        assert [i for i, _ in top] == best.indices.tolist()
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="logprobs = 21: must be in"):
        Generation(prompt, 5, print, mem_len=32, logprobs=21)


def test_token_scores_read_as_the_list_of_tuples_they_replace_in_a_fraction_of_the_memory():
    """The engine's record of log-probabilities (TokenScores) reads back as the list of (log-probability, [(id,
    log-probability), ...]) that the routes write out, value for value (float32 exactly), by index, slice and
    iteration; a 4,096-token prompt with 20 alternatives each holds under 1 MB (the tuples took ~9 MB)."""
    import sys

    from txl.serve.engine import TokenScores

    torch.manual_seed(0)
    log_probs = torch.randn(4096, 500).log_softmax(-1)  # [N, V]
    tokens = torch.randint(0, 500, (4096,))
    scores = TokenScores()
    for start in range(0, 4096, 1000):  # (written in pieces, as the prompt is scored)
        scores.extend(log_probs[start : start + 1000], tokens[start : start + 1000], 20)
    values, ids = log_probs.topk(20, dim=-1)
    chosen = log_probs.gather(-1, tokens[:, None])[:, 0].tolist()
    rows = zip(chosen, ids.tolist(), values.tolist(), strict=True)
    expected = [(c, list(zip(i, v, strict=True))) for c, i, v in rows]
    assert len(scores) == 4096 and list(scores) == expected and scores[5:9] == expected[5:9]
    assert scores[-1] == expected[-1] and scores[0] == expected[0] and [None, *scores][1] == expected[0]
    with pytest.raises(IndexError):
        scores[4096]
    held = sum(sys.getsizeof(a) for a in (scores._chosen, scores._ids, scores._values))
    assert held < 1 << 20, held
    bare = TokenScores()  # (no alternatives asked for: each entry's list is empty)
    bare.extend(log_probs[:3], tokens[:3], 0)
    assert list(bare) == [(c, []) for c in chosen[:3]]
    with pytest.raises(ValueError, match="alternatives per token"):
        bare.extend(log_probs[:1], tokens[:1], 2)


def test_engine_refuses_beam_search_it_cannot_do():
    noop = lambda tok: None  # noqa: E731
    with pytest.raises(ValueError, match="give temperature 0"):
        Generation([1, 2], 5, noop, mem_len=8, num_beams=2)
    with pytest.raises(ValueError, match="no log-probabilities"):
        Generation([1, 2], 5, noop, mem_len=8, num_beams=2, temperature=0.0, logprobs=1)
    with pytest.raises(ValueError, match="num_beams = 0"):
        Generation([1, 2], 5, noop, mem_len=8, num_beams=0, temperature=0.0)


def test_engine_runs_beam_searches_step_by_step_beside_other_requests():
    """A beam search is one step per engine loop: a greedy request sent after it finishes before the search's first
    token, two searches run at once and each gives beam_search's text, a search waits while the running searches'
    beams fill max_batch rows, and a cancelled search stops at its next step (no tokens, finish_reason stop)
    instead of searching its whole max_new_tokens."""
    from tests.conftest import debug_config
    from txl import TransformerXLLM
    from txl.infer.generation import beam_search

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config()).eval()
    calls = []
    hook = model.transformer.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    engine = Engine(model, max_batch=8)
    events, got, ended = [], {}, {}
    lock = threading.Lock()

    def request(name, prompt, n, **kw):
        got[name], ended[name] = [], threading.Event()

        def emit(t):
            with lock:
                events.append((name, t))
            (ended[name].set() if t is None else got[name].append(t))

        return Generation(prompt, n, emit, mem_len=16, temperature=0.0, **kw)

    beams = [request("beam-a", [1, 2, 3], 40, num_beams=3), request("beam-b", [4, 5], 30, num_beams=2)]
    greedy = request("greedy", [6, 7, 8], 5)
    for r in (*beams, greedy):
        engine.submit(r)
    for e in ended.values():
        assert e.wait(60)
    firsts = {name: next(i for i, (n, _) in enumerate(events) if n == name) for name in got}
    assert events.index(("greedy", None)) < min(firsts["beam-a"], firsts["beam-b"])
    assert calls.index(2) < len(calls) - 1 - calls[::-1].index(3)  # (the searches' steps (2 and 3 rows) interleave)
    for r, (prompt, n, k) in zip(beams, [([1, 2, 3], 40, 3), ([4, 5], 30, 2)], strict=True):
        best = beam_search(model, torch.tensor([prompt]), n, num_beams=k, mem_len=16)[0, len(prompt) :].tolist()
        assert r.output_ids == best and r.finish_reason == "length"

    engine.shutdown()

    engine = Engine(model, max_batch=4)  # (3 + 2 beams do not fit in 4 rows: the second search waits)
    calls.clear()
    for name, k in (("full-a", 3), ("full-b", 2)):
        engine.submit(request(name, [1, 2, 3], 12, num_beams=k))
    assert ended["full-a"].wait(60) and ended["full-b"].wait(60)
    # (the model's calls: rows of each step, one search after the other; a prompt's pass is one row for its beams)
    assert calls == [1] + [3] * 11 + [1] + [2] * 11

    calls.clear()
    slow = request("cancelled", [1, 2, 3], 10_000, num_beams=2)

    def cancel_soon(mod, args, out):
        if len(calls) == 5:
            slow.cancel()

    canceller = model.transformer.register_forward_hook(cancel_soon)
    engine.submit(slow)
    assert ended["cancelled"].wait(60)
    engine.shutdown()
    hook.remove()
    canceller.remove()
    assert slow.finish_reason == "stop" and got["cancelled"] == [] and 5 <= len(calls) <= 7
