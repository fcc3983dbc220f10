"""The evaluations of the paper's experiments: sliding windows (the vanilla model's, equal to a naive per-token loop),
per-token losses, memory sweeps and RECL through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.infer.evaluate import eval_text, evaluate, evaluate_sliding, sliding_windows
from txl.train.checkpoint import read_run_config, resolve_model_dir


def naive(model: TransformerXLLM, ids: np.ndarray, window: int, stride: int) -> float:
    """Every target j scored by its own forward pass over the window that the stride gives it."""
    t = torch.as_tensor(ids, dtype=torch.long)
    total, n = 0.0, 0
    with torch.no_grad():
        for end, scored in sliding_windows(len(ids) - 1, window, stride):
            start = max(0, end - window)
            losses = model(t[None, start:end], t[None, start + 1 : end + 1], mem_len=0).losses[0]
            total += float(losses[-scored:].double().sum())
            n += scored
    return total / n


@pytest.mark.parametrize("window, stride", [(8, 1), (8, 3), (5, 5), (40, 1)])
def test_sliding_window_equals_a_naive_loop(window, stride):
    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(mem_len=16)).eval()
    ids = np.random.default_rng(0).integers(0, model.config.n_token, 30)
    res = evaluate_sliding(model, ids, window=window, stride=stride, batch_size=4)
    assert res.tokens == len(ids) - 1  # every target scored once
    assert abs(res.loss - naive(model, ids, window, stride)) < 1e-5


def test_stride_one_is_one_prediction_per_full_window():
    """With stride 1, target j (past the first window) is predicted from exactly the `window` tokens before it."""
    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(mem_len=16)).eval()
    ids = torch.randint(0, model.config.n_token, (20,))
    window, j = 6, 15
    with torch.no_grad():
        alone = model(ids[None, j - window : j], ids[None, j - window + 1 : j + 1], mem_len=0).losses[0, -1]
    spans = sliding_windows(19, window, 1)
    assert spans[0] == (window, window) and all(n == 1 for _, n in spans[1:])
    res = evaluate_sliding(model, ids.numpy()[: j + 1], window=window, stride=1, batch_size=3)
    head = evaluate_sliding(model, ids.numpy()[:j], window=window, stride=1, batch_size=3)
    assert abs(res.loss * res.tokens - head.loss * head.tokens - float(alone)) < 1e-5


def test_windows_cover_every_target_once():
    for n, window, stride in [(1, 4, 1), (10, 4, 3), (10, 20, 7), (100, 7, 7)]:
        spans = sliding_windows(n, window, stride)
        covered = [j for end, k in spans for j in range(end - k + 1, end + 1)]
        assert covered == list(range(1, n + 1))
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 4, 5)


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    from train_helpers import run_inprocess

    return run_inprocess(tmp_path_factory.mktemp("char"), train__max_steps=2, train__eval_interval=0)


def test_txl_eval_sliding_window(char_run, capsys):
    """The CLI path: the run's test split, scored by windows; equal to the library on the same ids."""
    from txl.cli import main

    base = ["eval", "--model", str(char_run), "--batch_size", "2", "--max_batches", "3"]
    main([*base, "--json", "--sliding_window", "12", "--stride", "4"])
    record = json.loads(capsys.readouterr().out)
    assert record["sliding_window"] == 12 and record["stride"] == 4 and record["mem_len"] == 0
    assert record["tokens"] == 12 + 4 * 4  # the first window alone, then two batches of two windows of 4
    folder = resolve_model_dir(char_run)
    text = eval_text(folder, read_run_config(folder), record["split"], None, None, None)
    model = TransformerXLLM.from_pretrained(folder)
    expected = evaluate_sliding(model, text.ids, window=12, stride=4, batch_size=2, max_batches=3)
    assert abs(record["loss"] - expected.loss) < 1e-6
    main([*base, "--sliding_window", "12"])
    assert "sliding window 12, stride 1, no memory" in capsys.readouterr().out
    for args, message in [
        (["--sliding_window", "0"], "--sliding_window = 0: must be >= 1"),
        (["--sliding_window", "4", "--stride", "5"], "--stride = 5: must be in [1, --sliding_window = 4]"),
        (["--stride", "2"], "--stride needs --sliding_window"),
    ]:
        with pytest.raises(SystemExit):
            main([*base, *args])
        assert message in capsys.readouterr().err


