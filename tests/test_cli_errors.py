"""What a hostile user typed: every bad option of `txl eval` and `txl generate`, bad files and weights. Each gets one
line on stderr naming the option, file or tensor and what to do (exit code 2 for usage errors, 1 for a run that
failed), never a traceback. And what must simply work: scoring new text with the model's own tokenizer (with at
most one tokenization), streamed generation with word separators, --threads."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from train_helpers import DEBUG, run_inprocess, tiny_corpus
from txl.cli import main
from txl.data import Tokenizer, prepare_corpus
from txl.infer.evaluate import evaluate
from txl.infer.generation import generate
from txl.model.modeling import TransformerXL, TransformerXLLM
from txl.train.checkpoint import best_checkpoint


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("char")
    return run_inprocess(tmp, train__max_steps=4, train__eval_interval=0)


@pytest.fixture(scope="module")
def word_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("word")
    return run_inprocess(tmp, train__max_steps=4, train__eval_interval=0, data__tokenizer="word")


def fails(capsys, args: list[str], code: int = 2) -> str:
    """Run the CLI, expect exit ``code`` and exactly one line on stderr; return it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == code and len(lines) == 1 and lines[0].startswith("txl: "), err
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max_batches", "0"], "--max_batches = 0: must be >= 1"),
        (["--max_batches", "-1"], "--max_batches = -1: must be >= 1"),
        (["--tgt_len", "0"], "--tgt_len = 0: must be >= 1"),
        (["--batch_size", "0"], "--batch_size = 0: must be >= 1"),
        (["--mem_len", "-5"], "--mem_len = -5: must be >= 0"),
        (["--mem_len", "0", "--same_length", "true"], "--same_length = True: needs mem_len > 0"),
        (["--precision", "fp8"], "--precision = 'fp8': expected one of fp32, bf16, fp16"),
        (["--split", "bogus"], "--split = 'bogus': expected one of train, valid, test"),
        (["--device", "tpu"], "--device = 'tpu': expected cpu, cuda, cuda:N or auto"),
        (["--threads", "-1"], "--threads = -1: must be >= 1"),
        (["--tgt_len", "x"], "--tgt_len = 'x': expected an int"),
    ],
)
def test_eval_bad_options(char_run, capsys, args, message):
    assert message in fails(capsys, ["eval", "--model", str(char_run), *args])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_eval_cuda_on_a_cpu_machine_names_the_option(char_run, capsys):
    line = fails(capsys, ["eval", "--model", str(char_run), "--device", "cuda"])
    assert "--device = 'cuda', but CUDA is not available" in line and "train.device" not in line
    line = fails(capsys, ["generate", "--model", str(char_run), "--prompt", "A", "--device", "cuda"])
    assert "--device = 'cuda', but CUDA is not available" in line
    pytest.importorskip("fastapi")
    line = fails(capsys, ["serve", "--model", str(char_run), "--device", "cuda"])
    assert "--device = 'cuda', but CUDA is not available" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature = -1.0: must be >= 0"),
        (["--temperature", "nan"], "--temperature = 'nan': expected a finite number"),
        (["--top_p", "1.5"], "top_p = 1.5: must be in (0, 1]"),
        (["--top_p", "0"], "top_p = 0.0: must be in (0, 1]"),
        (["--top_k", "-3"], "top_k = -3: must be >= 0"),
        (["--max_new_tokens", "-5"], "max_new_tokens = -5: must be >= 0"),
        (["--mem_len", "0"], "--mem_len = 0: must be >= 1"),
        (["--threads", "0"], "--threads = 0: must be >= 1"),
        (["--num_beams", "0"], "--num_beams = 0: must be >= 1 (1: no beam search)"),
        (["--seed", str(2**64)], f"--seed = {2**64}: a seed is a whole number from -2**63 to 2**63 - 1"),
        (["--seed", str(-(2**63) - 1)], "a seed is a whole number from -2**63 to 2**63 - 1 (64 bits)"),
    ],
)
def test_generate_bad_options(char_run, capsys, args, message):
    assert message in fails(capsys, ["generate", "--model", str(char_run), "--prompt", "Ab", *args])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--r", "[]"], "--r []: give at least one fraction, or leave --r out"),
        (["--batch_size", "0"], "--batch_size = 0: must be >= 1"),
        (["--threshold", "-1"], "--threshold = -1.0: must be in [0, 1) (a relative gain"),
        (["--threshold", "2"], "--threshold = 2.0: must be in [0, 1)"),
    ],
)
def test_recl_bad_options(char_run, capsys, tmp_path, args, message):
    """Each was taken: an empty --r silently became the default fractions, a negative threshold gave '+: the gain
    never fell below -1.0'."""
    base = ["recl", "--models", str(char_run), str(char_run), "--contexts", "[4, 8]", "--out", str(tmp_path)]
    assert message in fails(capsys, [*base, *args])
    assert not (tmp_path / "recl.json").exists()


