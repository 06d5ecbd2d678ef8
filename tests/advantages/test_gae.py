"""GAE with multi-turn semantics: scan vs loop vs the closed-form sum, and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import (
    compute_gae_advantage_return,
    get_advantage_estimator,
    masked_whiten,
)
from tests.advantages.helpers import gap_mask, junk_under_mask, reordered_sum_atol, span_mask
from tests.advantages.reference import compute_gae_advantage_return_reference

GAMMA_LAM = [(0.9, 0.0), (1.0, 0.5), (1.0, 0.95), (1.0, 1.0), (0.99, 0.95), (0.0, 0.7)]


def closed_form(rewards, values, mask, gamma, lam):
    """A[k] = Σ_{j ≥ k} (γλ)^(j−k) δ[j] over each row's valid tokens, in Python floats."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[b, t]]
        r = [float(rewards[b, t]) for t in pos]
        v = [float(values[b, t]) for t in pos] + [0.0]
        delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(pos))]
        for k, t in enumerate(pos):
            out[b, t] = math.fsum((gamma * lam) ** (j - k) * delta[j] for j in range(k, len(pos)))
    return out


def random_inputs(b, t, seed, dtype=torch.float64, spans=False):
    gen = torch.Generator().manual_seed(seed)
    mask = span_mask(b, t, gen) if spans else gap_mask(b, t, gen)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype)
    return rewards, values, mask


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
@pytest.mark.parametrize("t", [1, 2, 7, 40])
def test_matches_closed_form_and_loop(gamma, lam, t):
    rewards, values, mask = random_inputs(6, t, seed=t)
    mask[0] = False  # an empty row
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam, whiten=False)
    expected = closed_form(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.where(mask, expected + values, 0), rtol=0, atol=1e-12)
    loop_adv, loop_ret = compute_gae_advantage_return_reference(
        rewards, values, mask, gamma, lam, whiten=False
    )
    torch.testing.assert_close(loop_adv, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(loop_ret, ret, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("gamma", "lam"), [(0.9, 0.0), (1.0, 0.5), (1.0, 0.95), (1.0, 1.0)])
def test_long_sequences_fp64_and_fp32(gamma, lam):
    # γλ ∈ {0, 0.5, 0.95, 1} at T = 16384 (two rows keep the loop affordable).
    rewards, values, mask = random_inputs(2, 16384, seed=3, spans=True)
    ref_adv, ref_ret = compute_gae_advantage_return_reference(
        rewards, values, mask, gamma, lam, whiten=False
    )
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam, whiten=False)
    scale = ref_adv.abs().max()
    assert (adv - ref_adv).abs().max() <= 1e-12 * max(1.0, float(scale))
    assert (ret - ref_ret).abs().max() <= 1e-12 * max(1.0, float(ref_ret.abs().max()))
    adv32, ret32 = compute_gae_advantage_return(
        rewards.float(), values.float(), mask, gamma, lam, whiten=False
    )
    assert adv32.dtype == torch.float32 and ret32.dtype == torch.float32
    assert (adv32.double() - ref_adv).abs().max() <= 1e-5 * scale
    white32, _ = compute_gae_advantage_return(rewards.float(), values.float(), mask, gamma, lam)
    white64 = masked_whiten(ref_adv, mask)
    assert (white32.double() - white64).abs().max() <= 1e-5 * white64.abs().max()


@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAM)
def test_whitened_matches_loop(gamma, lam):
    rewards, values, mask = random_inputs(5, 30, seed=11)
    got = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    expected = compute_gae_advantage_return_reference(rewards, values, mask, gamma, lam)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_returns_are_advantages_plus_values_before_whitening():
    rewards, values, mask = random_inputs(4, 25, seed=5)
    raw, ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95, whiten=False)
    white, ret_w = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    assert torch.equal(ret, ret_w)
    torch.testing.assert_close(ret, torch.where(mask, raw + values, 0), rtol=0, atol=0)
    torch.testing.assert_close(white, masked_whiten(raw, mask), rtol=0, atol=1e-12)