def test_per_token_losses_are_in_text_order():
    """return_losses: with a memory longer than the text, evaluate's per-token losses are one pass's; the sliding
    window's with a window longer than the text too."""
    from txl.infer.evaluate import evaluate

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(mem_len=16)).eval()
    ids = np.random.default_rng(1).integers(0, model.config.n_token, 41)
    t = torch.as_tensor(ids)
    with torch.no_grad():
        one_pass = model(t[None, :-1], t[None, 1:], mem_len=0).losses[0].numpy()
    seg = evaluate(model, ids, batch_size=1, tgt_len=7, mem_len=64, return_losses=True)
    win = evaluate_sliding(model, ids, window=64, stride=1, batch_size=4, return_losses=True)
    for res in (seg, win):
        assert res.losses.shape == (40,)
        np.testing.assert_allclose(res.losses, one_pass, atol=1e-5)
        assert abs(res.losses.mean() - res.loss) < 1e-6


def test_txl_recl_cli(tmp_path, capsys):
    """`txl recl` over two runs (one scored by sliding windows): the JSON holds RECL computed from the same
    per-token losses that the library gives, and the PNG is written."""
    from train_helpers import run_inprocess
    from txl.cli import main
    from txl.infer.evaluate import eval_settings, eval_text
    from txl.infer.recl import context_losses, recl
    from txl.train.checkpoint import read_run_config, resolve_model_dir

    a = run_inprocess(tmp_path / "a", train__max_steps=3, train__eval_interval=0)
    b = run_inprocess(tmp_path / "b", train__max_steps=1, train__eval_interval=0)
    out = tmp_path / "out"
    main(["recl", "--models", str(a), str(b), "--sliding", str(b), "--contexts", "[4, 8, 12]"]  # (as a shell glob)
         + ["--tokens", "120", "--r", "[0.5, 1.0]", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    record = json.loads((out / "recl.json").read_text())
    assert (out / "recl.png").stat().st_size > 1000
    assert record["tokens"] == 120 and [x["r"] for x in record["results"]] == [0.5, 1.0]
    losses = {}
    for run, sliding in ((a, False), (b, True)):
        folder = resolve_model_dir(run)
        cfg = read_run_config(folder)
        model = TransformerXLLM.from_pretrained(folder)
        s = eval_settings(cfg, model.config)
        ids = np.asarray(eval_text(folder, cfg, s.split, None, None, None).ids[:121], dtype=np.int64)
        losses[str(run)] = context_losses(
            model, ids, [4, 8, 12], sliding=sliding, tgt_len=s.tgt_len, clamp_len=s.clamp_len,
            same_length=s.same_length,
        )  # fmt: skip
    for got in record["results"]:
        expected = recl(losses, [4, 8, 12], got["r"])
        assert got["recl"] == expected.recl
        for name, gains in expected.gains.items():
            np.testing.assert_allclose(got["gains"][name], gains, atol=1e-6)
    assert f"| {a} |" in printed and "RECL r=0.5" in printed
    with pytest.raises(SystemExit):
        main(["recl", "--models", f"[{a}]", "--contexts", "[4, 8]"])
    assert "--models needs at least two models" in capsys.readouterr().err
    for args, message in [(["--contexts", "4,8,16"], "evenly spaced"), (["--r", "0,0.5"], "r = 0.0: must be in")]:
        with pytest.raises(SystemExit):  # refused before any model is scored
            main(["recl", "--models", f"[{a}, {b}]", "--contexts", "4,8", *args])
        captured = capsys.readouterr()
        assert message in captured.err and "scoring" not in captured.out


def test_recl_reads_a_learned_position_table_no_further_than_its_length(tmp_path, capsys):
    """A vanilla model (attn_type 3) has positions for max_klen tokens: RECL scores a longer context with its longest
    window (the paper's vanilla Transformer is read at its training length), through the library and `txl recl`;
    --cap_windows false scores the longer windows themselves (which differ)."""
    from train_helpers import run_inprocess
    from txl.cli import main
    from txl.infer.recl import context_losses

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(attn_type=3, mem_len=0, max_klen=8)).eval()
    ids = np.random.default_rng(2).integers(0, model.config.n_token, 40)
    capped = context_losses(model, ids, [4, 8, 12, 16], sliding=True, tgt_len=8, max_window=8)
    free = context_losses(model, ids, [4, 8, 12, 16], sliding=True, tgt_len=8)
    np.testing.assert_array_equal(capped[:2], free[:2])  # (within the table: the same windows)
    np.testing.assert_array_equal(capped[2], capped[1])
    np.testing.assert_array_equal(capped[3], capped[1])
    assert not np.allclose(free[3], free[1])  # (the cap is what makes them equal)
    with pytest.raises(ValueError, match="max_window = 0"):
        context_losses(model, ids, [4, 8], sliding=True, tgt_len=8, max_window=0)

    xl = run_inprocess(tmp_path, "xl", train__max_steps=2, train__eval_interval=0)
    vanilla = run_inprocess(tmp_path, "vanilla", train__max_steps=2, train__eval_interval=0, model__attn_type=3,
                            model__mem_len=0, eval__clamp_len=-1)  # fmt: skip
    span = TransformerXLLM.from_pretrained(resolve_model_dir(vanilla)).config.max_klen
    contexts = [span // 2, span, 3 * span // 2, 2 * span]
    base = ["recl", "--models", str(xl), str(vanilla), "--sliding", str(vanilla), "--tokens", "60"]
    base += ["--contexts", str(contexts), "--r", "[1.0]"]
    gains = {}
    for cap in ("true", "false"):
        main([*base, "--cap_windows", cap, "--out", str(tmp_path / cap)])
        printed = capsys.readouterr().out
        assert (f"at most {span} tokens, its learned positions" in printed) == (cap == "true")
        gains[cap] = json.loads((tmp_path / cap / "recl.json").read_text())["results"][0]["gains"][str(vanilla)]
    assert gains["true"][1:] == [0.0, 0.0]  # (no context beyond its table: no gain)
    assert gains["false"][1:] != [0.0, 0.0]


def test_memory_sweep(char_run, tmp_path, capsys):
    """`txl eval --mem_len 0,4,8,16`: one line per length, each what `--mem_len m` alone gives, and the plot. The
    run evaluates with same_length (the debug preset's eval section): it applies to every length with a memory,
    and the memory-less point is plain causal attention, unless --same_length is asked for explicitly."""
    from txl.cli import main

    base = ["eval", "--model", str(char_run), "--max_batches", "3", "--json"]
    main([*base, "--mem_len", "0,4,8,16", "--plot", str(tmp_path / "sweep.png")])
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.strip().splitlines()]
    assert [x["mem_len"] for x in lines] == [0, 4, 8, 16]
    assert [x["same_length"] for x in lines] == [False, True, True, True]
    assert (tmp_path / "sweep.png").stat().st_size > 1000 and "sweep.png" in captured.err
    for line in lines:
        main([*base, "--mem_len", str(line["mem_len"])])
        assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(line["loss"], abs=1e-9)
    assert len({x["loss"] for x in lines}) == 4  # the memory changes the score
    folder = resolve_model_dir(char_run)
    model, run = TransformerXLLM.from_pretrained(folder), read_run_config(folder)
    ids = eval_text(folder, run, lines[0]["split"], None, None, None).ids
    alone = evaluate(model, ids, batch_size=run.eval.batch_size, tgt_len=run.eval.tgt_len, mem_len=0, max_batches=3)
    assert lines[0]["loss"] == pytest.approx(alone.loss, abs=1e-6)  # no memory: each segment on its own
    with pytest.raises(SystemExit):
        main([*base, "--mem_len", "0", "--same_length", "true"])
    assert "--same_length = True: needs mem_len > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--plot", str(tmp_path / "x.png")])
    assert "--plot needs a list of memory lengths" in capsys.readouterr().err


