"""Differential tests, advantage estimators: rlmath vs verl 0.9.1.

Every estimator of verl's registry is called through both registries on the same
random batch: masks with interior gaps, groups that are neither contiguous nor of
equal size, singleton groups, and outcome rewards on the last valid token (as a
reward manager writes them) or spread over valid tokens.

Pinned differences (docs/design.md, "Advantage estimators" and "Conventions"):
- advantages and returns are exactly 0 at masked positions (verl leaves GAE
  advantages/returns, ReMax returns, ... non-zero under mask=0);
- singleton groups give advantage 0 in every estimator (verl's loops
  return the raw score, grpo_passk raises);
- a masked position never influences a value (verl's outcome score is the sum of
  the token rewards over *all* positions, masked ones included).
Everything else must agree to float tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.peers.peer_helpers import assert_close, import_verl, randn, random_mask

verl_core = import_verl("verl.trainer.ppo.core_algos")
verl_config = import_verl("verl.trainer.config")

import rlmath  # noqa: E402

TOL = dict(rtol=2e-5, atol=2e-6)  # fp32 whitening of ~30 numbers; verl's +1e-8 in masked_mean


def _ours(name):
    try:
        return rlmath.get_advantage_estimator(name)
    except AttributeError:
        pytest.skip("this rlmath has no get_advantage_estimator")


def _theirs(name):
    return verl_core.get_adv_estimator_fn(name)


def _algo(**kw):
    return verl_config.AlgoConfig(**kw)


def make_batch(seed: int, *, singletons: bool, b: int = 14, t: int = 9, dense: bool = False):
    """A shuffled batch: groups of sizes 2..5 (plus 2 singletons if asked), uid strings."""
    gen = torch.Generator().manual_seed(seed)
    sizes = []
    while sum(sizes) < b - (2 if singletons else 0):
        sizes.append(int(torch.randint(2, 6, (), generator=gen)))
    sizes[-1] -= sum(sizes) - (b - (2 if singletons else 0))
    if sizes[-1] < 2:
        sizes[-2] += sizes[-1]
        sizes.pop()
    if singletons:
        sizes += [1, 1]
    labels = np.concatenate([[f"uid-{seed}-{g}"] * n for g, n in enumerate(sizes)])
    perm = torch.randperm(b, generator=gen).numpy()
    index = labels[perm]
    mask = random_mask(b, t, gen, layout="right", p_gap=0.2)
    rewards = torch.zeros(b, t)
    last = (torch.arange(t) * mask).argmax(-1)
    outcome = torch.randint(0, 3, (b,), generator=gen).float() - torch.rand(b, generator=gen)
    rewards[torch.arange(b), last] = outcome
    if dense:
        rewards = torch.where(mask, randn(b, t, gen=gen) * 0.3, 0.0)
    return index, mask, rewards, gen


def singleton_rows(index) -> torch.Tensor:
    _, inv, counts = np.unique(index, return_inverse=True, return_counts=True)
    return torch.from_numpy(counts[inv] == 1)


SEEDS = [0, 1, 2, 3]


def _compare_outcome(name, ours_kw, theirs_kw, index, mask, singletons_zero=True):
    a, r = _ours(name)(**ours_kw)
    av, rv = _theirs(name)(**theirs_kw)
    single = singleton_rows(index)
    keep = mask & ~single[:, None]
    assert_close(a[keep], av[keep], **TOL, msg=f"{name} advantages")
    assert_close(r[keep], rv[keep], **TOL, msg=f"{name} returns")
    # docs/design.md: advantages and returns are exactly 0 at masked positions.
    assert torch.all(a[~mask] == 0) and torch.all(r[~mask] == 0), name
    if singletons_zero:
        # docs/design.md: singleton groups give advantage 0 in every estimator.
        assert torch.all(a[single] == 0), name
    return a, av


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae(seed, gamma, lam):
    index, mask, rewards, gen = make_batch(seed, singletons=False, dense=True)
    values = randn(*mask.shape, gen=gen)
    # Values and rewards under mask=0 are garbage that must not matter (multi-turn
    # observation tokens); verl 0.9.1 also skips them ("skip values and TD-error on
    # observation tokens"), so valid positions agree.
    values_junk = torch.where(mask, values, 100.0)
    rewards_junk = torch.where(mask, rewards, 5.0)
    kw = dict(token_level_rewards=rewards_junk, values=values_junk, response_mask=mask.float())
    av, rv = _theirs("gae")(**kw, gamma=gamma, lam=lam)
    a, r = _ours("gae")(**kw, gamma=gamma, lam=lam)
    assert_close(a[mask], av[mask], **TOL, msg="gae advantages (whitened)")
    assert_close(r[mask], rv[mask], **TOL, msg="gae returns")
    assert torch.all(a[~mask] == 0) and torch.all(r[~mask] == 0)
    # whiten=False: verl's raw advantages are its returns minus values.
    a_raw, _ = _ours("gae")(rewards_junk, values_junk, mask, gamma, lam, whiten=False)
    assert_close(a_raw[mask], (rv - values_junk)[mask], **TOL, msg="gae raw advantages")


def test_gae_masked_rewards_ignored():
    # docs/design.md (GAE): rewards under the mask are never read. verl 0.9.1 skips the TD error
    # of a masked token entirely, so a reward there is ignored by both.
    mask = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[0.5, -0.2, 7.0, 0.1, 9.0]])
    rewards = torch.tensor([[0.0, 0.3, 5.0, 1.0, 4.0]])
    for g, lam in ((1.0, 1.0), (0.9, 0.8)):
        _, r = _ours("gae")(rewards, values, mask, g, lam, whiten=False)
        _, rv = verl_core.compute_gae_advantage_return(rewards, values, mask.float(), g, lam)
        assert_close(r[mask], rv[mask], rtol=1e-6)


# --------------------------------------------------------------------------- outcome estimators


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("verl_name", ["grpo", "grpo_vectorized"])
@pytest.mark.parametrize("singletons", [False, True])
def test_grpo(seed, norm, verl_name, singletons):
    index, mask, rewards, _ = make_batch(seed, singletons=singletons)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    a, _ = _ours("grpo")(**kw, norm_adv_by_std_in_grpo=norm)
    av, _ = _theirs(verl_name)(**kw, norm_adv_by_std_in_grpo=norm)
    keep = mask & ~singleton_rows(index)[:, None]
    assert_close(a[keep], av[keep], **TOL, msg=f"grpo vs {verl_name}")
    assert torch.all(a[~mask] == 0)
    assert torch.all(a[singleton_rows(index)] == 0)


def test_grpo_reference_numbers_match_verl():
    # docs/design.md reference numbers: 8 samples, 3 with reward 1: GRPO +1.2076/-0.7246,
    # Dr.GRPO +0.625/-0.375.
    rewards = torch.zeros(8, 3)
    rewards[:3, -1] = 1.0
    mask = torch.ones(8, 3, dtype=torch.bool)
    index = np.array(["p"] * 8, dtype=object)
    for norm in (True, False):
        a, _ = _ours("grpo")(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        av, _ = verl_core.compute_grpo_outcome_advantage(
            rewards, mask, index, norm_adv_by_std_in_grpo=norm
        )
        assert_close(a, av, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(seed, norm):
    index, mask, rewards, _ = make_batch(seed, singletons=False)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    a, _ = _ours("grpo_passk")(**kw, norm_adv_by_std_in_grpo=norm)
    # verl reads the flag from config only.
    av, _ = _theirs("grpo_passk")(**kw, config=_algo(norm_adv_by_std_in_grpo=norm))
    assert_close(a, av, **TOL)


def test_grpo_passk_singletons_documented_difference():
    index, mask, rewards, _ = make_batch(7, singletons=True)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    with pytest.raises(ValueError):  # verl: "Pass@k requires at least 2 samples per group"
        _theirs("grpo_passk")(**kw, config=_algo())
    a, _ = _ours("grpo_passk")(**kw)
    assert torch.all(a[singleton_rows(index)] == 0)  # docs/design.md: singletons give 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("verl_name", ["rloo", "rloo_vectorized"])
@pytest.mark.parametrize("singletons", [False, True])
def test_rloo(seed, verl_name, singletons):
    index, mask, rewards, _ = make_batch(seed, singletons=singletons)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    a, _ = _ours("rloo")(**kw)
    av, _ = _theirs(verl_name)(**kw)
    keep = mask & ~singleton_rows(index)[:, None]
    assert_close(a[keep], av[keep], **TOL, msg=f"rloo vs {verl_name}")
    assert torch.all(a[singleton_rows(index)] == 0)
    if verl_name == "rloo_vectorized":  # verl's vectorized RLOO already gives 0 there
        assert_close(a, av, **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("singletons", [False, True])
def test_opo(seed, singletons):
    index, mask, rewards, _ = make_batch(seed, singletons=singletons)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    _compare_outcome("opo", kw, kw, index, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("singletons", [False, True])
def test_gpg(seed, singletons):
    index, mask, rewards, _ = make_batch(seed, singletons=singletons)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    _compare_outcome("gpg", kw, kw, index, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("dense", [False, True])
def test_reinforce_plus_plus(seed, gamma, dense):
    index, mask, rewards, _ = make_batch(seed, singletons=True, dense=dense)
    a, r = _ours("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, gamma=gamma
    )
    av, rv = _theirs("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask.float(), config=_algo(gamma=gamma)
    )
    # verl 0.9.1 already carries the running return across masked tokens ("skip —
    # carry running_return through unchanged"), i.e. GAE's multi-turn semantics.
    assert_close(a, av, **TOL, msg="rf++ advantages")
    assert_close(r, rv, **TOL, msg="rf++ returns")


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline(seed):
    index, mask, rewards, _ = make_batch(seed, singletons=False)
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    _compare_outcome("reinforce_plus_plus_baseline", kw, kw, index, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dense", [False, True])
def test_remax(seed, dense):
    index, mask, rewards, gen = make_batch(seed, singletons=False, dense=dense)
    baselines = randn(mask.shape[0], gen=gen)
    kw = dict(token_level_rewards=rewards, reward_baselines=baselines, response_mask=mask)
    a, r = _ours("remax")(**kw)
    av, rv = _theirs("remax")(**kw)
    assert_close(a[mask], av[mask], **TOL)
    assert_close(r[mask], rv[mask], **TOL)
    assert torch.all(a[~mask] == 0) and torch.all(r[~mask] == 0)


# --------------------------------------------------------------------------- GDPO


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
@pytest.mark.parametrize("norm", [True, False])
def test_gdpo(seed, weights, norm):
    index, mask, _, gen = make_batch(seed, singletons=False)
    # verl puts each component on the last token of a contiguous response
    # (attention_mask[:, prompt_len:].sum() - 1): use gap-free right-padded masks.
    b, t = mask.shape
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    comps = torch.randint(0, 2, (b, 3), generator=gen).float() + 0.1 * randn(b, 3, gen=gen)
    keys = ["fmt", "acc", "len"]
    prompt_len = 4
    batch = {
        "prompts": torch.zeros(b, prompt_len, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, prompt_len, dtype=torch.long), mask.long()], 1),
    }
    non_tensor = {k: comps[:, i].numpy() for i, k in enumerate(keys)}
    cfg = _algo(gdpo_reward_keys=keys, gdpo_reward_weights=weights, norm_adv_by_std_in_grpo=norm)
    av, _ = _theirs("gdpo")(
        token_level_rewards=torch.zeros(b, t),
        response_mask=mask.float(),
        index=index,
        norm_adv_by_std_in_grpo=norm,
        config=cfg,
        non_tensor_batch=non_tensor,
        batch=batch,
    )
    fn = _ours("gdpo")
    a, _ = fn(
        torch.zeros(b, t),
        mask,
        index,
        reward_components=comps,
        reward_weights=weights,
        norm_adv_by_std_in_grpo=norm,
    )
    assert_close(a, av, **TOL)


# --------------------------------------------------------------------------- optimal token baseline


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("handle_zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline(seed, name, handle_zero_tail, with_is):
    index, mask, rewards, gen = make_batch(seed, singletons=False, dense=True)
    if name == "optimal_token_baseline":
        # The single-turn variant aligns time steps by position: gap-free responses.
        b, t = mask.shape
        lengths = torch.randint(1, t + 1, (b,), generator=gen)
        mask = torch.arange(t)[None, :] < lengths[:, None]
        rewards = torch.where(mask, rewards, 0.0)
    old_log_probs = -torch.rand(mask.shape, generator=gen) * 3
    sum_pi_squared = torch.exp(old_log_probs) ** 2 + torch.rand(mask.shape, generator=gen) * 0.2
    is_w = (0.5 + torch.rand(mask.shape, generator=gen)) if with_is else None
    kw = dict(
        token_level_rewards=rewards,
        response_mask=mask.float(),
        index=index,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=is_w,
        handle_zero_tail=handle_zero_tail,
    )
    av, rv = _theirs(name)(**kw)
    a, r = _ours(name)(**_rlmath_names(kw))
    assert_close(a[mask], av[mask], **TOL, msg=f"{name} advantages")
    assert_close(r[mask], rv[mask], **TOL, msg=f"{name} returns")


def _rlmath_names(kw: dict) -> dict:
    """verl's keyword ``old_log_probs`` is ``old_log_prob`` in rlmath (as everywhere else)."""
    kw = dict(kw)
    kw["old_log_prob"] = kw.pop("old_log_probs")
    return kw


