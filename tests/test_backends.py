"""The fast paths are chosen by one policy (txl.kernels.backends), not module switches: a block's choice holds in its
own
thread, the process's in every other, the model reads it at each call, `txl train` prints it and records it with
each checkpoint, and no module of txl keeps a switch of its own."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import threading
from pathlib import Path

import pytest
import torch

import txl
import txl.infer.static_decode
import txl.model.modeling
from tests.conftest import debug_config
from txl import Backends, TransformerXLLM, set_backends, use_backends
from txl.kernels import native
from txl.kernels.backends import backends

SRC = Path(__file__).resolve().parents[1] / "src" / "txl"


def test_a_block_chooses_for_its_thread_and_the_process_for_all():
    assert backends() == Backends()
    seen = {}
    with use_backends(native_nll=False) as inside:
        assert backends() is inside and not inside.native_nll and inside.native_attention
        worker = threading.Thread(target=lambda: seen.setdefault("thread", backends()))
        worker.start()
        worker.join()
    assert seen["thread"] == Backends() and backends() == Backends()  # (other threads: the process's policy)
    set_backends(native_attention=False)
    worker = threading.Thread(target=lambda: seen.setdefault("later", backends()))
    worker.start()
    worker.join()
    assert not seen["later"].native_attention
    assert Backends(measured=True).describe() == "fast paths: all that can run"
    assert backends().describe().startswith("fast paths: off: native_attention")


def test_the_model_reads_the_policy_at_each_call(monkeypatch):
    if native.library() is None:
        import pytest

        pytest.skip("no C compiler: the native attention cannot run here")
    calls = []
    real = native.attention
    monkeypatch.setattr(native, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = TransformerXLLM(debug_config(mem_len=8)).eval()
    x = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        on = model(x, x).loss
        n = len(calls)
        with use_backends(native_attention=False):
            off = model(x, x).loss
    assert n > 0 and len(calls) == n  # (not called inside the block)
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)  # (the same values: a backend, not a variant)


def test_train_prints_the_policy_and_records_it(tmp_path, capsys):
    from train_helpers import run_inprocess
    from txl.train.checkpoint import latest_checkpoint, read_metadata

    set_backends(native_relu_dropout=False)
    run = run_inprocess(tmp_path, train__max_steps=1, train__eval_interval=0)
    out = capsys.readouterr().out
    assert "runtime: fast paths: off: native_relu_dropout" in out
    assert "runtime: training on cpu (fp32): layers eager, attention by the native kernels" in out
    recorded = read_metadata(latest_checkpoint(run))["backends"]
    assert recorded == backends().to_dict() and recorded["native_relu_dropout"] is False


def test_a_recipe_sets_the_runs_policy_through_train_fast_paths(tmp_path, capsys):
    """``--train.fast_paths`` (a recipe's train.fast_paths) changes the policy for that run only: the log and the
    checkpoint's metadata say so, the process's policy is unchanged afterwards; an unknown field or a wrong value is
    one error naming it, before anything is written."""
    from train_helpers import run_inprocess
    from txl.train.checkpoint import latest_checkpoint, read_metadata

    run = run_inprocess(
        tmp_path, train__max_steps=1, train__eval_interval=0,
        train__fast_paths='{"native_attention": false, "fused_attention_training": ["cuda"]}',
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "runtime: fast paths: off: native_attention; fused_attention_training = ('cuda',)" in out
    assert "runtime: evaluation on cpu (fp32): attention by PyTorch kernels" in out  # (native_attention off)
    recorded = read_metadata(latest_checkpoint(run))["backends"]
    assert recorded["native_attention"] is False and recorded["fused_attention_training"] == ["cuda"]
    assert backends() == Backends()  # (the run's block is over)
    for value, message in (('{"fused_atention": ["cuda"]}', "unknown fast path 'fused_atention': one of"),
                           ('{"fused_attention": "cuda"}', "fused_attention takes a list of device types"),
                           ('{"native_attention": 0}', "native_attention takes true or false")):  # fmt: skip
        with pytest.raises(SystemExit):
            run_inprocess(tmp_path, run="bad", train__max_steps=1, train__fast_paths=value)
        err = capsys.readouterr().err
        assert "train.fast_paths = " in err and message in err, err
        assert not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="takes a mapping of txl.Backends fields"):  # (a list, from Python)
        Backends.changes(["fused_attention"])


def test_no_module_keeps_a_switch_of_its_own():
    """A module-level name bound to True/False (the old NATIVE_ATTENTION = True ...) is a switch that tests and
    benchmarks had to patch; the policy holds every such choice now."""
    switches = []
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            value = getattr(node, "value", None)
            if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                switches += [f"{path.relative_to(SRC)}: {t.id}" for t in targets if isinstance(t, ast.Name)]
    assert switches == []
    assert not hasattr(txl.model.modeling, "NATIVE_ATTENTION") and not hasattr(txl.infer.static_decode, "GRAPH_DECODE")
    assert not hasattr(native, "ENABLED")  # (TXL_NATIVE now sets the process policy's native_kernels)


def test_the_model_never_asks_which_backend_runs():
    """The model calls named operations of txl.kernels, which choose their backend: no file of txl/model reads the
    policy (``backends()``) or calls the native kernels (``native.*``) itself."""
    asks = []
    for path in (SRC / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "backends":
                asks.append(f"{path.name}:{node.lineno} backends()")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "native":
                asks.append(f"{path.name}:{node.lineno} native.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module in ("txl.kernels.native", "txl.kernels.backends"):
                asks.append(f"{path.name}:{node.lineno} from {node.module} import ...")
    assert asks == []


def test_the_native_kernels_follow_the_policy_and_txl_native(monkeypatch):
    with use_backends(native_kernels=False):
        assert native.library() is None and "off" in native.status()
    monkeypatch.setenv("TXL_NATIVE", "0")
    assert Backends().native_kernels is False
    monkeypatch.setenv("TXL_NATIVE", "1")
    assert Backends().native_kernels is True


def test_the_training_log_names_the_path_of_each_device():
    """What ``txl train`` says runs: the compiled layers and bf16 logits on CUDA by default, not on the CPU."""
    policy = Backends()
    cuda = policy.training_paths("cuda", "bf16")
    assert "compiled by torch.compile" in cuda and "bf16 products" in cuda
    assert "SDPA" not in cuda
    cpu = policy.training_paths("cpu", "bf16")
    assert "eager" in cpu and "fp32" in cpu.split("adaptive softmax")[1]
    off = dataclasses.replace(policy, compiled_layers=(), half_precision_logits=())
    assert "scaled_dot_product_attention" in off.training_paths("cuda", "fp32")
    assert "fused Triton" not in cuda  # (training's is off by default: slower than the compiled layers on an H200)
    fused = dataclasses.replace(policy, fused_attention_training=("cuda",))
    assert "fused Triton kernel" in fused.training_paths("cuda", "bf16")
    assert "fused Triton kernel" in dataclasses.replace(fused, compiled_layers=()).training_paths("cuda", "fp16")
    assert "fused Triton" not in fused.training_paths("cuda", "fp32")  # (a GPU's fp32 goes to the reference)
    assert "fused Triton" not in fused.training_paths("cpu", "fp32")
    # Evaluation's path (txl train's validation, txl eval on a GPU): the fused attention by default on CUDA in bf16.
    gpu_eval = policy.inference_paths("cuda", "bf16")
    triton = importlib.util.find_spec("triton") is not None
    assert ("attention by the fused Triton kernel" if triton else "the fused kernel needs triton") in gpu_eval
    assert "replayed as CUDA graphs" in gpu_eval and "bf16 products" in gpu_eval
    assert "fused" not in policy.inference_paths("cuda", "fp32") and "graphs" not in policy.inference_paths(
        "cuda", "fp32"
    )
    assert "fused" not in dataclasses.replace(policy, fused_attention=()).inference_paths("cuda", "bf16")
    assert "attention by the native kernels" in policy.inference_paths("cpu", "fp32")


def test_the_fused_attention_runs_where_it_was_measured_faster(monkeypatch):
    """The policy measured on an H200 (docs/benchmarks.md): the fused Triton attention by default in inference on
    CUDA, not in training; on a GPU never for fp32 products or one-token steps. Each of the two fields decides its
    own case: under Triton's interpreter (the CPU listed) inference calls the kernel only when ``fused_attention``
    lists the device, training only when ``fused_attention_training`` does."""
    from txl.kernels.attention import fused_pays

    assert Backends().fused_attention == ("cuda",) and Backends().fused_attention_training == ()
    assert fused_pays("cuda", torch.bfloat16, 64) and fused_pays("cuda", torch.float16, 2)
    assert not fused_pays("cuda", torch.float32, 64)  # (IEEE fp32 products: 6-8x slower than cuBLAS)
    assert not fused_pays("cuda", torch.bfloat16, 1)  # (one-token steps: the decode paths')
    assert fused_pays("cpu", torch.float32, 1)  # (the interpreter: the tests hold every case to the reference)
    pytest.importorskip("triton", reason="the fused attention needs triton (extra 'triton')")
    from txl.kernels import fused_attention

    calls, kernel = [], fused_attention.fused_rel_attention
    monkeypatch.setattr(fused_attention, "fused_rel_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    torch.manual_seed(0)
    model = TransformerXLLM(debug_config(n_head=2, d_head=8))
    x = torch.randint(0, 97, (2, 9))

    def count(train: bool, **policy) -> int:
        model.train(train)
        with use_backends(native_kernels=False, **policy), torch.set_grad_enabled(train):
            model(x[:, :-1], x[:, 1:])  # (the first call in a process also checks the kernel against the reference)
            calls.clear()
            model(x[:, :-1], x[:, 1:])
        return len(calls)

    layers = model.config.n_layer
    assert count(False, fused_attention=("cpu",)) == layers and count(True, fused_attention=("cpu",)) == 0
    assert count(True, fused_attention_training=("cpu",)) == layers
    assert count(False, fused_attention_training=("cpu",)) == 0
    assert count(False) == 0 and count(True) == 0  # (the default lists CUDA alone)