def test_attention_maps_by_distance_equal_a_naive_average():
    """The mean attention at distance d is the mean, over every query that may see a key d before it, of that
    probability: checked against one pass (no memory) by loops, and with a memory over three segments each query's
    probabilities still sum to one (sum over d of mean x count = number of queries)."""
    from txl.infer.attention_maps import attention_maps

    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(mem_len=8)).eval()
    ids = np.random.default_rng(0).integers(0, model.config.n_token, 10)
    maps = attention_maps(model, ids, tgt_len=10, mem_len=0)
    with torch.no_grad():
        probs = model(torch.as_tensor(ids)[None], output_attentions=True).attentions
    for layer in range(2):
        for d in range(10):
            naive = np.mean([float(probs[layer][0, 1, i, i - d]) for i in range(d, 10)])
            assert abs(maps.by_distance[layer, 1, d] - naive) < 1e-6
    assert maps.counts.tolist() == list(range(10, 0, -1))
    ids = np.random.default_rng(1).integers(0, model.config.n_token, 15)
    for same_length in (False, True):
        maps = attention_maps(model, ids, tgt_len=5, mem_len=8, same_length=same_length)
        mass = (maps.by_distance.astype(np.float64) * maps.counts).sum(-1)  # [L, H]
        np.testing.assert_allclose(mass, 15, rtol=1e-5)
        assert maps.last.shape == (2, 2, 5, 13) and maps.mem_len == 8
        assert (maps.counts[8:] == 0).all() == same_length  # same_length: no query sees 8 or more keys back