# --------------------------------------------------------------------------- masked rewards


def test_outcome_score_ignores_masked_rewards_documented_difference():
    # docs/design.md ("Conventions", masks): a masked position never influences a value. verl sums
    # token_level_rewards over every position, masked ones included.
    index, mask, rewards, _ = make_batch(11, singletons=False)
    junk = torch.where(mask, rewards, 3.0)
    kw = dict(response_mask=mask, index=index)
    clean, _ = _ours("grpo")(token_level_rewards=rewards, **kw)
    dirty, _ = _ours("grpo")(token_level_rewards=junk, **kw)
    assert torch.equal(clean, dirty)
    verl_clean, _ = verl_core.compute_grpo_outcome_advantage(rewards, mask, index)
    verl_dirty, _ = verl_core.compute_grpo_outcome_advantage(junk, mask, index)
    assert not torch.allclose(verl_clean, verl_dirty)


def test_registry_covers_verl():
    names = set(verl_core.ADV_ESTIMATOR_REGISTRY) - {"grpo_vectorized", "rloo_vectorized"}
    missing = []
    for n in sorted(names):
        try:
            rlmath.get_advantage_estimator(n)
        except (ValueError, KeyError):
            missing.append(n)
        except AttributeError:
            pytest.skip("this rlmath has no get_advantage_estimator")
    assert not missing, f"verl estimators missing from rlmath's registry: {missing}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95)])
