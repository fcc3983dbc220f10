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
from txl.kernels import attention, measured, native, timing
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
    monkeypatch.setattr(timing, "timer", clock)
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
    assert saved[slow]["use"] is False and saved[slow]["ratio"] == 0.5 and saved[slow]["settled"] is True
    assert saved[quick]["use"] is True
    measured.forget()  # (a later process: reads the file, measures nothing)
    with use_backends(measured=True):
        assert not measured.faster("native_dropout", slow, None, pytest.fail, pytest.fail)
    report = measured.describe()
    assert "native_dropout" in report and "0.50x +-0% (settled) -> off" in report
    assert "3.00x +-0% (settled) -> on" in report
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
    monkeypatch.setattr(measured, "paired", lambda *a, **k: measured.Paired((gain,) * 7))
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


@pytest.mark.parametrize(
    "entry", [{"use": True}, {"use": True, "ratio": "fast"}, {"use": True, "ratio": None}, {"use": True, "ratio": 2.0}]
)
def test_an_entry_of_another_schema_is_left_out_not_a_traceback(fresh, capsys, entry):
    """Round 6, mc3/mc4: an entry with no numeric ratio (another txl's schema) crashed `txl --version`; it is left
    out (measured again when used), and the command lists the rest."""
    from txl.cli.app import main

    _, folder = fresh
    key = "native_attention [1x1x2x16;1x2x32x16] float32 threads 1"
    good = {"use": False, "ratio": 0.5, "error": 0.01, "settled": True, "samples": [], "at": 0}
    measured._file().write_text(json.dumps({measured.machine_key(): {key: entry, "native_nll [1] float32": good}}))
    main(["--version"])
    out = capsys.readouterr().out
    assert "native_nll [1] float32: 0.50x +-2% (settled) -> off" in out and key not in out


class Noisy:
    """A fake clock whose fast path takes ``fast`` seconds times a noise factor that cycles through ``noise``."""

    def __init__(self, fast: float, noise: list[float]):
        self.t, self.fast, self.noise, self.i = 0.0, fast, noise, 0

    def __call__(self) -> float:
        return self.t

    def calls(self):
        def fast():
            self.t += self.fast * self.noise[self.i % len(self.noise)]
            self.i += 1

        def reference():
            self.t += 1.0

        return fast, reference


def test_a_choice_within_the_noise_is_not_settled_and_is_measured_again(fresh, monkeypatch):
    """Under load (a fast path whose rounds range from 0.6x to 1.7x of the reference's time) the choice is used but
    not settled; the next process measures again, pooling the samples; quiet rounds then settle the quiet machine's
    choice, and a settled choice is not measured again until its lifetime (the square of its margin) is over."""
    _, folder = fresh
    wall = [1000.0]
    monkeypatch.setattr(measured, "clock", lambda: wall[0])
    hog = Noisy(1.0, [0.6, 1.7, 0.9, 1.5, 0.7, 1.3, 1.1, 0.8])
    monkeypatch.setattr(timing, "timer", hog)
    with use_backends(measured=True):
        measured.faster("native_nll", "k", None, *hog.calls())
        first = measured.choices()["k"]
        assert not first["settled"] and len(first["samples"]) == 7
        assert measured.faster("native_nll", "k", None, pytest.fail, pytest.fail) == first["use"]  # (this process)
        assert "within the noise" in measured.describe()
        quiet = Noisy(0.8, [1.0, 1.01, 0.99])  # (the quiet machine: 1.25x)
        monkeypatch.setattr(timing, "timer", quiet)
        for _ in range(3):  # (later processes: each measures again until the choice settles)
            measured.forget()
            measured.faster("native_nll", "k", None, *quiet.calls())
            if measured.choices()["k"]["settled"]:
                break
        settled = measured.choices()["k"]
        assert settled["settled"] and settled["use"] and settled["ratio"] == pytest.approx(1.25, rel=0.02)
        measured.forget()
        assert measured.faster("native_nll", "k", None, pytest.fail, pytest.fail)  # (read back: no measurement)
        wall[0] += measured.MAX_LIFETIME_S + 1  # (its lifetime over: measured again)
        measured.forget()
        calls = []
        fast, reference = quiet.calls()
        measured.faster("native_nll", "k", None, lambda: calls.append(1) or fast(), reference)
        assert calls
    saved = json.loads((folder / "measured.json").read_text())[measured.machine_key()]["k"]
    assert saved["settled"] and saved["at"] == wall[0]


def test_the_confidence_rule():
    assert measured.Paired((1.3,) * 7).settled and measured.Paired((0.7,) * 7).settled
    assert not measured.Paired((1.3,) * 4).settled  # (too few rounds)
    assert not measured.Paired((0.6, 1.7, 0.9, 1.5, 0.7, 1.3, 1.1)).settled
    wide = measured.Paired((1.02, 0.97, 1.05, 0.99, 1.03, 0.98, 1.01))
    assert not wide.settled and 0.9 < wide.median < 1.1
