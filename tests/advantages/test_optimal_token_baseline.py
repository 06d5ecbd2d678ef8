"""Optimal token baseline (single- and multi-turn) against per-group loops, and properties."""

from __future__ import annotations

import pytest
import torch

import rlmath as R
from tests.advantages.helpers import grouped_batch, junk_under_mask
from tests.advantages.reference import optimal_token_baseline_reference

VARIANTS = {
    False: R.compute_optimal_token_baseline_advantage,
    True: R.compute_multi_turn_optimal_token_baseline_advantage,
}


def policy_stats(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    probs = 0.05 + 0.9 * torch.rand(shape, generator=gen, dtype=torch.float64)
    sum_pi_sq = probs**2 + 0.3 * torch.rand(shape, generator=gen, dtype=torch.float64)
    is_w = 0.5 + torch.rand(shape, generator=gen, dtype=torch.float64)
    return probs.log().to(dtype), sum_pi_sq.to(dtype), is_w.to(dtype)


@pytest.mark.parametrize("multi_turn", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop_fp64(multi_turn, zero_tail, with_is, seed):
    rewards, mask, index = grouped_batch(seed, t=11)
    logp, spi2, is_w = policy_stats(mask.shape, seed)
    is_w = is_w if with_is else None
    got = VARIANTS[multi_turn](rewards, mask, index, logp, spi2, is_w, zero_tail)
    expected = optimal_token_baseline_reference(
        rewards, mask, index.tolist(), logp, spi2, is_w, zero_tail, multi_turn=multi_turn
    )
    for g, e in zip(got, expected):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
        assert torch.all(g[~mask] == 0)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_fp32_against_fp64(multi_turn):
    rewards, mask, index = grouped_batch(2, t=11)
    logp, spi2, is_w = policy_stats(mask.shape, 2)
    args = (rewards, mask, index, logp, spi2, is_w)
    expected = VARIANTS[multi_turn](*args)
    got = VARIANTS[multi_turn](
        *(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
    )
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)


def test_close_to_the_raw_formula():
    # Without the exact-zero rule, B_t = Σ G·W / (Σ W + ε) over the group at each step.
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.bool)
    logp, spi2, _ = policy_stats(mask.shape, 5)
    adv, ret = R.compute_optimal_token_baseline_advantage(
        rewards, mask, [0] * 4, logp, spi2, handle_zero_tail=False
    )
    w = (1 - 2 * logp.exp() + spi2).cumsum(-1)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    baseline = (to_go * w).sum(0) / (w.sum(0) + 1e-8)
    torch.testing.assert_close(ret, to_go, rtol=0, atol=1e-12)
    torch.testing.assert_close(adv, to_go - baseline, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_identical_trajectories_and_singletons_give_exactly_zero(multi_turn):
    row = torch.tensor([0.2, 0.0, 1.3, 0.1])
    rewards = torch.stack([row, row, row, torch.tensor([5.0, 1.0, 0.0, 2.0])])
    mask = torch.ones(4, 4, dtype=torch.bool)
    logp, spi2, _ = policy_stats(mask.shape, 1, dtype=torch.float32)
    adv, ret = VARIANTS[multi_turn](rewards, mask, ["g", "g", "g", "solo"], logp, spi2)
    assert torch.all(adv == 0)
    assert torch.all(ret[3] != 0)


def test_zero_tail_single_turn():
    # The longer trajectory is alone past column 2: its baseline there is 0 (advantage = return).
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    logp, spi2, _ = policy_stats(mask.shape, 3)
    adv, ret = R.compute_optimal_token_baseline_advantage(rewards, mask, [1, 1], logp, spi2)
    torch.testing.assert_close(adv[1, 2:], ret[1, 2:], rtol=0, atol=0)
    no_tail, _ = R.compute_optimal_token_baseline_advantage(
        rewards, mask, [1, 1], logp, spi2, handle_zero_tail=False
    )
    assert torch.all(no_tail[1, 2:] == 0)  # alone at those steps: baseline = its own return


def test_multi_turn_aligns_by_valid_token():
    # Spreading one trajectory's tokens out with masked tool spans (NaN there) changes
    # nothing at valid tokens, for it or for the rest of its group.
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    logp, spi2, is_w = policy_stats(mask.shape, 4)
    fn = R.compute_multi_turn_optimal_token_baseline_advantage
    base, base_ret = fn(rewards, mask, [0, 0, 0], logp, spi2, is_w)

    row0_cols = torch.tensor([0, 1, 4, 5, 7])
    wide_mask = torch.zeros(3, 8, dtype=torch.bool)
    wide_mask[0, row0_cols] = True
    wide_mask[1:, :5] = True

    def spread(x):
        out = torch.full((3, 8), float("nan"), dtype=x.dtype)
        out[0, row0_cols] = x[0]
        out[1:, :5] = x[1:]
        return out

    adv, ret = fn(spread(rewards), wide_mask, [0, 0, 0], spread(logp), spread(spi2), spread(is_w))
    torch.testing.assert_close(adv[0, row0_cols], base[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(ret[0, row0_cols], base_ret[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(adv[1:, :5], base[1:], rtol=0, atol=1e-12)
    assert torch.all(adv[~wide_mask] == 0)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_masked_inputs_never_matter(multi_turn):
    rewards, mask, index = grouped_batch(6, t=9)
    logp, spi2, is_w = policy_stats(mask.shape, 6)
    clean = VARIANTS[multi_turn](rewards, mask, index, logp, spi2, is_w)
    for junk in (float("nan"), float("inf"), 1e30):
        dirty = VARIANTS[multi_turn](
            *(junk_under_mask(x, mask, junk) for x in (rewards,)),
            mask,
            index,
            *(junk_under_mask(x, mask, junk) for x in (logp, spi2, is_w)),
        )
        for c, d in zip(clean, dirty):
            assert torch.equal(c, d)


def test_registered_names_and_bad_input():
    assert R.get_advantage_estimator("optimal_token_baseline") is VARIANTS[False]
    assert R.get_advantage_estimator("tir_optimal_token_baseline") is VARIANTS[True]
    r, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="old_log_prob"):
        VARIANTS[False](r, m, [0, 0], torch.zeros(2, 4), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sum_pi_squared"):
        VARIANTS[True](r, m, [0, 0], torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="rollout_is_weights"):
        VARIANTS[True](r, m, [0, 0], torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(1, 3))
    with pytest.raises(ValueError, match="epsilon"):
        VARIANTS[False](r, m, [0, 0], torch.zeros(2, 3), torch.zeros(2, 3), epsilon=-1.0)
