"""`txl lm-eval`: EleutherAI's harness with `--model txl`, on tasks defined here from local JSONL files (nothing is
downloaded). Rolling log-likelihood equals `txl eval` on the same text; log-likelihoods of continuations equal the
model's own log-probs summed by hand; generation equals greedy `txl.infer.generation` cut at the stop sequence."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' JSON files are local: never ask the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("lm_eval")

from txl.cli import main  # noqa: E402
from txl.data.tokenizer import Tokenizer  # noqa: E402
from txl.infer.evaluate import eval_settings  # noqa: E402
from txl.infer.generation import generate  # noqa: E402
from txl.model.modeling import TransformerXLLM  # noqa: E402
from txl.train.checkpoint import read_run_config, resolve_model_dir  # noqa: E402

SETTINGS = {"tgt_len": 8, "mem_len": 64, "same_length": False}
DOCS = [
    "Abc def ghi jkl. Mno pab cde fgh.\nIjk lmn.\n",
    "Pon mlk jih gfe dcb.\n",
    "A b c d e f g h i j k l m n o p a b c d e f g h i j k l m n o p.\n" * 3,
]
CHOICES = [
    {"context": "Abc def ghi jkl mno pab cde", "choices": ["fgh.", "aaa.", "p"], "gold": 0},
    {"context": "Pon", "choices": ["mlk.", "x".replace("x", "ab")], "gold": 1},
    {"context": "", "choices": ["Abc.", "Ponm lkj ihgf edcb a."], "gold": 0},
]
PROMPTS = ["Abc def", "Ponm lkj ihgf", "A"]


def task_yaml(name: str, path, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n" + body
    )


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory):
    """A small char model, and `txl lm-eval` run once on three tasks defined from local files."""
    from train_helpers import run_inprocess

    tmp = tmp_path_factory.mktemp("harness")
    run = run_inprocess(tmp, train__max_steps=150, train__lr=0.01, train__eval_interval=0)
    tasks = tmp / "tasks"
    tasks.mkdir()
    for name, rows in (("docs", [{"text": t} for t in DOCS]), ("choices", CHOICES), ("prompts", PROMPTS)):
        rows = [{"context": p} for p in rows] if name == "prompts" else rows
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "rolling.yaml").write_text(
        task_yaml("txl_rolling", tmp / "docs.jsonl", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n')
        + "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    (tasks / "choice.yaml").write_text(
        task_yaml("txl_choice", tmp / "choices.jsonl", "output_type: multiple_choice\n")
        + "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
        + "metric_list:\n  - metric: acc\n"
    )
    (tasks / "gen.yaml").write_text(
        task_yaml("txl_gen", tmp / "prompts.jsonl", "output_type: generate_until\n")
        + "doc_to_text: '{{context}}'\ndoc_to_target: ' x'\n"
        + "generation_kwargs:\n  until: ['.', ' ']\n  max_gen_toks: 40\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n"
    )
    out = tmp / "out"
    model_args = f"pretrained={run}," + ",".join(f"{k}={v}" for k, v in SETTINGS.items())
    main(["lm-eval", "--model", "txl", "--model_args", model_args, "--tasks", "txl_rolling,txl_choice,txl_gen",
          "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "2"])  # fmt: skip
    samples = read_samples(out)
    assert set(samples) == {"txl_rolling", "txl_choice", "txl_gen"}, sorted(samples)
    return tmp, run, samples


def read_samples(out) -> dict[str, list[dict]]:
    """The samples `lm_eval --log_samples` wrote under ``out``, by task, in document order."""
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(x) for x in f.read_text().splitlines()), key=lambda r: r["doc_id"])
    return samples


def loaded(run):
    """The run's model, tokenizer and evaluation settings, as the harness model resolves them."""
    folder = resolve_model_dir(run)
    lm = TransformerXLLM.from_pretrained(folder).eval()
    return lm, Tokenizer.load(folder / "tokenizer.json"), eval_settings(read_run_config(folder), lm.config, **SETTINGS)


def test_rolling_loglikelihood_equals_txl_eval(harness_run, capsys):
    tmp, run, samples = harness_run
    for doc, sample in zip(DOCS, samples["txl_rolling"], strict=True):
        f = tmp / "doc.txt"
        f.write_text("\n" + doc)  # the harness reads every text after a line end
        capsys.readouterr()
        main(["eval", "--model", str(run), "--data", str(f), "--batch_size", "1", "--json"]
             + [f"--{k}={v}" for k, v in SETTINGS.items()])  # fmt: skip
        res = json.loads(capsys.readouterr().out)
        assert res["tokens"] == len(doc)  # every character predicted once
        ll = float(sample["resps"][0][0])
        assert ll == pytest.approx(-res["loss"] * res["tokens"], rel=1e-6, abs=1e-6)