def test_gae_fp64_tight(seed, gamma, lam):
    _, mask, rewards, gen = make_batch(seed, singletons=False, dense=True, b=6, t=40)
    rewards, values = rewards.double(), randn(*mask.shape, gen=gen, dtype=torch.float64)
    av, rv = verl_core.compute_gae_advantage_return(rewards, values, mask.double(), gamma, lam)
    a, r = _ours("gae")(rewards, values, mask, gamma, lam)
    assert a.dtype == torch.float64
    assert_close(a[mask], av[mask], rtol=1e-9, atol=1e-10)
    assert_close(r[mask], rv[mask], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline", "grpo_passk"]
)
def test_outcome_estimators_with_empty_rows(name):
    # A fully masked response (e.g. truncated to nothing) with reward 0: verl counts it
    # as a group member with score 0. docs/design.md only says its advantages are 0
    # (exactly 0 at masked positions); the other rows should still agree with verl.
    index, mask, rewards, _ = make_batch(5, singletons=False)
    mask[[0, 3]] = False
    rewards[[0, 3]] = 0.0
    kw = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    extra = {"config": _algo()} if name == "grpo_passk" else {}
    a, _ = _ours(name)(**kw)
    av, _ = _theirs(name)(**kw, **extra)
    assert torch.all(a[[0, 3]] == 0)
    assert_close(a[mask], av[mask], **TOL, msg=name)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_singletons(name):
    index, mask, rewards, gen = make_batch(9, singletons=True, dense=True)
    b, t = mask.shape
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rewards = torch.where(mask, rewards, 0.0)
    old_log_probs = -torch.rand(mask.shape, generator=gen) * 3
    spi2 = torch.exp(old_log_probs) ** 2 + 0.1
    kw = dict(
        token_level_rewards=rewards,
        response_mask=mask.float(),
        index=index,
        old_log_probs=old_log_probs,
        sum_pi_squared=spi2,
    )
    av, _ = _theirs(name)(**kw)
    a, _ = _ours(name)(**_rlmath_names(kw))
    single = singleton_rows(index)
    keep = mask & ~single[:, None]
    assert_close(a[keep], av[keep], **TOL)
    assert torch.all(a[single] == 0)  # docs/design.md: singletons give 0 (verl: the return)
