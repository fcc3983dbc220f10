"""Options whose values torch or numpy would take only deep inside a run (a seed out of range, a step larger than the
memory, a validation split too small for its columns, threads below one): each is one line naming the option, before
any file is written, and an allocation that still fails is one line too, not torch's traceback."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from test_finetune import args as finetune_args
from test_finetune import make_data
from train_helpers import run_inprocess, train_args
from txl.cli import main
from txl.cli.app import _error
from txl.kernels import runtime


def fails(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and lines and lines[-1].startswith("txl: error: "), lines
    return lines[-1]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return run_inprocess(tmp_path_factory.mktemp("lm"), train__max_steps=2, train__eval_interval=0)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("train.seed", str(2**63), f"train.seed = {2**63}: a seed is a whole number from -2**63 to 2**63 - 1"),
        ("train.seed", str(2**64), f"train.seed = {2**64}: a seed is a whole number"),  # (torch: < 2**64)
        ("train.eval_batch_size", "100000", "train.eval_batch_size = 100000: the valid split's 4,"),
    ],
)
def test_train_refuses_before_writing(tmp_path, capsys, option, value, message):
    run = tmp_path / "run"
    line = fails(capsys, train_args(tmp_path, **{option.replace(".", "__"): value}))
    assert message in line, line
    assert not run.exists()


def test_a_negative_seed_trains_as_torch_reads_it(tmp_path, lm):
    """A negative seed (torch reads it as seed + 2**64) failed inside numpy ("expected non-negative integer") where
    the data order draws from it: txl train's varlen segments and txl finetune's order. Now numpy takes the same 64
    bits (seed % 2**64, which leaves every seed >= 0 as it was)."""
    from txl.data import OrderedIterator

    run_inprocess(tmp_path, "neg", train__seed=-5, train__varlen="true", train__max_steps=2, train__eval_interval=0)
    assert (tmp_path / "neg" / "checkpoints" / "step-2").is_dir()
    ids = np.arange(10_000)
    lengths = lambda seed: [b.seq_len for b in OrderedIterator(ids, 2, 20, varlen=True, seed=seed)]  # noqa: E731
    assert lengths(-5) == lengths(2**64 - 5) != lengths(5)
    data = make_data(tmp_path / "data", "single")
    main(finetune_args(lm, data, tmp_path / "ft", seed=-5, max_steps=2, eval_interval=2, checkpoint_interval=2))
    assert (tmp_path / "ft" / "checkpoints" / "step-2").is_dir()


@pytest.mark.parametrize(
    "overrides, step",
    [
        ({"train__tgt_len": 64}, "4 rows x 64 positions with mem_len 16"),
        ({"train__tgt_len": 10_000_000}, "4 rows x 10,009 positions with mem_len 16"),  # (40,040 tokens in 4 columns)
        (
            {"train__tgt_len": 128, "train__batch_chunk": 2, "train__varlen": "true"},  # (a chunk; varlen: up to +15)
            "2 rows x 143 positions with mem_len 16",
        ),
    ],
)
def test_a_training_step_larger_than_the_memory_is_refused_first(tmp_path, capsys, monkeypatch, overrides, step):
    """The estimate counts the rows of one chunk and the segment the text can give (a column of the stream), not
    tgt_len as typed."""
    monkeypatch.setattr(runtime, "available_memory", lambda: 400_000)  # (bytes: the model's 20,099 parameters fit)
    line = fails(capsys, train_args(tmp_path, "small", train__max_steps=1, **overrides))
    assert f"a training step of {step} needs about" in line, line
    assert "give a smaller train.tgt_len, train.batch_size or model.mem_len" in line
    assert not (tmp_path / "small").exists()


def test_evaluation_past_the_text_s_columns_holds_only_what_they_give(lm):
    """A segment and a memory longer than a column (tgt_len, mem_len 10**9 over 2 columns of 999 tokens) read each
    column as one segment: the K/V cache holds what the text gives (it was sized by the lengths asked: 10**9
    positions), the same loss as the lengths of a column."""
    from txl.infer.evaluate import evaluate
    from txl.model.modeling import TransformerXLLM
    from txl.train.checkpoint import best_checkpoint

    model = TransformerXLLM.from_pretrained(best_checkpoint(lm))
    ids = np.random.default_rng(0).integers(0, model.config.n_token, 2000)
    huge = evaluate(model, ids, batch_size=2, tgt_len=10**9, mem_len=10**9, same_length=False)
    column = evaluate(model, ids, batch_size=2, tgt_len=999, mem_len=999, same_length=False)
    assert huge.tokens == column.tokens == 2 * 999 and huge.batches == 1
    assert huge.loss == pytest.approx(column.loss, rel=1e-6)


def test_generation_holds_what_its_tokens_give(lm):
    """A memory longer than the prompt and the new tokens (mem_len 10**9) is sized by them: the same tokens as that
    length exactly (the library's stream, its beam search, the server's engine); it was sized by mem_len."""
    from txl.infer.generation import beam_search, generate, stream
    from txl.model.modeling import TransformerXLLM
    from txl.serve.engine import Engine, Generation
    from txl.train.checkpoint import best_checkpoint

    model = TransformerXLLM.from_pretrained(best_checkpoint(lm))
    prompt = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])

    def sampled(mem_len: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return torch.cat(list(stream(model, prompt, 12, mem_len=mem_len, generator=g)), dim=1)

    assert torch.equal(sampled(10**9), sampled(16))
    beams = [beam_search(model, prompt, 6, num_beams=3, mem_len=m) for m in (10**9, 10)]
    assert torch.equal(beams[0], beams[1])
    prompts, lengths = [[1, 2, 3], [4] * 20, [5, 6]], [25, 40, 10]  # (joined in one batch: their caches merged)
    got, done = [[] for _ in prompts], threading.Semaphore(0)
    engine = Engine(model, max_batch=4)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        emit = lambda tok, i=i: done.release() if tok is None else got[i].append(tok)  # noqa: E731
        engine.submit(Generation(p, n, emit, mem_len=10**9, temperature=0.0))
    for _ in prompts:
        assert done.acquire(timeout=60)
    engine.shutdown()
    for p, n, tokens in zip(prompts, lengths, got, strict=True):
        assert (
            tokens == generate(model, torch.tensor([p]), n, temperature=0.0, mem_len=len(p) + n)[0, len(p) :].tolist()
        )


def test_a_long_prompt_is_read_in_pieces_and_one_whose_pieces_do_not_fit_is_refused_first(lm, capsys, monkeypatch):
    """`txl generate --prompt` of 130,000 characters (a char model; the shell's limit for one argument is 128 KiB) was
    killed by the system, no message, exit 137: the prompt's one pass holds a [T, K] mask, T * (T + M) bytes (~34 GiB
    measured there). A long prompt is now read in pieces (txl.infer.prompt.read_prompt: [1024, K] each), so a prompt
    whose one pass would not fit in the memory runs; the estimate counts the pieces, and a prompt whose pieces do not
    fit is refused in one line naming its length, before any work."""
    from txl.cli.common import attention_pass_bytes
    from txl.infer.prompt import PROMPT_CHUNK
    from txl.kernels import runtime
    from txl.model.config import TransformerXLConfig

    words = "ab cd ef gh ij kl mn op "
    long = (words * (30_000 // len(words) + 1))[:30_000]
    config = TransformerXLConfig.from_pretrained(lm)
    monkeypatch.setattr(runtime, "available_memory", lambda: 2 * 2**30)
    assert attention_pass_bytes(config, 1, 30_000, 30_000) > 2 * 2**30  # (one pass: refused before, at 2 GiB free)
    main(["generate", "--model", str(lm), "--prompt", long, "--max_new_tokens", "2"])  # (same_length: window 64)
    assert capsys.readouterr().out.startswith(long)
    # without same_length each piece sees the whole prompt before it: [1024, 30,000] for the last one
    assert attention_pass_bytes(config, 1, PROMPT_CHUNK, 30_000) > 48 * 2**20
    monkeypatch.setattr(runtime, "available_memory", lambda: 48 * 2**20)
    line = fails(capsys, ["generate", "--model", str(lm), "--prompt", long, "--max_new_tokens", "2", "--same_length",
                          "false"])  # fmt: skip
    assert "txl generate (30,000 prompt tokens, mem_len" in line and "give a shorter prompt" in line


def test_txl_eval_counts_the_scores_only_where_they_are_held(lm, tmp_path, capsys, monkeypatch):
    """The native CPU kernel reads a segment's scores in blocks: its pass holds the [T, K] mask (~2 bytes an entry,
    measured), not the [H, T, K] scores. `txl eval --tgt_len 40000` over a 130,000-character text ran in 3.7 GB and
    was refused at "35.8 GiB"; without the kernel (TXL_NATIVE=0, bf16) the scores are counted as before."""
    from txl.kernels import native, runtime
    from txl.kernels.backends import Backends, use_backends
    from txl.kernels.runtime import effective_precision

    if native.library() is None:
        pytest.skip(f"no native kernels here: {native.status()}")
    text = tmp_path / "t.txt"
    text.write_text("ab cd ef gh. " * 800)  # (10,400 characters: one column of 10,000 at batch 1)
    monkeypatch.setattr(runtime, "available_memory", lambda: 2**30)  # (the mask: 0.3 GiB; the scores: 2 GiB)
    args = ["eval", "--model", str(lm), "--data", str(text), "--tgt_len", "10000", "--batch_size", "1"]
    main(args)
    assert "loss" in capsys.readouterr().out
    with use_backends(Backends(native_kernels=False)):
        assert "txl eval with mem_len" in fails(capsys, args)
    if effective_precision(torch.device("cpu"), "bf16")[0] == "bf16":
        assert "txl eval with mem_len" in fails(capsys, [*args, "--precision", "bf16"])
    else:  # (a CPU without bf16 instructions evaluates in fp32, with a note: the native kernel's pass, as above)
        main([*args, "--precision", "bf16"])
        printed = capsys.readouterr()
        assert "loss" in printed.out and "--precision bf16, but" in printed.err


def test_txl_attention_estimates_the_maps_it_keeps(lm, tmp_path, capsys, monkeypatch):
    """txl attention keeps every layer's and head's [T, K] probabilities of a segment: `--tgt_len 30000 --tokens
    30000` asked ~86 GiB of a 23 GiB machine and was killed. The estimate counts them, one line, before any work;
    a segment that fits is mapped."""
    from txl.kernels import runtime

    text = tmp_path / "t.txt"
    text.write_text("ab cd ef gh. " * 300)  # (3,900 characters)
    monkeypatch.setattr(runtime, "available_memory", lambda: 200 * 2**20)
    out = tmp_path / "maps"
    args = ["attention", "--model", str(lm), "--data", str(text), "--out", str(out), "--mem_len", "16"]
    line = fails(capsys, [*args, "--tokens", "3000", "--tgt_len", "3000"])
    assert "txl attention over segments of 3,000 tokens with a memory of 0" in line and "--tgt_len" in line, line
    assert not out.exists()
    main([*args, "--tokens", "600", "--tgt_len", "300"])
    assert (out / "attention.json").is_file()


def test_txl_eval_estimates_what_the_text_gives(lm, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("ab cd ef gh. " * 100)
    main(["eval", "--model", str(lm), "--data", str(text), "--tgt_len", "100000000", "--mem_len", "100000000"])
    assert "loss" in capsys.readouterr().out
    line = fails(
        capsys, ["eval", "--model", str(lm), "--data", str(text), "--mem_len", "100000000", "--zero_memory", "true"]
    )  # fmt: skip  (a zero memory of mem_len positions is real)
    assert "txl eval with mem_len 100,000,000 and tgt_len" in line and "GiB of memory" in line, line


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("threads", "-2", "--threads = -2: must be >= 1"),
        ("warmup_steps", "-1", "--warmup_steps = -1: must be >= 0"),
        ("weight_decay", "-1.0", "--weight_decay = -1.0: must be >= 0"),
        ("seed", str(2**64), f"--seed = {2**64}: a seed is a whole number from -2**63 to 2**63 - 1"),
    ],
)
def test_finetune_refuses_before_writing(lm, tmp_path, capsys, option, value, message):
    data = make_data(tmp_path / "data", "single")
    run = tmp_path / "run"
    line = fails(capsys, finetune_args(lm, data, run, **{option: value}))
    assert message in line, line
    assert not run.exists()


def test_a_fine_tuning_step_is_estimated_by_its_documents(lm, tmp_path, capsys, monkeypatch):
    """No segment is longer than the longest document (left padding fills only the first one's rest): a huge
    --tgt_len over short texts trains, and the estimate counts the documents' longest."""
    data = make_data(tmp_path / "data", "single")
    main(finetune_args(lm, data, tmp_path / "huge", tgt_len=100_000_000, max_steps=2, eval_interval=2))
    assert (tmp_path / "huge" / "checkpoints" / "step-2").is_dir()
    free = next(lm.rglob("model.safetensors")).stat().st_size + 1000  # (the weights fit, the step does not)
    monkeypatch.setattr(runtime, "available_memory", lambda: free)
    line = fails(capsys, finetune_args(lm, data, tmp_path / "small", tgt_len=100_000_000))
    assert "a fine-tuning step of 8 documents x segments of 1" in line and "segments of 100,000,000" not in line
    assert f"more than the {runtime._size(free)} free here" in line and "0.0 GiB" not in line  # (in their own unit)
    assert not (tmp_path / "small").exists()


def test_an_allocation_that_fails_is_one_line():
    """Past the estimates, torch's own out-of-memory errors (the CPU allocator's, a GPU's) are one line with what
    was asked and what to do; other runtime errors stay tracebacks (bugs)."""
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 102400000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    code, line = _error(cpu)
    assert code == 1 and line.startswith("txl: error: out of memory (an allocation of 95.4 GiB failed)"), line
    assert "give the command smaller sizes" in line and "\n" not in line
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity")
    code, line = _error(gpu)
    assert code == 1 and "out of memory (CUDA out of memory)" in line, line
    assert _error(RuntimeError("shape mismatch")) is None


def test_a_validation_that_fails_keeps_the_steps_before_it(tmp_path, capsys, monkeypatch):
    """A validation that fails (here: out of memory at step 6 of a run saving only at its end) lost every step since
    the last checkpoint. They are saved first, the error is one line, and `--resume auto` goes on from them."""
    import txl.train.trainer as trainer_module
    from txl.train.checkpoint import latest_checkpoint

    real = trainer_module.evaluate

    def failing(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10737418240 bytes.")

    monkeypatch.setattr(trainer_module, "evaluate", failing)
    args = train_args(tmp_path, train__max_steps=10, train__eval_interval=6, train__checkpoint_interval=0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err.strip().splitlines()[-1].startswith("txl: error: out of memory (an allocation")
    assert "the validation at step 6 failed: the steps before it were saved first" in out
    assert latest_checkpoint(tmp_path / "run").name == "step-6"
    monkeypatch.setattr(trainer_module, "evaluate", real)
    main([*args, "--resume", "auto"])
    assert latest_checkpoint(tmp_path / "run").name == "step-10"