def test_masked_value_is_not_bootstrapped():
    mask = torch.tensor([[1, 1, 0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    for whiten in (False, True):
        a, _ = compute_gae_advantage_return(
            rewards, torch.tensor([[0.0, 0.0, 100.0]]), mask, 1.0, 1.0, whiten=whiten
        )
        b, _ = compute_gae_advantage_return(
            rewards, torch.tensor([[0.0, 0.0, 0.0]]), mask, 1.0, 1.0, whiten=whiten
        )
        assert torch.equal(a, b)
    raw, _ = compute_gae_advantage_return(rewards, torch.zeros(1, 3), mask, 1.0, 1.0, whiten=False)
    assert raw.tolist() == [[1.0, 1.0, 0.0]]


def test_gamma_lambda_one_is_reward_to_go_minus_value():
    rewards, values, mask = random_inputs(5, 33, seed=8)
    adv, _ = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0, whiten=False)
    r = torch.where(mask, rewards, 0)
    to_go = r.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, torch.where(mask, to_go - values, 0), rtol=0, atol=1e-12)


def test_masked_positions_exactly_zero_and_empty_batch_rows():
    rewards, values, mask = random_inputs(4, 20, seed=2)
    mask[1] = False
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    none = torch.zeros_like(mask)
    adv, ret = compute_gae_advantage_return(rewards, values, none, 0.99, 0.95)
    assert torch.all(adv == 0) and torch.all(ret == 0)


@given(
    seed=st.integers(0, 10_000),
    junk=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 100.0]),
    gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]),
    lam=st.sampled_from([0.0, 0.95, 1.0]),
    whiten=st.booleans(),
)
def test_masked_inputs_never_matter(seed, junk, gamma, lam, whiten):
    rewards, values, mask = random_inputs(3, 12, seed=seed)
    clean = compute_gae_advantage_return(rewards, values, mask, gamma, lam, whiten=whiten)
    dirty = compute_gae_advantage_return(
        junk_under_mask(rewards, mask, junk),
        junk_under_mask(values, mask, junk),
        mask,
        gamma,
        lam,
        whiten=whiten,
    )
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


@given(
    seed=st.integers(0, 10_000),
    n_valid=st.integers(1, 12),
    inserts=st.lists(st.integers(0, 12), max_size=6),
)
def test_inserting_masked_tokens_changes_nothing(seed, n_valid, inserts):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(1, n_valid, generator=gen, dtype=torch.float64)
    values = torch.randn(1, n_valid, generator=gen, dtype=torch.float64)
    base, base_ret = compute_gae_advantage_return(
        rewards, values, torch.ones(1, n_valid), 0.97, 0.9, whiten=False
    )
    # Build a longer row with masked junk tokens inserted before the chosen valid tokens.
    cols_r, cols_v, cols_m = [], [], []
    for k in range(n_valid + 1):
        for _ in range(inserts.count(k)):
            cols_r.append(123.0)
            cols_v.append(-55.0)
            cols_m.append(False)
        if k < n_valid:
            cols_r.append(float(rewards[0, k]))
            cols_v.append(float(values[0, k]))
            cols_m.append(True)
    mask = torch.tensor([cols_m])
    adv, ret = compute_gae_advantage_return(
        torch.tensor([cols_r], dtype=torch.float64),
        torch.tensor([cols_v], dtype=torch.float64),
        mask,
        0.97,
        0.9,
        whiten=False,
    )
    # The scan runs over the packed width, which the insertions change, so its sums
    # are taken in another order. Each advantage is Σ_k (γλ)^k δ_{t+k} with
    # |δ_t| ≤ |r_t| + γ|v_{t+1}| + |v_t|, a sum of at most width + 1 terms whose
    # absolute values add up to at most Σ|r| + 2Σ|v|; returns add v_t (one more rounding).
    abs_sum = float(rewards.abs().sum() + 3 * values.abs().sum())
    atol = reordered_sum_atol(mask.shape[1] + 1, abs_sum)
    torch.testing.assert_close(adv[mask], base[0], rtol=0, atol=atol)
    torch.testing.assert_close(ret[mask], base_ret[0], rtol=0, atol=atol)