def test_loglikelihood_equals_the_models_log_probs_by_hand(harness_run):
    """One forward over the whole text (no segments, no memory, no padding) gives what the harness got from
    left-padded batches read 8 tokens at a time with the memory."""
    _, run, samples = harness_run
    assert_loglikelihoods_by_hand(run, samples["txl_choice"], lambda tok, context: tok.encode("\n" + context))


def assert_loglikelihoods_by_hand(run, samples: list[dict], context_ids) -> None:
    """Each (log-likelihood, is greedy) the harness logged for CHOICES equals one forward pass over the context
    (``context_ids(tokenizer, text)``) and the continuation (after lm-eval's target delimiter, a space)."""
    lm, tok, s = loaded(run)
    checked = 0
    for row, sample in zip(CHOICES, samples, strict=True):
        for choice, resp in zip(row["choices"], sample["resps"], strict=True):
            ctx, cont = context_ids(tok, row["context"]), tok.encode(" " + choice)
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                lp = lm(ids[:, :-1], clamp_len=s.clamp_len, same_length=False, return_log_probs=True).log_probs[0]
            picked = lp[len(ctx) - 1 :].gather(-1, ids[0, len(ctx) :, None])[:, 0]
            greedy = bool((lp[len(ctx) - 1 :].argmax(-1) == ids[0, len(ctx) :]).all())
            ll, is_greedy = resp[0]
            assert float(ll) == pytest.approx(float(picked.double().sum()), abs=1e-4)
            assert is_greedy in (greedy, str(greedy))
            checked += 1
    assert checked == 7


def test_generate_until_is_greedy_generation_cut_at_the_stop(harness_run):
    _, run, samples = harness_run
    lm, tok, s = loaded(run)
    stopped = 0
    for prompt, sample in zip(PROMPTS, samples["txl_gen"], strict=True):
        ids = torch.tensor([tok.encode("\n" + prompt)])
        with torch.no_grad():
            full = tok.decode(generate(lm, ids, 40, temperature=0.0, mem_len=s.mem_len)[0, ids.shape[1] :].tolist())
        cut = min((full.find(u) for u in (".", " ") if u in full), default=len(full))
        stopped += cut < len(full)
        got = sample["resps"][0][0]
        assert got == full[:cut] and "." not in got and " " not in got
    assert stopped >= 2  # a stop sequence was met (and the text cut before it)


