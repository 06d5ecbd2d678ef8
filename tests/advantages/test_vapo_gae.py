"""VAPO's decoupled, length-adaptive GAE: a hand-worked row, the λ rule, options, bad input."""

from __future__ import annotations

import pytest
import torch

import rlmath as R
from tests.advantages import reference as ref
from tests.advantages.helpers import grouped_batch


def test_worked_example_with_a_masked_gap():
    # One response with 4 valid tokens (a tool span at column 2 is skipped), γ = 1,
    # reward 1 on the last token, V = 0.5 everywhere. α = 0.5: α·l = 2, so
    # λ_actor = 1 - 1/2 = 0.5. TD errors over the valid tokens: δ = (0, 0, 0, 1 - 0.5).
    # Actor (λ = 0.5): A = 0.5, then 0.5·0.5 = 0.25, 0.125, 0.0625 going back.
    # Critic (λ = 1): every A = 0.5, so returns = A + V = 1.
    rewards = torch.tensor([[0.0, 0.0, 7.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.5, -9.0, 0.5, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True, True]])
    adv, ret = R.compute_vapo_gae_advantage_return(
        rewards, values, mask, 1.0, 1.0, length_adaptive_alpha=0.5, whiten=False
    )
    assert adv.tolist() == [[0.0625, 0.125, 0.0, 0.25, 0.5]]
    assert ret.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0]]
    # VAPO's own α = 0.05: α·l = 0.2 < 1 is clamped to 1, λ_actor = 0: A = δ.
    adv, _ = R.compute_vapo_gae_advantage_return(rewards, values, mask, 1.0, whiten=False)
    assert adv.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.5]]


def test_length_adaptive_lambda():
    mask = torch.zeros(4, 100, dtype=torch.bool)
    for row, n in enumerate((0, 10, 40, 100)):
        mask[row, :n] = True
    lam = R.length_adaptive_lambda(mask)  # α = 0.05: α·l = 0, 0.5, 2, 5
    assert lam.tolist() == [0.0, 0.0, 0.5, 0.8]
    assert R.length_adaptive_lambda(mask, length_adaptive_alpha=1.0).tolist() == [
        0.0, 0.9, 1 - 1 / 40, 0.99
    ]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"length_adaptive_alpha": 0.3},
        {"length_adaptive_alpha": None},  # plain GAE with λ = lam
        {"length_adaptive_alpha": None, "lam_actor": 0.7},
        {"whiten": False, "length_adaptive_alpha": 1.0},
    ],
)
def test_options_against_the_oracle(kwargs):
    rewards, mask, _ = grouped_batch(6, t=40)
    values = torch.cos(torch.arange(rewards.numel(), dtype=torch.float64)).reshape(rewards.shape)
    got = R.compute_vapo_gae_advantage_return(rewards, values, mask, 0.99, 0.9, **kwargs)
    want = ref.vapo_gae_reference(rewards, values, mask, 0.99, 0.9, **kwargs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_plain_gae_when_nothing_is_decoupled():
    rewards, mask, _ = grouped_batch(7, t=20)
    values = torch.sin(torch.arange(rewards.numel(), dtype=torch.float64)).reshape(rewards.shape)
    got = R.compute_vapo_gae_advantage_return(
        rewards, values, mask, 0.9, 0.8, length_adaptive_alpha=None
    )
    want = R.compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_bad_input():
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        R.compute_vapo_gae_advantage_return(r, r, m, 1.0, lam_actor=0.9)
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        R.compute_vapo_gae_advantage_return(r, r, m, 1.0, length_adaptive_alpha=0.0)
    with pytest.raises(ValueError, match="lam_actor"):
        R.compute_vapo_gae_advantage_return(r, r, m, 1.0, lam_actor=1.5, length_adaptive_alpha=None)
    with pytest.raises(ValueError, match="lam"):
        R.compute_vapo_gae_advantage_return(r, r, m, 1.0, 2.0)
    with pytest.raises(ValueError, match="values"):
        R.compute_vapo_gae_advantage_return(r, torch.zeros(2, 2), m, 1.0)
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        R.length_adaptive_lambda(m, length_adaptive_alpha=-1.0)
