"""GiGPO: a hand-worked group of two agent trajectories, options, bad input."""

from __future__ import annotations

import pytest
import torch

import rlmath as R
from tests.advantages import reference as ref
from tests.advantages.conformance import INPUTS, make_batch

# Two trajectories of one group (rows shuffled; the step numbers give the order).
#   τ1: state A (reward 0) → state B (reward 1)                  R(τ1) = 1
#   τ2: state A (reward 0) → state C (reward 0) → state B (0)    R(τ2) = 0
ROWS = [  # (trajectory, step, state, reward)
    ("t2", 2, "B", 0.0),
    ("t1", 0, "A", 0.0),
    ("t2", 0, "A", 0.0),
    ("t1", 1, "B", 1.0),
    ("t2", 1, "C", 0.0),
]


def _call(**kwargs):
    rewards = torch.zeros(len(ROWS), 2, dtype=torch.float64)
    rewards[:, 1] = torch.tensor([r[3] for r in ROWS], dtype=torch.float64)
    mask = torch.ones(len(ROWS), 2, dtype=torch.bool)
    adv, ret = R.compute_gigpo_outcome_advantage(
        rewards, mask, ["g"] * len(ROWS), [r[0] for r in ROWS],
        torch.tensor([r[1] for r in ROWS]), [r[2] for r in ROWS], **kwargs,
    )  # fmt: skip
    assert ret is adv
    return adv[:, 0].tolist()


def test_worked_example():
    # γ = 0.5. Step returns: τ1: G(A) = 0 + 0.5·1 = 0.5, G(B) = 1; τ2: all 0.
    # Episode level (each trajectory once): mean R = 0.5, A^E = +0.5 (τ1), -0.5 (τ2).
    # Step level, by anchor state: A = {0.5 (τ1), 0 (τ2)}: mean 0.25 → +0.25 / -0.25;
    # B = {1 (τ1), 0 (τ2)}: mean 0.5 → +0.5 / -0.5; C is a singleton → 0.
    # A = A^E + A^S, in row order (t2B, t1A, t2A, t1B, t2C):
    assert _call(gamma=0.5) == [-1.0, 0.75, -0.75, 1.0, -0.5]
    # ω = 2 doubles the step part.
    assert _call(gamma=0.5, step_advantage_weight=2.0) == [-1.5, 1.0, -1.0, 1.5, -0.5]
    # verl-agent / ROLL statistics: the 5 rows count, so mean R = 2/5 and
    # A^E = 1 - 0.4 = 0.6 (τ1 rows), 0 - 0.4 = -0.4 (τ2 rows).
    got = _call(gamma=0.5, episode_statistics="step")
    assert got == pytest.approx([-0.9, 0.85, -0.65, 1.1, -0.4], abs=1e-15)


def test_std_normalisation():
    # With the std (unbiased, of two values x, y: |x - y|/√2) each two-member group
    # gives ±(|x - y|/2)/(|x - y|/√2) = ±1/√2; ε = 0 keeps it exact.
    s = 2**-0.5
    got = _call(gamma=0.5, norm_adv_by_std_in_grpo=True, epsilon=0.0)
    assert got == pytest.approx([-2 * s, 2 * s, -2 * s, 2 * s, -s], abs=1e-15)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"episode_statistics": "step"},
        {"norm_adv_by_std_in_grpo": True, "gamma": 1.0},
        {"gamma": 0.0, "step_advantage_weight": 0.3},
    ],
)
def test_options_against_the_oracle(kwargs):
    batch = make_batch(2)
    args = {k: INPUTS[k](batch) for k in ("traj_index", "step_index", "anchor_state")}
    got = R.compute_gigpo_outcome_advantage(
        batch.rewards, batch.mask, batch.index, **args, **kwargs
    )
    want = ref.gigpo_reference(batch.rewards, batch.mask, batch.index, **args, **kwargs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-13, atol=1e-13)


def test_bad_input():
    r, m = torch.zeros(3, 2), torch.ones(3, 2)
    ok = {"traj_index": [0, 0, 1], "step_index": [0, 1, 0], "anchor_state": [0, 1, 0]}
    R.compute_gigpo_outcome_advantage(r, m, [0, 0, 0], **ok)
    with pytest.raises(TypeError, match="step_index"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **{**ok, "step_index": [0.0, 1.0, 0.0]})
    with pytest.raises(ValueError, match="step_index"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **{**ok, "step_index": [0, 1]})
    with pytest.raises(ValueError, match="traj_index"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **{**ok, "traj_index": [0, 1]})
    with pytest.raises(ValueError, match="anchor_state"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **{**ok, "anchor_state": [0]})
    with pytest.raises(ValueError, match="episode_statistics"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **ok, episode_statistics="group")
    with pytest.raises(ValueError, match="gamma"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **ok, gamma=1.5)
    with pytest.raises(ValueError, match="step_advantage_weight"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **ok, step_advantage_weight=-1.0)
    with pytest.raises(TypeError, match="norm_adv_by_std_in_grpo"):
        R.compute_gigpo_outcome_advantage(r, m, [0] * 3, **ok, norm_adv_by_std_in_grpo=1)
