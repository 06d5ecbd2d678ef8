"""MaxRL: a hand-worked group, the ε and flat-group rules, bad input."""

from __future__ import annotations

import pytest
import torch

import rlmath as R
from tests.advantages import reference as ref
from tests.advantages.helpers import grouped_batch


def _outcome(scores, length=3):
    """One row per score, the score on the last of ``length`` valid tokens."""
    rewards = torch.zeros(len(scores), length, dtype=torch.float64)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, torch.ones(len(scores), length, dtype=torch.bool)


def test_worked_example():
    # Group 0: one pass in four, pass rate 1/4: a pass gets (1 - 1/4)/(1/4) = 3, a fail
    # (0 - 1/4)/(1/4) = -1 (the paper's n/K - 1 and -1). Group 1: two passes in four,
    # rate 1/2: +1 / -1. Group 2: all fail (flat) and group 3 a singleton: 0.
    rewards, mask = _outcome([1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1])
    index = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3]
    adv, ret = R.compute_maxrl_outcome_advantage(rewards, mask, index, epsilon=0.0)
    want = torch.tensor([3, -1, -1, -1, 1, 1, -1, -1, 0, 0, 0], dtype=torch.float64)
    assert torch.equal(adv, want[:, None].expand(-1, 3))
    assert ret is adv
    # SkyRL's ε = 1e-6 sits in the denominator: 0.75 / 0.250001.
    adv, _ = R.compute_maxrl_outcome_advantage(rewards, mask, index)
    assert adv[0, 0].item() == pytest.approx(0.75 / (0.25 + 1e-6), rel=1e-15)


def test_masked_tokens_and_options_against_the_oracle():
    rewards, mask, index = grouped_batch(4)
    rewards = rewards.abs()  # MaxRL's rewards are non-negative (a pass rate)
    for eps in (0.0, 1e-6, 0.5):
        got = R.compute_maxrl_outcome_advantage(rewards, mask, index, epsilon=eps)
        want = ref.maxrl_reference(rewards, mask, index.tolist(), epsilon=eps)
        torch.testing.assert_close(got[0], want[0], rtol=1e-13, atol=1e-13)


def test_bad_input():
    r, m = _outcome([1, 0])
    with pytest.raises(ValueError, match="epsilon"):
        R.compute_maxrl_outcome_advantage(r, m, [0, 0], epsilon=-1e-6)
    with pytest.raises(ValueError, match="index"):
        R.compute_maxrl_outcome_advantage(r, m, [0])
