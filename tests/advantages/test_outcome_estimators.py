"""Outcome estimators: vectorized vs per-sample loops, reference numbers and properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlmath as R
from tests.advantages import reference as ref
from tests.advantages.helpers import U64, grouped_batch, junk_under_mask, reordered_sum_atol


def _row_values(rewards, mask, scales):
    """Per-sample auxiliary inputs derived from each row (so they follow shuffles and
    splits), rounded through bf16 so every dtype sees exactly the same numbers."""
    score = torch.where(mask, rewards.double(), 0).sum(-1, keepdim=True)
    x = torch.cos(score * torch.tensor(scales, dtype=torch.float64) + 0.3)
    return x.to(torch.bfloat16).to(rewards.dtype)


def _remax_baselines(rewards, mask):
    return _row_values(rewards, mask, [1.7])[:, 0]


def _components(rewards, mask):
    return _row_values(rewards, mask, [0.9, 2.3, -1.1])


# name → (vectorized, reference, how to call: f(rewards, mask, index) → outputs)
CASES = {
    "grpo": lambda f, r, m, i: f(r, m, i),
    "dr_grpo": lambda f, r, m, i: f(r, m, i, norm_adv_by_std_in_grpo=False),
    "grpo_passk": lambda f, r, m, i: f(r, m, i),
    "grpo_passk_nonorm": lambda f, r, m, i: f(r, m, i, norm_adv_by_std_in_grpo=False),
    "rloo": lambda f, r, m, i: f(r, m, i),
    "opo": lambda f, r, m, i: f(r, m, i),
    "gpg": lambda f, r, m, i: f(r, m, i),
    "gpg_fixed": lambda f, r, m, i: f(r, m, i, f_norm=2.0, alpha=0.5),
    "reinforce_plus_plus": lambda f, r, m, i: f(r, m, gamma=0.9),
    "reinforce_plus_plus_g1": lambda f, r, m, i: f(r, m),
    "reinforce_plus_plus_baseline": lambda f, r, m, i: f(r, m, i),
    "remax": lambda f, r, m, i: f(r, _remax_baselines(r, m), m),
    "gdpo": lambda f, r, m, i: f(r, m, i),
    "gdpo_components": lambda f, r, m, i: f(
        r, m, i, reward_components=_components(r, m), reward_weights=[1.0, 0.5, 2.0]
    ),
    "gdpo_nonorm": lambda f, r, m, i: f(
        r, m, i, norm_adv_by_std_in_grpo=False, reward_components=_components(r, m)
    ),
}
FUNCS = {
    "grpo": (R.compute_grpo_outcome_advantage, ref.grpo_reference),
    "dr_grpo": (R.compute_grpo_outcome_advantage, ref.grpo_reference),
    "grpo_passk": (R.compute_grpo_passk_outcome_advantage, ref.grpo_passk_reference),
    "grpo_passk_nonorm": (R.compute_grpo_passk_outcome_advantage, ref.grpo_passk_reference),
    "rloo": (R.compute_rloo_outcome_advantage, ref.rloo_reference),
    "opo": (R.compute_opo_outcome_advantage, ref.opo_reference),
    "gpg": (R.compute_gpg_outcome_advantage, ref.gpg_reference),
    "gpg_fixed": (R.compute_gpg_outcome_advantage, ref.gpg_reference),
    "reinforce_plus_plus": (
        R.compute_reinforce_plus_plus_outcome_advantage,
        ref.reinforce_plus_plus_reference,
    ),
    "reinforce_plus_plus_g1": (
        R.compute_reinforce_plus_plus_outcome_advantage,
        ref.reinforce_plus_plus_reference,
    ),
    "reinforce_plus_plus_baseline": (
        R.compute_reinforce_plus_plus_baseline_outcome_advantage,
        ref.reinforce_plus_plus_baseline_reference,
    ),
    "remax": (R.compute_remax_outcome_advantage, ref.remax_reference),
    "gdpo": (R.compute_gdpo_outcome_advantage, ref.gdpo_reference),
    "gdpo_components": (R.compute_gdpo_outcome_advantage, ref.gdpo_reference),
    "gdpo_nonorm": (R.compute_gdpo_outcome_advantage, ref.gdpo_reference),
}
GROUPED = [n for n in CASES if not n.startswith(("reinforce_plus_plus_g", "remax"))]
GROUPED.remove("reinforce_plus_plus")
# Estimators whose per-sample output does not depend on other groups (no batch whitening,
# no batch-wide α).
PER_GROUP = ["grpo", "dr_grpo", "grpo_passk", "rloo", "opo", "gpg_fixed", "remax"]


def run(name, which, rewards, mask, index):
    return CASES[name](FUNCS[name][which], rewards, mask, index)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop_fp64(name, seed):
    rewards, mask, index = grouped_batch(seed)
    got = run(name, 0, rewards, mask, index)
    expected = run(name, 1, rewards, mask, index.tolist())
    for g, e in zip(got, expected):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
        assert torch.all(g[~mask] == 0)


@pytest.mark.parametrize("name", list(CASES))
def test_low_precision_against_fp64(name):
    rewards, mask, index = grouped_batch(3)
    expected = run(name, 0, rewards, mask, index)
    for dtype in (torch.float32, torch.bfloat16):
        # Inputs exactly representable in bf16 so that the comparison measures the math.
        r = rewards.to(dtype)
        got = run(name, 0, r, mask, index)
        exp64 = run(name, 0, r.double(), mask, index)
        for g, e in zip(got, exp64):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=1e-5)
    assert expected[0].dtype == torch.float64


@pytest.mark.parametrize(
    "index",
    [
        ["p"] * 8,
        np.array(["p"] * 8, dtype=object),
        torch.zeros(8, dtype=torch.long),
    ],
)
def test_reference_numbers(index):
    # A group of 8 with three rewards of 1 and five of 0 (docs/design.md, "Advantage estimators").
    rewards = torch.zeros(8, 4)
    rewards[:3, -1] = 1.0
    mask = torch.ones(8, 4, dtype=torch.bool)
    grpo, _ = R.compute_grpo_outcome_advantage(rewards, mask, index)
    dr, _ = R.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    rloo, _ = R.compute_rloo_outcome_advantage(rewards, mask, index)
    for adv, hi, lo in ((grpo, 1.2076, -0.7246), (dr, 0.625, -0.375), (rloo, 0.7143, -0.4286)):
        assert torch.all((adv[:3] - hi).abs() < 5e-5), adv[:3, 0]
        assert torch.all((adv[3:] - lo).abs() < 5e-5), adv[3:, 0]


@pytest.mark.parametrize("name", GROUPED)
def test_singletons_and_all_equal_groups_are_exactly_zero(name):
    rewards = torch.tensor([[0.1, 0.2], [0.1, 0.2], [0.1, 0.2], [3.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    mask = torch.ones_like(rewards, dtype=torch.bool)
    index = ["flat", "flat", "flat", "alone", "pair", "pair"]
    adv, _ = run(name, 0, rewards, mask, index)
    assert torch.isfinite(adv).all()
    if name.startswith(("gdpo", "reinforce_plus_plus_baseline")):
        return  # batch whitening shifts the zeros; covered by the reference comparison
    assert torch.all(adv[:4] == 0), adv


@pytest.mark.parametrize("name", list(CASES))
def test_masked_rewards_never_matter(name):
    rewards, mask, index = grouped_batch(4)
    clean = run(name, 0, rewards, mask, index)
    for junk in (float("nan"), float("inf"), 1e30, -100.0):
        dirty = run(name, 0, junk_under_mask(rewards, mask, junk), mask, index)
        for c, d in zip(clean, dirty):
            assert torch.equal(c, d)


def test_nan_on_a_valid_token_stays_visible_in_its_group():
    rewards, mask, index = grouped_batch(5)
    row = int(torch.nonzero(mask.any(-1) & (index == 57))[0, 0])
    col = int(torch.nonzero(mask[row])[0, 0])
    rewards[row, col] = float("nan")
    adv, _ = R.compute_grpo_outcome_advantage(rewards, mask, index)
    same_group = (index == 57)[:, None] & mask
    assert torch.isnan(adv[same_group]).all()
    assert not torch.isnan(adv[~same_group]).any()


@pytest.mark.parametrize("name", PER_GROUP)
def test_splitting_the_batch_by_groups_changes_nothing(name):
    rewards, mask, index = grouped_batch(6)
    whole = run(name, 0, rewards, mask, index)
    first = torch.isin(index, torch.tensor([7, 27, 47, 67]))
    for part in (first, ~first):
        piece = run(name, 0, rewards[part], mask[part], index[part])
        for w, p in zip(whole, piece):
            torch.testing.assert_close(w[part], p, rtol=0, atol=1e-12)


def shuffle_atol(rewards, mask, index):
    """Bound on how far an estimator's outputs move when the batch is permuted.

    A permutation only reorders the terms of the sums (group sums, batch whitening
    sums: at most N = B·T terms each), and a reordered fp64 sum moves by at most
    2(N − 1)·u·Σ|terms| (Higham, §4.2). The estimators centre by such sums and divide
    by a group or batch standard deviation (+ε) of at least d; the two-stage ones
    (GDPO, REINFORCE++-baseline: group-normalise, then batch-whiten) do it twice. With
    M the largest |score| (or return), an output moves by at most 4·N·u·(1 + M/d)².
    """
    scores = torch.where(mask, rewards, 0).sum(-1)
    stds = [scores[index == g].std() for g in index.unique() if (index == g).sum() > 1]
    d = min([1.0, float(scores.std())] + [float(x) for x in stds if x > 0])
    big = float(torch.where(mask, rewards.abs(), 0).sum(-1).max())
    return 4 * mask.numel() * U64 * (1 + big / d) ** 2


@given(seed=st.integers(0, 10_000), name=st.sampled_from(list(CASES)))
def test_shuffling_the_batch_permutes_the_outputs(seed, name):
    rewards, mask, index = grouped_batch(seed % 7)
    perm = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed))
    a = run(name, 0, rewards, mask, index)
    b = run(name, 0, rewards[perm], mask[perm], index[perm])
    atol = shuffle_atol(rewards, mask, index)
    for x, y in zip(a, b):
        torch.testing.assert_close(x[perm], y, rtol=0, atol=atol)


def test_grpo_passk_gives_the_gap_to_the_unique_best_only():
    rewards = torch.tensor([[0.0], [3.0], [1.0], [2.0], [2.0], [5.0], [5.0]])
    mask = torch.ones_like(rewards, dtype=torch.bool)
    index = [0, 0, 0, 1, 1, 2, 2]
    adv, _ = R.compute_grpo_passk_outcome_advantage(
        rewards, mask, index, norm_adv_by_std_in_grpo=False
    )
    assert adv[:, 0].tolist() == [0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    adv, _ = R.compute_grpo_passk_outcome_advantage(rewards, mask, index)
    std = torch.tensor([0.0, 3.0, 1.0]).std()
    torch.testing.assert_close(adv[1, 0], 2.0 / (std + 1e-6))


def test_reinforce_plus_plus_skips_masked_tokens():
    # Multi-turn: the reward after a tool span reaches earlier tokens with one γ per valid step.
    rewards = torch.tensor([[0.0, 0.0, 9.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1]], dtype=torch.bool)
    _, ret = R.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[0.25, 0.5, 0.0, 0.0, 1.0]]


def test_remax_returns_and_advantages():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0], [0.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv, ret = R.compute_remax_outcome_advantage(rewards, torch.tensor([1.0, -1.0]), mask)
    assert ret.tolist() == [[3.0, 0.0, 2.0, 0.0], [3.0, 3.0, 0.0, 0.0]]
    assert adv.tolist() == [[2.0, 0.0, 1.0, 0.0], [4.0, 4.0, 0.0, 0.0]]


def test_gdpo_single_component_is_whitened_grpo():
    rewards, mask, index = grouped_batch(7)
    gdpo, _ = R.compute_gdpo_outcome_advantage(rewards, mask, index)
    grpo, _ = R.compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(gdpo, R.masked_whiten(grpo, mask), rtol=0, atol=1e-12)
    scores = torch.where(mask, rewards, 0).sum(-1, keepdim=True)
    comp, _ = R.compute_gdpo_outcome_advantage(rewards, mask, index, reward_components=scores)
    torch.testing.assert_close(comp, gdpo, rtol=0, atol=1e-12)


def test_gpg_default_alpha_counts_nonzero_scores():
    rewards = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
    mask = torch.ones_like(rewards, dtype=torch.bool)
    adv, _ = R.compute_gpg_outcome_advantage(rewards, mask, [0, 0, 1, 1])
    # α = B / #nonzero = 4; group 0 mean 0.5; group 1 all equal.
    assert adv[:, 0].tolist() == [2.0, -2.0, 0.0, 0.0]


def test_returns_alias_and_no_input_change():
    rewards, mask, index = grouped_batch(8)
    before = rewards.clone()
    adv, ret = R.compute_grpo_outcome_advantage(rewards, mask, index)
    assert ret is adv  # as verl: outcome advantages double as returns
    assert torch.equal(rewards, before)


def test_bad_input():
    r, m = torch.zeros(4, 3), torch.ones(4, 3)
    with pytest.raises(ValueError, match="index"):
        R.compute_grpo_outcome_advantage(r, m, [0, 1, 2])
    with pytest.raises(ValueError, match="response_mask"):
        R.compute_rloo_outcome_advantage(r, torch.ones(4, 2), [0] * 4)
    with pytest.raises(ValueError, match="epsilon"):
        R.compute_grpo_outcome_advantage(r, m, [0] * 4, epsilon=-1.0)
    with pytest.raises(TypeError, match="token_level_rewards"):
        R.compute_grpo_outcome_advantage(r.long(), m, [0] * 4)
    with pytest.raises(ValueError, match="reward_baselines"):
        R.compute_remax_outcome_advantage(r, torch.zeros(3), m)
    with pytest.raises(TypeError, match="reward_baselines"):
        R.compute_remax_outcome_advantage(r, [0.0] * 4, m)
    with pytest.raises(ValueError, match="reward_components"):
        R.compute_gdpo_outcome_advantage(r, m, [0] * 4, reward_components=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="reward_weights"):
        R.compute_gdpo_outcome_advantage(
            r, m, [0] * 4, reward_components=torch.zeros(4, 2), reward_weights=[1.0]
        )
    with pytest.raises(ValueError, match="f_norm"):
        R.compute_gpg_outcome_advantage(r, m, [0] * 4, f_norm=0.0)
    with pytest.raises(ValueError, match="gamma"):
        R.compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=2.0)


def test_gdpo_mixed_precision_follows_the_widest_input():
    rewards, mask, index = grouped_batch(9)
    comps = _components(rewards, mask)
    adv64, _ = R.compute_gdpo_outcome_advantage(
        rewards.float(), mask, index, reward_components=comps
    )
    adv32, _ = R.compute_gdpo_outcome_advantage(
        rewards.float(), mask, index, reward_components=comps.float()
    )
    assert adv64.dtype == torch.float64 and adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv64, rtol=1e-5, atol=1e-5)


@given(
    seed=st.integers(0, 10_000),
    n_valid=st.integers(1, 10),
    inserts=st.lists(st.integers(0, 10), max_size=5),
    gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_reinforce_plus_plus_masked_insertions_change_nothing(seed, n_valid, inserts, gamma):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(1, n_valid, generator=gen, dtype=torch.float64)
    _, base = R.compute_reinforce_plus_plus_outcome_advantage(
        rewards, torch.ones(1, n_valid), gamma=gamma
    )
    cols, keep = [], []
    for k in range(n_valid + 1):
        cols += [float("nan")] * inserts.count(k)
        keep += [False] * inserts.count(k)
        if k < n_valid:
            cols.append(float(rewards[0, k]))
            keep.append(True)
    mask = torch.tensor([keep])
    _, ret = R.compute_reinforce_plus_plus_outcome_advantage(
        torch.tensor([cols], dtype=torch.float64), mask, gamma=gamma
    )
    # The return-to-go G_t = Σ_k γ^k r_{t+k} is a sum of at most width + 1 terms of
    # total size ≤ Σ|r|, taken in another order once the packed width changes.
    atol = reordered_sum_atol(mask.shape[1] + 1, float(rewards.abs().sum()))
    torch.testing.assert_close(ret[mask], base[0], rtol=0, atol=atol)
    assert torch.all(ret[~mask] == 0)


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "gdpo"])
def test_epsilon_zero_gives_zero_for_flat_groups_and_singletons(name):
    # Scores 1, 1 | 0, 0.5 | 1 | 0.25: a flat group, a varied one, two singletons.
    rewards = torch.zeros(6, 3)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 0.0, 0.5, 1.0, 0.25])
    mask = torch.ones(6, 3, dtype=torch.bool)
    index = [0, 0, 1, 1, 2, 3]
    fn = R.get_advantage_estimator(name)
    adv, _ = fn(rewards, mask, index, epsilon=0.0)
    assert torch.isfinite(adv).all(), adv
    if name != "gdpo":  # gdpo whitens over the batch afterwards
        flat = torch.tensor([True, True, False, False, True, True])
        assert torch.equal(adv[flat], torch.zeros_like(adv[flat]))
        assert (adv[~flat] != 0).any()