def test_splitting_the_batch_changes_nothing_per_row():
    rewards, values, mask = random_inputs(8, 21, seed=4)
    whole = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95, whiten=False)
    for part in (slice(0, 3), slice(3, 8)):
        piece = compute_gae_advantage_return(
            rewards[part], values[part], mask[part], 0.99, 0.95, whiten=False
        )
        for w, p in zip(whole, piece):
            torch.testing.assert_close(w[part], p, rtol=0, atol=1e-12)
    # Returns never depend on whitening, hence never on the rest of the batch.
    _, ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    _, ret_part = compute_gae_advantage_return(rewards[:3], values[:3], mask[:3], 0.99, 0.95)
    torch.testing.assert_close(ret[:3], ret_part, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_against_fp64(dtype):
    rewards, values, mask = random_inputs(4, 64, seed=9, dtype=dtype)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    ref_adv, ref_ret = compute_gae_advantage_return_reference(
        rewards.double(), values.double(), mask, 0.99, 0.95
    )
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_inputs_not_modified_and_float_mask_and_tensor_scalars():
    rewards, values, mask = random_inputs(3, 10, seed=1)
    r0, v0 = rewards.clone(), values.clone()
    expected = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    got = compute_gae_advantage_return(
        rewards,
        values,
        mask.double(),
        torch.tensor(0.9, dtype=torch.float64),
        torch.tensor(0.8, dtype=torch.float64),
    )
    assert torch.equal(rewards, r0) and torch.equal(values, v0)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_registered_and_no_autograd_graph():
    assert get_advantage_estimator("gae") is compute_gae_advantage_return
    values = torch.randn(2, 5, requires_grad=True)
    adv, ret = compute_gae_advantage_return(torch.randn(2, 5), values, torch.ones(2, 5), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_bad_input():
    r, v, m = torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae_advantage_return(r, v, m, 1.5, 0.9)
    with pytest.raises(ValueError, match="lam"):
        compute_gae_advantage_return(r, v, m, 0.9, -0.1)
    with pytest.raises(ValueError, match="values"):
        compute_gae_advantage_return(r, torch.zeros(2, 5), m, 0.9, 0.9)
    with pytest.raises(ValueError, match="response_mask"):
        compute_gae_advantage_return(r, v, torch.ones(2, 3), 0.9, 0.9)
    with pytest.raises(ValueError, match="token_level_rewards"):
        compute_gae_advantage_return(torch.zeros(4), torch.zeros(4), torch.ones(4), 0.9, 0.9)
    with pytest.raises(TypeError, match="token_level_rewards"):
        compute_gae_advantage_return(r.long(), v, m, 0.9, 0.9)
    with pytest.raises(TypeError, match="values"):
        compute_gae_advantage_return(r, v.long(), m, 0.9, 0.9)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae_advantage_return(r, v, m, torch.tensor([0.9, 0.8]), 0.9)


@pytest.mark.parametrize("n_valid", [0, 1, 2, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_whitening_equals_masked_whiten(n_valid, dtype):
    # Every estimator whitens through one private function; it must agree with the
    # library's masked_whiten (unbiased variance, eps 1e-8, zeros under the mask).
    from rlmath.advantages._common import whiten_batch

    gen = torch.Generator().manual_seed(n_valid)
    mask = torch.zeros(5, 10, dtype=torch.bool)
    mask.view(-1)[torch.randperm(50, generator=gen)[:n_valid]] = True
    values = torch.where(mask, 3 * torch.randn(5, 10, generator=gen, dtype=dtype) + 1, 0)
    got = whiten_batch(values, mask)
    expected = masked_whiten(values, mask)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert got.dtype == dtype and torch.all(got[~mask] == 0)


def test_batch_whitening_per_sample_form_equals_token_form():
    from rlmath.advantages._common import whiten_batch

    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 9, generator=gen) < 0.6
    mask[2] = False
    per_sample = torch.randn(6, generator=gen, dtype=torch.float64)
    tokens = torch.where(mask, per_sample[:, None], 0)
    got = torch.where(mask, whiten_batch(per_sample, counts=mask.sum(-1))[:, None], 0)
    torch.testing.assert_close(got, masked_whiten(tokens, mask), rtol=1e-12, atol=1e-12)