def test_empty_prompt_ids_are_named(char_run, capsys):
    """It was "input_ids must be a non-empty [batch, seq_len] tensor", an argument the user never gave."""
    line = fails(capsys, ["generate", "--model", str(char_run), "--prompt_ids", "[]"])
    assert "--prompt_ids is empty: give at least one token id" in line


def test_a_tiny_top_p_keeps_the_most_likely_token(char_run):
    model = TransformerXLLM.from_pretrained(best_checkpoint(char_run))
    prompt = torch.tensor([[3, 4, 5]])
    g = torch.Generator().manual_seed(0)
    nucleus = generate(model, prompt, 12, temperature=1.0, top_p=1e-9, generator=g)
    sharp = generate(model, prompt, 12, temperature=1e-30)  # tiny temperature: no overflow, the arg max
    assert nucleus.equal(generate(model, prompt, 12, temperature=0.0)) and sharp.equal(nucleus)


@pytest.mark.parametrize("kind", ["char", "word"])
def test_generated_text_streams_with_separators(char_run, word_run, monkeypatch, capsys, kind):
    run = char_run if kind == "char" else word_run
    prompt = "Ab" if kind == "char" else Tokenizer.load(best_checkpoint(run)).decode([5, 9])
    args = ["generate", "--model", str(run), "--prompt", prompt, "--max_new_tokens", "20", "--seed", "3"]
    main([*args, "--json"])
    record = json.loads(capsys.readouterr().out)
    tok = Tokenizer.load(best_checkpoint(run))
    forwards, writes = [], []  # what was written after how many forward passes of the model

    def count(module, inputs, output):
        if isinstance(module, TransformerXL):
            forwards.append(1)

    class Out:
        def write(self, s):
            writes.append((len(forwards), s))

        def flush(self):
            pass

    hook = torch.nn.modules.module.register_module_forward_hook(count)
    monkeypatch.setattr(sys, "stdout", Out())
    try:
        main(args)
    finally:
        hook.remove()
    text = "".join(s for _, s in writes)
    assert text == tok.decode(record["prompt_ids"] + record["new_ids"]) + "\n"  # prompt, separator, continuation
    if kind == "word":
        assert text.startswith(prompt + " ")  # not glued to the continuation ("the kinghalf")
    assert {k for k, s in writes if s} >= set(range(1, 21))  # each token written before the next forward pass


def test_stream_decoder_equals_decode():
    rng = np.random.default_rng(0)
    byte = Tokenizer.bytes256()
    char = Tokenizer("char", ["a", "b", "\n", "é"])
    word = Tokenizer("word", ["<eos>", "x", "yy", "<unk>"], unk_token="<unk>", line_end="eos")
    utf8 = list("é€😀".encode())
    for tok in (byte, char, word):
        for _ in range(50):
            ids = rng.integers(0, tok.vocab_size, rng.integers(0, 12)).tolist()
            if tok is byte:
                ids = utf8[: rng.integers(0, len(utf8) + 1)] + ids  # multi-byte characters cut anywhere
            dec = tok.stream_decoder()
            assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)