def test_txl_attention_cli(char_run, tmp_path, capsys):
    """`txl attention`: the PNGs and the averaged numbers, equal to the library's on the same tokens."""
    from txl.cli import main
    from txl.infer.attention_maps import attention_maps
    from txl.infer.evaluate import eval_text
    from txl.train.checkpoint import read_run_config, resolve_model_dir

    out = tmp_path / "maps"
    main(["attention", "--model", str(char_run), "--tokens", "80", "--tgt_len", "16", "--mem_len", "32", "--out",
          str(out), "--layer", "1", "--head", "1"])  # fmt: skip
    printed = capsys.readouterr().out.split()
    names = ["distance.png", "layer0.png", "layer1.png", "full.png"]
    assert [p.split("/")[-1] for p in printed] == names
    assert all((out / n).stat().st_size > 1000 for n in names)
    record = json.loads((out / "attention.json").read_text())
    assert record["tokens"] == 80 and record["mem_len"] == 32
    folder = resolve_model_dir(char_run)
    run = read_run_config(folder)
    ids = np.asarray(eval_text(folder, run, "test", None, None, None).ids[:80])
    maps = attention_maps(TransformerXLLM.from_pretrained(folder), ids, tgt_len=16, mem_len=32,
                          same_length=run.eval.same_length, clamp_len=run.eval.clamp_len)  # fmt: skip
    np.testing.assert_allclose(record["by_distance"], maps.by_distance, atol=1e-7)
    with pytest.raises(SystemExit):
        main(["attention", "--model", str(char_run), "--layer", "5"])
    assert "--layer = 5: the model has 2 layers (0..1, or -2..-1 counted from the last)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["attention", "--model", str(char_run), "--head", "-3"])
    assert "--head = -3: the model has 2 heads (0..1, or -2..-1 counted from the last)" in capsys.readouterr().err
    text = tmp_path / "other.txt"  # another text: --data, as txl eval names it (or --text, its former name)
    text.write_text("Mn op ab cd ef. Gh ij kl mn op ab cd.\n" * 4)
    by_option = {}
    for option in ("--data", "--text"):
        main(["attention", "--model", str(char_run), "--tokens", "80", "--tgt_len", "16", "--mem_len", "32",
              "--out", str(tmp_path / option[2:]), option, str(text)])  # fmt: skip
        by_option[option] = json.loads((tmp_path / option[2:] / "attention.json").read_text())["by_distance"]
    assert by_option["--data"] == by_option["--text"]
    assert not np.allclose(by_option["--data"], record["by_distance"], atol=1e-4)