def test_generate_until_takes_hugging_faces_generation_kwargs(harness_run, capsys):
    """A task's num_beams is beam search (each prompt's best beam, cut at the stop), repetition_penalty and
    no_repeat_ngram_size are the penalties; a kwarg the model does not use is named once, so is beam sampling."""
    from txl.infer.generation import Penalties, beam_search
    from txl.interop.lm_harness import TransformerXLHarnessLM

    _, run, _ = harness_run
    harness = TransformerXLHarnessLM(pretrained=str(run), **SETTINGS)
    lm, tok, s = loaded(run)
    prompts = [harness.prefix + tok.encode(p) for p in PROMPTS]
    searched = harness.generate(prompts, {"until": ["."], "max_gen_toks": 20, "num_beams": 3, "length_penalty": 0.5})
    penalties = Penalties(repetition_penalty=1.5, no_repeat_ngram_size=2)
    penalised = harness.generate(prompts, {"until": [], "max_gen_toks": 20, "repetition_penalty": 1.5,
                                           "no_repeat_ngram_size": 2, "typical_p": 0.9})  # fmt: skip
    harness.generate(prompts[:1], {"until": [], "max_gen_toks": 2, "typical_p": 0.9})
    assert capsys.readouterr().err.count("generation_kwargs typical_p not used by the txl model") == 1
    for _ in range(2):
        harness.generate(prompts[:1], {"until": [], "max_gen_toks": 2, "do_sample": True, "num_beams": 2})
    assert capsys.readouterr().err.count("num_beams 2 with do_sample (beam sampling) is not implemented") == 1
    beam_differs = penalty_differs = 0
    for p, got_beam, got_penalised in zip(prompts, searched, penalised, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            best = beam_search(lm, ids, 20, num_beams=3, length_penalty=0.5, mem_len=s.mem_len)[0, len(p) :]
            greedy = generate(lm, ids, 20, temperature=0.0, mem_len=s.mem_len)[0, len(p) :]
            pen = generate(lm, ids, 20, temperature=0.0, mem_len=s.mem_len, penalties=penalties)[0, len(p) :]
        text = tok.decode(best.tolist())
        assert got_beam == text[: text.index(".")] if "." in text else got_beam == text
        assert got_penalised == tok.decode(pen.tolist())
        beam_differs += best.tolist() != greedy.tolist()
        penalty_differs += pen.tolist() != greedy.tolist()
    assert beam_differs and penalty_differs  # (each changed what was generated, for some prompt)


def test_local_completions_through_txl_serve(harness_run, tmp_path):
    """lm-evaluation-harness's own OpenAI-API model (`local-completions`) against `txl serve`, as a user runs it:
    it finds the server's tokenizer endpoints, scores continuations with echoed prompt log-probabilities, and
    generates through /v1/completions. Its log-likelihoods are the model's own log-probs by hand (the context read
    as the tokenizer reads it, an empty one as the line end), its generations greedy generation cut at the stops."""
    import uvicorn

    from txl.serve.app import create_app

    tmp, run, _ = harness_run
    lm, tok, _ = loaded(run)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(run), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        out = tmp_path / "out"
        args = f"base_url=http://127.0.0.1:{port}/v1/completions,model=txl,tokenizer_backend=remote,max_retries=1"
        main(["lm-eval", "--model", "local-completions", "--model_args", args, "--tasks", "txl_choice,txl_gen",
              "--include_path", str(tmp / "tasks"), "--output_path", str(out), "--log_samples"])  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    samples = read_samples(out)
    # (the harness reads an empty context as its end-of-text token: the server's line end)
    assert_loglikelihoods_by_hand(run, samples["txl_choice"], lambda tok, context: tok.encode(context or "\n"))
    for prompt, sample in zip(PROMPTS, samples["txl_gen"], strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            full = tok.decode(generate(lm, ids, 40, temperature=0.0)[0, ids.shape[1] :].tolist())
        cut = min((full.find(u) for u in (".", " ", "\n") if u in full), default=len(full))  # (+ the line end)
        assert sample["resps"][0][0] == full[:cut]


@pytest.mark.slow  # (the heaviest of the default suite: CI runs it with the slow ones)
def test_unknown_model_args_are_refused_by_name(harness_run, capsys):
    """`--model_args ...,memlen=256` (a typo of mem_len) was dropped silently: the run read with the model's memory.
    Now the command stops with one line naming it and the close match."""
    tmp, run, _ = harness_run
    with pytest.raises(SystemExit) as e:
        main(["lm-eval", "--model", "txl", "--model_args", f"pretrained={run},memlen=256", "--tasks", "txl_choice",
              "--include_path", str(tmp / "tasks"), "--output_path", str(tmp / "refused")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("txl lm-eval: error: --model_args memlen: not an argument of the txl")
    assert "did you mean mem_len?" in err and not (tmp / "refused").exists()


@pytest.mark.slow  # (an lm-eval run each: CI runs them with the slow ones)
@pytest.mark.parametrize(
    "probe, extra, message",
    [
        ("lm1", ",mem_len=abc", "--model_args mem_len='abc': not an integer"),
        ("lm1", ",clamp_len=-5", "--model_args clamp_len=-5: must be >= -1"),
        ("lm1", ",same_length=maybe", "--model_args same_length='maybe': true or false"),
        ("lm2", "", "--model_args pretrained is empty: give a run folder"),
        ("lm3", ",batch_size=0", "--model_args batch_size: also given by the harness's --batch_size option"),
    ],
)
def test_model_args_of_the_wrong_kind_are_one_line(probe, extra, message, harness_run, capsys):
    """lm1: mem_len=abc was a TypeError traceback; lm2: `pretrained=` read the current folder; lm3: batch_size in
    model_args was the harness's own "got multiple values" traceback. Each is now one line, before any loading."""
    tmp, run, _ = harness_run
    model_args = "pretrained=" if probe == "lm2" else f"pretrained={run}{extra}"
    with pytest.raises(SystemExit) as e:
        main(["lm-eval", "--model", "txl", "--model_args", model_args, "--tasks", "txl_choice",
              "--include_path", str(tmp / "tasks"), "--output_path", str(tmp / "refused")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith(f"txl lm-eval: error: {message}"), err
    assert not (tmp / "refused").exists()
