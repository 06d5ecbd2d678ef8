"""Skywork-OR1's adaptive entropy coefficient: TRL's update rule step by step, state, errors."""

from __future__ import annotations

import math

import pytest
import torch

from rlmath import AdaptiveEntropyController


def test_update_rule_by_hand():
    ctl = AdaptiveEntropyController(0.01, 0.5, delta=0.02, min_coef=0.0, max_coef=0.04)
    assert ctl.value == 0.0  # nothing measured yet: no bonus (TRL starts from +inf)
    steps = [
        # (measured entropy, coef after the update, value applied in the next step)
        (0.4, 0.03, 0.03),  # ≤ target: c + Δ, and the bonus is on
        (0.5, 0.04, 0.04),  # = target counts as below; c + Δ = 0.05 capped at 0.04
        (0.7, 0.02, 0.0),  # above: c − Δ, bonus off
        (0.9, 0.0, 0.0),  # c − Δ floored at 0
        (torch.tensor(0.1), 0.02, 0.02),  # a 0-d tensor is read once
    ]
    for entropy, coef, value in steps:
        ctl.update(entropy)
        assert ctl.coef == pytest.approx(coef, abs=1e-15)
        assert ctl.value == pytest.approx(value, abs=1e-15)


def test_state_dict_round_trip_and_errors():
    ctl = AdaptiveEntropyController(0.1, 1.0)
    fresh = AdaptiveEntropyController()
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.state_dict() == ctl.state_dict() and math.isinf(fresh.last_entropy)
    ctl.update(0.3)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.state_dict() == ctl.state_dict() and fresh.value == ctl.value
    with pytest.raises(ValueError, match="keys"):
        fresh.load_state_dict({"coef": 0.1})
    bad = dict(ctl.state_dict(), last_entropy=float("nan"))
    with pytest.raises(ValueError, match="last_entropy"):
        fresh.load_state_dict(bad)
    with pytest.raises(ValueError, match="init_coef"):
        AdaptiveEntropyController(2.0)  # above max_coef = 1
    with pytest.raises(ValueError, match="max_coef"):
        AdaptiveEntropyController(0.0, min_coef=0.5, max_coef=0.1)
    with pytest.raises(ValueError, match="delta"):
        AdaptiveEntropyController(delta=-0.1)
    with pytest.raises(ValueError, match="target_entropy"):
        AdaptiveEntropyController(target_entropy=float("inf"))
    with pytest.raises(ValueError, match="current_entropy"):
        AdaptiveEntropyController().update(float("nan"))