def test_threads_option(char_run, capsys):
    threads = torch.get_num_threads()
    try:
        main(["generate", "--model", str(char_run), "--prompt", "Ab", "--max_new_tokens", "2"])
        assert torch.get_num_threads() == 1  # generation's default
        main(["generate", "--model", str(char_run), "--prompt", "Ab", "--max_new_tokens", "2", "--threads", "2"])
        assert torch.get_num_threads() == 2
        main(["eval", "--model", str(char_run), "--max_batches", "1", "--threads", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_binary_config_json_is_named(char_run, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes(bytes(range(128, 256)))
    for args in (["eval", "--model", str(model)], ["generate", "--model", str(model), "--prompt_ids", "[1]"]):
        line = fails(capsys, args)
        assert f"{model / 'config.json'}: not a JSON text file" in line


def test_a_run_that_saved_no_checkpoint_is_named_as_such(tmp_path, capsys):
    """A run folder that stopped before its first checkpoint (here: its log only) is a run without a checkpoint for
    eval and generate, not 'no config.json here'."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("training ...\n")
    for args in (["eval", "--model", str(run)], ["generate", "--model", str(run), "--prompt_ids", "[1]"]):
        assert f"{run}: the run has no complete checkpoint yet" in fails(capsys, args)


def test_a_file_where_the_run_folder_goes_is_named(tmp_path, capsys):
    """--run_dir naming a file, or a folder under a file: one line that says a file is in the way (exit 2)."""
    corpus = tiny_corpus(tmp_path / "corpus")
    (tmp_path / "afile").write_text("not a folder\n")
    base = ["train", "--config", "configs/debug.yaml", "--data.path", str(corpus), "--data.dataset", "custom"]
    for run in (tmp_path / "afile", tmp_path / "afile" / "run"):
        line = fails(capsys, [*base, "--run_dir", str(run), "--train.max_steps", "1"])
        assert line.startswith(f"txl: error: {run}: ") and "a file is in the way of a folder" in line


def test_train_threads_and_non_utf8_hint_name_real_options(tmp_path, capsys):
    line = fails(capsys, ["train", "--config", "configs/debug.yaml", "--train.threads", "-1"])
    assert "train.threads = -1" in line
    corpus = tiny_corpus(tmp_path / "corpus")
    (corpus / "valid.txt").write_bytes(b"good line\nbad \xff byte\n")
    args = ["train", "--config", "configs/debug.yaml", "--data.path", str(corpus), "--data.dataset", "custom"]
    args += ["--data.cache_dir", str(tmp_path / "cache"), "--run_dir", str(tmp_path / "run"), "--train.max_steps", "1"]
    line = fails(capsys, args)
    assert f"{corpus / 'valid.txt'}:2: invalid UTF-8 byte 0xff" in line and "--data.encoding_errors replace" in line
    main([*args, "--data.encoding_errors", "replace"])  # the option the hint names exists and works
    assert (tmp_path / "run" / "checkpoints" / "step-1").is_dir()


def test_whitespace_only_text_builds_no_vocabulary(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_text("   \n\t\n \n")
    args = ["train", "--config", "configs/debug.yaml", "--data.path", str(data), "--data.dataset", "custom"]
    line = fails(capsys, [*args, "--data.cache_dir", str(tmp_path / "c"), "--run_dir", str(tmp_path / "r")])
    assert f"{data / 'train.txt'}: no token to build a vocabulary from (the text is empty or only whitespace)" in line
    assert not (tmp_path / "r" / "checkpoints").exists()


def _damaged_copy(run, tmp_path, damage) -> str:
    src = best_checkpoint(run)
    dst = tmp_path / "damaged"
    dst.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "run.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_integer_and_nan_weights_are_refused(char_run, tmp_path, capsys):
    key = "transformer.layers.0.ff.layer_1.weight"

    def to_int(t):
        t[key] = t[key].long()

    def to_nan(t):
        t[key][0, :3] = math.nan

    model = _damaged_copy(char_run, tmp_path / "int", to_int)
    line = fails(capsys, ["eval", "--model", model])
    assert f"not floating-point (weights are never cast): {key}: torch.int64" in line
    model = _damaged_copy(char_run, tmp_path / "nan", to_nan)
    for args in (["eval", "--model", model], ["generate", "--model", model, "--prompt", "Ab"]):
        line = fails(capsys, args)
        assert f"non-finite values (NaN/inf; a diverged or corrupted checkpoint): {key} (3 of " in line


def test_a_non_finite_loss_is_reported(char_run, tmp_path, capsys):
    def overflow(t):  # finite weights whose activations overflow to inf
        t["transformer.layers.0.ff.layer_1.weight"].fill_(3e38)

    model = _damaged_copy(char_run, tmp_path, overflow)
    line = fails(capsys, ["eval", "--model", model, "--max_batches", "2"], code=1)
    assert "the loss on test split of" in line and "non-finite probability" in line
    line = fails(capsys, ["generate", "--model", model, "--prompt", "Ab"], code=1)
    assert "non-finite log-probabilities for new token 1" in line


def test_new_text_is_read_with_the_model_tokenizer(char_run, tmp_path, capsys, monkeypatch):
    """`txl eval --data` on a folder or a file of plain text with a char model (it once said "this dataset uses
    word"): the model's tokenizer.json decides how the text is read; --dataset is not needed."""
    docs = tmp_path / "docs"
    docs.mkdir()
    text = "Abc def ghi.\nJkl mno abc.\n" * 40
    for i in range(4):
        (docs / f"doc{i}.txt").write_text(text)
    model = best_checkpoint(char_run)
    tok = Tokenizer.load(model / "tokenizer.json")
    lm = TransformerXLLM.from_pretrained(model)

    main(["eval", "--model", str(char_run), "--data", str(docs / "doc0.txt"), "--batch_size", "2", "--json"])
    got = json.loads(capsys.readouterr().out)
    ids = np.array(tok.encode(text), dtype=np.int64)
    ref = evaluate(lm, ids, batch_size=2, tgt_len=got["tgt_len"], mem_len=got["mem_len"], same_length=True)
    assert got["data"] == str(docs / "doc0.txt") and got["tokens"] == ref.tokens
    assert got["loss"] == pytest.approx(ref.loss, rel=1e-6)

    main(["eval", "--model", str(char_run), "--data", str(docs), "--batch_size", "1", "--json"])
    folder = json.loads(capsys.readouterr().out)  # a flat folder of documents: its held-out test document
    ids = np.array(tok.encode(text), dtype=np.int64)
    ref = evaluate(lm, ids, batch_size=1, tgt_len=16, mem_len=64, same_length=True)
    assert folder["loss"] == pytest.approx(ref.loss, rel=1e-6)


def test_eval_tokenizes_at_most_once(char_run, tmp_path, monkeypatch, capsys):
    import txl.data.corpus as corpus_mod

    encoded = []
    original = corpus_mod._encode_split
    monkeypatch.setattr(corpus_mod, "_encode_split", lambda *a, **k: encoded.append(a[2]) or original(*a, **k))
    main(["eval", "--model", str(char_run), "--max_batches", "1"])
    assert encoded == []  # the run's own cache, with the model's tokenizer: nothing to tokenize
    cfg = json.loads((best_checkpoint(char_run) / "run.json").read_text())
    run_json = best_checkpoint(char_run) / "run.json"
    moved = {**cfg, "data": {**cfg["data"], "cache_dir": str(tmp_path / "elsewhere")}}
    monkeypatch.setattr(
        "txl.config.read_json", lambda p, _real=json.loads: moved if p == run_json else _real(p.read_text())
    )
    main(["eval", "--model", str(char_run), "--max_batches", "1"])
    assert encoded == ["train", "valid", "test"]  # one tokenization of the corpus, not two
    assert prepare_corpus(**moved["data"]).tokenizer.symbols == Tokenizer.load(run_json.parent).symbols


def test_generate_stop_tokens_and_no_stream(char_run, capsys):
    base = ["generate", "--model", str(char_run), "--prompt", "Ab", "--max_new_tokens", "60", "--seed", "1"]
    main([*base, "--json"])
    free = json.loads(capsys.readouterr().out)
    tok = Tokenizer.load(best_checkpoint(char_run))
    stop = tok.symbols[free["new_ids"][5]]  # a character the continuation produces at its sixth step
    main([*base, "--json", "--stop", stop])
    stopped = json.loads(capsys.readouterr().out)["new_ids"]
    first = free["new_ids"].index(tok.token_to_id(stop))
    assert stopped == free["new_ids"][: first + 1]  # up to and including the stop token
    earlier = tok.symbols[free["new_ids"][2]]  # a list of stops: the first one produced ends the text
    main([*base, "--json", "--stop", json.dumps([stop, earlier])])
    listed = json.loads(capsys.readouterr().out)["new_ids"]
    assert listed == free["new_ids"][: min(first, free["new_ids"].index(tok.token_to_id(earlier))) + 1]
    main([*base, "--stop_ids", f"[{tok.token_to_id(stop)}]", "--stream", "false"])
    assert capsys.readouterr().out == tok.decode(free["prompt_ids"] + stopped) + "\n"
    assert "is 2 tokens for this tokenizer" in fails(capsys, [*base, "--stop", "ab"])
    assert "a line break is --stop $'\\n'" in fails(capsys, [*base, "--stop", "\\n"])  # a backslash and an n
    assert "--stop_ids must be token ids" in fails(capsys, [*base, "--stop_ids", "[100000]"])


def test_a_file_of_a_model_folder_names_its_folder(char_run, capsys):
    """--model PATH/model.safetensors (or its config.json) is the model folder that holds it; any other file is
    one error saying what --model takes."""
    step = best_checkpoint(char_run)
    printed = []
    for model in (step, step / "model.safetensors", step / "config.json"):
        main(["eval", "--model", str(model), "--max_batches", "1", "--json"])
        record = json.loads(capsys.readouterr().out)
        printed.append({k: v for k, v in record.items() if k not in ("seconds", "tokens_per_s")})  # (the speed)
    assert printed[0] == printed[1] == printed[2] and printed[0]["model"] == str(step)
    assert "expected a run folder, step-N folder or model folder" in fails(capsys, ["eval", "--model", __file__])


def test_the_run_s_data_gone_says_to_give_the_text(char_run, tmp_path, capsys, monkeypatch):
    """A run evaluated from another folder (its data.path relative) or after its data moved: one line saying so and
    what to give, not a hint to download a dataset."""
    import shutil

    step = tmp_path / "step"
    shutil.copytree(best_checkpoint(char_run), step)
    record = json.loads((step / "run.json").read_text())
    record["data"] |= {"path": "corpus", "dataset": "custom"}  # as given to txl train in another folder
    (step / "run.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    message = fails(capsys, ["eval", "--model", str(step)])
    assert message == (
        "txl: error: corpus: the run's data (data.path, relative to the folder txl train ran in) is not here: "
        "give the text with --data"
    )
    assert "txl data get" not in fails(capsys, ["data", "prepare", "--data.path", "corpus", "--data.dataset", "custom"])


def test_a_stop_word_outside_the_vocabulary_is_refused(word_run, capsys):
    """A word model reads an unknown word as <unk>: as a stop it would end the text at any unknown word."""
    tok = Tokenizer.load(best_checkpoint(word_run))
    assert tok.unk_token is not None
    base = ["generate", "--model", str(word_run), "--prompt", tok.symbols[5], "--max_new_tokens", "5"]
    message = fails(capsys, [*base, "--stop", "zzqx"])
    assert f"--stop 'zzqx' is not in the model's vocabulary (it reads as {tok.unk_token})" in message
    main([*base, "--stop", tok.unk_token, "--json"])  # <unk> itself, asked for
    assert len(json.loads(capsys.readouterr().out)["new_ids"]) >= 1


def test_eval_and_generate_leave_the_onednn_route_off(char_run, capsys, monkeypatch):
    """The oneDNN fp32 route (txl.kernels.runtime) pays for training's products only: txl eval and txl generate must not
    turn it on (it made evaluation 0.84-0.91x and generation 3x slower on an AVX-512 EPYC)."""
    import txl.kernels.runtime

    def refuse(*args, **kwargs):
        raise AssertionError("the oneDNN route was chosen outside training")

    monkeypatch.setattr(txl.kernels.runtime, "choose_fp32_matmul", refuse)
    before = torch.backends.mkldnn.matmul.fp32_precision
    main(["eval", "--model", str(char_run), "--max_batches", "1"])
    main(["generate", "--model", str(char_run), "--prompt", "Ab", "--max_new_tokens", "2"])
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_a_hugging_face_hub_name_says_how_to_get_the_model(tmp_path, capsys, monkeypatch):
    """txl never downloads: a Hub name given as --model (or to convert hf) says how to download and import it; a
    missing folder under an existing one (a typo) does not get that advice."""
    monkeypatch.chdir(tmp_path)
    line = fails(capsys, ["generate", "--model", "transfo-xl/transfo-xl-wt103", "--prompt", "hi"])
    assert "transfo-xl/transfo-xl-wt103: not found" in line
    assert "`hf download transfo-xl/transfo-xl-wt103 --local-dir transfo-xl-wt103`" in line
    assert "`txl convert hf transfo-xl-wt103 transfo-xl-wt103-txl`" in line
    line = fails(capsys, ["convert", "hf", "transfo-xl/transfo-xl-wt103", "out"])
    assert "not a directory" in line and "hf download transfo-xl/transfo-xl-wt103" in line
    (tmp_path / "runs").mkdir()
    line = fails(capsys, ["eval", "--model", "runs/my-bok", "--data", "x.txt"])
    assert "runs/my-bok: not found" in line and "hf download" not in line


def test_an_unknown_option_gets_the_nearest_one(tmp_path, capsys):
    """A typo, or Hugging Face's name for a field (on the command line or in a recipe), names the option meant."""
    from tests.conftest import ROOT

    debug = str(ROOT / "configs" / "debug.yaml")
    line = fails(capsys, ["eval", "--modle", "runs/x"])
    assert "unrecognized arguments: --modle runs/x; did you mean --model?" in line
    line = fails(capsys, ["train", "--config", debug, "--trian.max_steps", "5"])
    assert "did you mean --train.max_steps?" in line
    line = fails(capsys, ["generate", "--model", "x", "--temprature=0.5"])
    assert "did you mean --temperature?" in line
    line = fails(capsys, ["train", "--config", debug, "--model.vocab_size", "5"])
    assert "did you mean --model.n_token (Hugging Face's vocab_size)?" in line
    recipe = tmp_path / "hf.yaml"
    recipe.write_text("model:\n  vocab_size: 100\n  tie_word_embeddings: true\n")
    line = fails(capsys, ["train", "--config", str(recipe)])
    assert "does not accept option 'model.vocab_size'; did you mean --model.n_token (Hugging Face's vocab_size)" in line
    assert "did you mean" not in fails(capsys, ["eval", "--model", "x", "--bogus", "1"])
    # a bare word: the option it belongs to (the model folder, a recipe); none where the option was given
    assert "did you mean --model runs/x (the model is an option)?" in fails(capsys, ["generate", "runs/x"])
    assert "did you mean --model runs/x" in fails(capsys, ["eval", "runs/x", "--split", "valid"])
    assert f"did you mean --config {debug} (a recipe is an option)?" in fails(capsys, ["train", debug])
    assert "did you mean" not in fails(capsys, ["train", "runs/x"])  # train's --model is the model's settings
    assert "did you mean" not in fails(capsys, ["generate", "--model", "y", "runs/x"])


def test_eval_says_what_the_columns_leave_unscored(char_run, tmp_path, capsys):
    """The paper's batchify cuts a text into batch_size columns of len // batch_size tokens: `txl eval` says how many
    tokens at the end it did not score (none with --batch_size 1, and nothing said then)."""
    f = tmp_path / "t.txt"
    f.write_text("Abc def ghi jkl mno pab cde fgh ijk lmn op abc def ghi jkl mno pab cde fgh ijk lmn op abc def ghi jk")
    n = len(f.read_text())  # (a char model: a token per character)
    main(["eval", "--model", str(char_run), "--data", str(f), "--batch_size", "10", "--json"])
    out = capsys.readouterr()
    scored = json.loads(out.out)["tokens"]
    assert scored == 10 * (n // 10 - 1) < n - 1
    assert f"the last {n - 1 - scored} tokens of the text were not scored: it is cut into 10 columns" in out.err
    main(["eval", "--model", str(char_run), "--data", str(f), "--batch_size", "1", "--json"])
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == n - 1 and "not scored" not in out.err


def test_a_closed_output_is_one_line_not_a_folder_error(tmp_path, monkeypatch):
    """`txl ... | head -1`: the reader exits, the next print raises BrokenPipeError (an OSError); the command stops
    with one line saying so, not "check that folder's permissions and free space"."""
    import io

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    corpus = tiny_corpus(tmp_path / "corpus")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", Closed())
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(SystemExit) as stop:
        main(["data", "prepare", "--data.path", str(corpus), "--data.dataset", "custom",
              "--data.cache_dir", str(tmp_path / "cache")])  # fmt: skip
    assert stop.value.code == 1
    last = err.getvalue().strip().splitlines()[-1]  # (after the corpus's progress lines)
    assert last == "txl: stopped: the output was closed before the command finished (its reader exited)"
    assert "permissions" not in err.getvalue()


def test_an_image_goes_where_the_command_says_and_its_path_is_checked_first(char_run, tmp_path, capsys, monkeypatch):
    """`txl plot RUN --out FOLDER` wrote FOLDER.png and printed FOLDER; `--out curves` wrote curves.png and printed
    curves; `txl eval --plot sweep.txt` failed in matplotlib after every evaluation of the sweep. Now a folder takes
    the default name, a name without an extension takes .png (and the printed path is the file's), and an extension
    matplotlib cannot write, a missing folder or recl's --out that is a file are one line before any work."""
    import txl.infer.evaluate as evaluate_module

    folder = tmp_path / "images"
    folder.mkdir()
    main(["plot", str(char_run), "--out", str(folder)])
    assert capsys.readouterr().out.strip() == str(folder / "loss.png") and (folder / "loss.png").is_file()
    main(["plot", str(char_run), "--out", str(tmp_path / "curves")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "curves").exists()
    svg = tmp_path / "curves.svg"
    main(["plot", str(char_run), "--out", str(svg)])
    assert b"<svg" in svg.read_bytes()[:1000]
    config = char_run / "config.yaml"
    before = config.read_bytes()
    line = fails(capsys, ["plot", str(char_run), "--out", str(config)])
    assert f"--out {config}: an image's format is its extension, and .yaml is none matplotlib writes" in line
    assert config.read_bytes() == before
    assert "no folder" in fails(capsys, ["plot", str(char_run), "--out", str(tmp_path / "none" / "x.png")])
    calls = []
    monkeypatch.setattr(evaluate_module, "evaluate_steps", lambda *a, **k: calls.append(1))
    text = tmp_path / "t.txt"
    text.write_text("Abc def ghi. " * 40)
    args = ["eval", "--model", str(char_run), "--data", str(text), "--mem_len", "[0, 8]"]
    assert "--plot " in fails(capsys, [*args, "--plot", str(tmp_path / "sweep.txt")]) and not calls
    recl = ["recl", "--models", str(char_run), str(char_run), "--contexts", "[4, 8]", "--data", str(text)]
    assert f"--out {text}: a file, not a folder" in fails(capsys, [*recl, "--out", str(text)])
    maps = ["attention", "--model", str(char_run), "--data", str(text)]
    assert f"--out {text}: a file, not a folder" in fails(capsys, [*maps, "--out", str(text)])
    assert text.read_text() == "Abc def ghi. " * 40


def test_recl_s_plot_draws_its_threshold(tmp_path):
    """The plot drew the paper's 0.01 whatever --threshold was."""
    from txl.infer.recl import ReclResult, plot_gains

    drawn = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.axhline

    def record(self, y=0, *a, **k):
        drawn.append(y)
        return original(self, y, *a, **k)

    result = ReclResult(r=1.0, contexts=[4, 8, 12], gains={"m": [0.2, 0.05]}, recl={"m": 8}, reached={"m": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(matplotlib.axes.Axes, "axhline", record)
        plot_gains([result], tmp_path / "recl.png", threshold=0.1)
    assert drawn == [0.1] and (tmp_path / "recl.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("min_freq", "-1", "data.min_freq = -1: must be >= 0"),
        ("max_size", "0", "data.max_size = 0: must be >= 1 (or null: no limit)"),
        ("valid_shard", "-1", "data.valid_shard = -1: must be in 0..49"),
        ("valid_shard", "50", "data.valid_shard = 50: must be in 0..49"),
    ],
)
def test_the_vocabulary_s_numbers_are_checked_before_any_file(option, value, message, tmp_path, capsys):
    """`--data.min_freq -1` and `--data.valid_shard -1` were taken (as 1, or unused outside lm1b); `--data.max_size 0`
    was refused as an empty vocabulary after the text was read. One line naming the option, in `txl data prepare` and
    in `txl train`, before the cache or the run folder is made. (min_freq 0, the original code's and Hugging Face's
    default, keeps every symbol, as 1 does.)"""
    corpus = tiny_corpus(tmp_path / "corpus")
    data = ["--data.path", str(corpus), "--data.dataset", "custom", "--data.cache_dir", str(tmp_path / "cache")]
    assert message in fails(capsys, ["data", "prepare", *data, f"--data.{option}", value])
    train = ["train", "--config", str(DEBUG), *data, "--run_dir", str(tmp_path / "run")]
    assert message in fails(capsys, [*train, f"--data.{option}", value])
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
