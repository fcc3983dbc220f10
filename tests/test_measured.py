"""The CPU fast paths run only where this machine measured them faster (txl.kernels.measured), with the measurement
faked: the choice follows the timing, is kept per machine in a file that a later process reads, is logged once,
listed by ``txl --version``, leaves torch's random stream as it was, and decides which kernel the model runs."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.conftest import debug_config
from txl import TransformerXLLM
from txl.kernels import attention, measured, native
from txl.kernels.backends import use_backends


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def work(self, seconds: float):
        def run():
            self.t += seconds
            return torch.zeros(1)

        return run


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("TXL_NATIVE_CACHE", str(tmp_path))
    clock = Clock()
    monkeypatch.setattr(measured, "timer", clock)
    measured.forget()
    yield clock, tmp_path
    measured.forget()


def test_the_faster_path_is_chosen_kept_and_read_back(fresh, caplog):
    clock, folder = fresh
    caplog.set_level(logging.WARNING, logger="txl")
    slow = measured.kind_of("native_dropout", [(8, 100)], torch.float32)
    quick = measured.kind_of("native_nll", [(8, 100)], torch.float32)
    assert measured.ratio(clock.work(2.0), clock.work(1.0)) == pytest.approx(0.5)
    with use_backends(measured=True):
        assert not measured.faster("native_dropout", slow, None, clock.work(2.0), clock.work(1.0))
        assert measured.faster("native_nll", [(8, 100)], torch.float32, clock.work(1.0), clock.work(3.0))
        calls = []
        assert measured.faster("native_nll", quick, None, lambda: calls.append(1), lambda: calls.append(1))
        assert not calls  # (decided once: not measured again)
    lines = [r.getMessage() for r in caplog.records if "measured" in r.getMessage()]
    assert len(lines) == 2 and "0.50x" in lines[0] and "not used" in lines[0] and "3.00x" in lines[1]
    saved = json.loads((folder / "measured.json").read_text())[measured.machine_key()]
    assert saved[slow] == {"use": False, "ratio": 0.5} and saved[quick]["use"] is True
    measured.forget()  # (a later process: reads the file, measures nothing)
    with use_backends(measured=True):
        assert not measured.faster("native_dropout", slow, None, pytest.fail, pytest.fail)
    report = measured.describe()
    assert "native_dropout" in report and "0.50x -> off" in report and "3.00x -> on" in report
    with use_backends(measured=False):  # (unmeasured: wherever it applies)
        assert measured.faster("native_dropout", slow, None, pytest.fail, pytest.fail)


def test_a_measurement_leaves_the_random_stream_as_it_was(fresh):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with use_backends(measured=True):
        measured.faster("native_dropout", "k", None, lambda: torch.rand(1000), lambda: torch.rand(1000))
    assert torch.equal(torch.rand(4), expected)


def test_a_machine_key_names_the_cpu_its_flags_and_the_versions():
    key = measured.machine_key()
    assert f"torch {torch.__version__}" in key and "txl " in key and f"threads {torch.get_num_threads()}" in key


@pytest.mark.skipif(native.library() is None, reason="the native kernels need a C compiler")
@pytest.mark.parametrize("gain", [0.5, 2.0])
def test_the_model_runs_the_native_attention_only_where_it_measured_faster(fresh, monkeypatch, gain):
    monkeypatch.setattr(measured, "ratio", lambda *a, **k: gain)
    calls = []
    real = attention.ops.rel_attention
    monkeypatch.setattr(attention.ops, "rel_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = TransformerXLLM(debug_config()).eval()
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad(), use_backends(measured=True):
        model(x)
        calls.clear()
        out = model(x).last_hidden_state
    assert bool(calls) == (gain > 1)
    with torch.no_grad(), use_backends(native_attention=False):
        torch.testing.assert_close(out, model(x).last_hidden_state, atol=1e-5, rtol=0)
    assert measured.choices()[next(iter(measured.choices()))]["use"] == (gain > 1)


def test_txl_version_lists_the_choices(fresh, capsys):
    from txl.cli.app import main

    with use_backends(measured=True):
        measured.faster("native_nll", "native_nll [8x128] float32 threads 2", None, Clock().work(0), Clock().work(0))
    main(["--version"])
    out = capsys.readouterr().out
    assert out.startswith("txl ") and "native kernels" in out and "native_nll [8x128]" in out


@pytest.mark.parametrize("entry", [{"use": True}, {"use": True, "ratio": "fast"}, {"use": True, "ratio": None}])
def test_an_entry_of_another_schema_is_left_out_not_a_traceback(fresh, capsys, entry):
    """Round 6, mc3/mc4: an entry with no numeric ratio (another txl's schema) crashed `txl --version`; it is left
    out (measured again when used), and the command lists the rest."""
    from txl.cli.app import main

    _, folder = fresh
    key = "native_attention [1x1x2x16;1x2x32x16] float32 threads 1"
    good = {"use": False, "ratio": 0.5}
    measured._file().write_text(json.dumps({measured.machine_key(): {key: entry, "native_nll [1] float32": good}}))
    main(["--version"])
    out = capsys.readouterr().out
    assert "native_nll [1] float32: 0.50x -> off" in out and key not in out
