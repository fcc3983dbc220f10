"""RECL (Appendix C) on synthetic per-token losses with hand-computed answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from txl.infer.recl import recl, relative_gains


def test_gains_by_hand():
    # two models, three context lengths, four tokens
    a = np.array([[2.0, 1.0, 3.0, 0.5], [1.5, 1.0, 2.0, 0.5], [1.5, 1.0, 2.0, 0.5]])
    b = np.array([[2.5, 0.8, 3.0, 0.7], [2.5, 0.8, 2.9, 0.7], [2.4, 0.8, 2.9, 0.7]])
    gains = relative_gains({"a": a, "b": b}, r=0.5)
    # c0: baseline [2.0, 0.8, 3.0, 0.5]; top half = tokens 2 (3.0) and 0 (2.0); exp f(c0,c0) = exp(2.5)
    # model a at c1: min(b, l) on tokens 2, 0 = [2.0, 1.5] -> mean 1.75
    # model b at c1: min(b, l) = [2.9, 2.0] -> mean 2.45
    ref = math.exp(2.5)
    assert gains["a"][0] == pytest.approx((ref - math.exp(1.75)) / ref)
    assert gains["b"][0] == pytest.approx((ref - math.exp(2.45)) / ref)
    # c1: baseline [1.5, 0.8, 2.0, 0.5]; top half = tokens 2 (2.0), 0 (1.5); ref exp(1.75)
    # a at c2: [2.0, 1.5] -> 1.75 (no gain); b at c2: min([2.0, 1.5], [2.9, 2.4]) = [2.0, 1.5] -> no gain either
    assert gains["a"][1] == pytest.approx(0.0) and gains["b"][1] == pytest.approx(0.0)


def test_recl_is_the_first_length_whose_gain_falls_below_the_threshold():
    contexts = [10, 20, 30, 40, 50]
    n = 200
    # model "long" keeps improving until 40, "short" stops improving after 20: losses fall by 0.2 per step until then
    long = np.stack([np.full(n, 3.0 - 0.2 * min(i, 3)) for i in range(5)])
    short = np.stack([np.full(n, 3.0 - 0.2 * min(i, 1)) for i in range(5)])
    res = recl({"long": long, "short": short}, contexts, r=1.0)
    assert res.recl == {"long": 40, "short": 20}
    assert res.reached == {"long": True, "short": True}
    # the gain of "long" from 10 to 20 is 1 - exp(-0.2) (its own loss is the baseline there)
    assert res.gains["long"][0] == pytest.approx(1 - math.exp(-0.2))
    never = recl({"long": long[:4], "short": short[:4]}, contexts[:4], r=1.0)
    assert never.recl["long"] == 40 and not never.reached["long"]


def test_the_baseline_caps_a_model_better_than_the_group_at_the_shorter_length():
    """min(b(c,t), l(c',t)): a model cannot gain more than the baseline of the shorter length allows."""
    contexts = [1, 2]
    good = np.array([[1.0, 1.0], [0.5, 0.5]])
    bad = np.array([[2.0, 2.0], [2.0, 2.0]])
    res = recl({"good": good, "bad": bad}, contexts, r=1.0)
    assert res.gains["good"][0] == pytest.approx(1 - math.exp(-0.5))
    assert res.gains["bad"][0] == pytest.approx(0.0)  # worse than the baseline: capped at it, gain 0


def test_bad_input():
    x = np.zeros((3, 4))
    with pytest.raises(ValueError, match="evenly spaced"):
        recl({"a": x}, [1, 2, 4], r=0.5)
    with pytest.raises(ValueError, match="r = 0"):
        recl({"a": x}, [1, 2, 3], r=0)
    with pytest.raises(ValueError, match="one shape"):
        recl({"a": x, "b": np.zeros((3, 5))}, [1, 2, 3], r=0.5)
