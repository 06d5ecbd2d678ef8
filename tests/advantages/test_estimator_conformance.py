"""Every registered advantage estimator passes the same conformance matrix.

The matrix is built from the registry when the tests are collected: a newly
registered estimator is tested by every check below without an edit here
(see ``tests/advantages/conformance.py`` for the inputs and the checks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rlmath as R
from rlmath.advantages import registry
from rlmath.distributed import run_distributed
from tests.advantages import conformance as C
from tests.advantages.reference import ORACLES

NAMES = R.list_advantage_estimators()
CHECKS = {
    "contract": C.check_contract,
    "masked_junk": C.check_masked_junk,
    "dtypes": C.check_dtypes,
    "degenerate_groups": C.check_degenerate_groups,
    "group_ids": C.check_group_ids,
    "row_order": C.check_row_order,
    "empty_batch": C.check_empty_batch,
}


def test_every_registered_estimator_has_inputs():
    missing = {n: C.missing_inputs(R.get_advantage_estimator(n)) for n in NAMES}
    missing = {n: params for n, params in missing.items() if params}
    assert not missing, (
        f"no input builder for the required parameters {missing}: add one to "
        "INPUTS in tests/advantages/conformance.py"
    )


def test_every_registered_estimator_has_an_fp64_oracle():
    missing = sorted(set(NAMES) - set(ORACLES))
    assert not missing, (
        f"no fp64 oracle for {missing}: add one to ORACLES in tests/advantages/reference.py"
    )


@pytest.mark.parametrize("name", NAMES)
def test_matches_its_fp64_oracle(name):
    C.check_oracle(R.get_advantage_estimator(name), ORACLES[name], C.make_batch())


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", NAMES)
def test_conformance(name, check):
    CHECKS[check](R.get_advantage_estimator(name), C.make_batch())


def _dp_worker(names: list[str]) -> dict[tuple[str, str], tuple[torch.Tensor, ...]]:
    batch = C.make_batch()
    rank = dist.get_rank()
    return {
        (n, split): C.dp_call(R.get_advantage_estimator(n), batch, rank, dist.group.WORLD, split)
        for n in names
        for split in C.DP_SPLITS
    }


@pytest.fixture(scope="module")
def dp_outputs():
    """Every estimator on two gloo ranks, whole groups per rank (one spawn for all)."""
    return run_distributed(_dp_worker, 2, NAMES)


@pytest.mark.integration
@pytest.mark.parametrize("split", C.DP_SPLITS)
@pytest.mark.parametrize("name", NAMES)
def test_data_parallel_invariance(name, split, dp_outputs):
    per_rank = [out[name, split] for out in dp_outputs]
    C.check_dp_invariance(R.get_advantage_estimator(name), C.make_batch(), per_rank, split)


# ------------------------------------------------- the checks catch broken estimators


def _grpo(token_level_rewards, response_mask, index):
    return R.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)


def _leaks_masked(token_level_rewards, response_mask, index):
    adv, ret = _grpo(token_level_rewards, response_mask, index)
    return adv + 0 * token_level_rewards.sum(), ret  # NaN/inf anywhere reaches every output


def _low_precision_math(token_level_rewards, response_mask, index):
    adv, ret = _grpo(token_level_rewards.to(torch.bfloat16).float(), response_mask, index)
    return adv.to(torch.bfloat16).float(), ret


def _divides_by_zero_std(token_level_rewards, response_mask, index):
    _, ret = _grpo(token_level_rewards, response_mask, index)
    scores = torch.where(response_mask, token_level_rewards, 0).sum(-1)
    ids = torch.as_tensor(C.relabelled_indices(torch.as_tensor(index))["sparse int64"])
    std = torch.stack([scores[ids == g].std(unbiased=False) for g in ids]) if len(ids) else scores
    return torch.where(response_mask, (scores / std)[:, None], 0), ret


def _negative_ids_as_padding(token_level_rewards, response_mask, index):
    adv, ret = _grpo(token_level_rewards, response_mask, index)
    if isinstance(index, torch.Tensor):  # a negative id taken for a padding row
        adv = torch.where((index >= 0)[:, None], adv, 0)
    return adv, ret


def _groups_as_contiguous_runs(token_level_rewards, response_mask, index):
    ids = torch.as_tensor(index)
    runs = torch.cat([ids.new_zeros(1), (ids[1:] != ids[:-1]).long()]).cumsum(0)
    return _grpo(token_level_rewards, response_mask, runs)


def _local_batch_whitening(token_level_rewards, response_mask, index):
    adv, ret = _grpo(token_level_rewards, response_mask, index)
    return R.masked_whiten(adv, response_mask), ret


BROKEN = {
    "masked_junk": _leaks_masked,
    "dtypes": _low_precision_math,
    "degenerate_groups": _divides_by_zero_std,
    "group_ids": _negative_ids_as_padding,
    "row_order": _groups_as_contiguous_runs,
}


@pytest.mark.parametrize("check", list(BROKEN))
def test_each_check_fails_on_a_broken_estimator(check):
    with pytest.raises(AssertionError):
        CHECKS[check](BROKEN[check], C.make_batch())
    CHECKS[check](_grpo, C.make_batch())  # the correct estimator passes the same check


def test_dp_check_fails_without_a_group():
    batch = C.make_batch()
    per_rank = [C.dp_call(_local_batch_whitening, batch, r, None) for r in range(2)]
    with pytest.raises(AssertionError):
        C.check_dp_invariance(_local_batch_whitening, batch, per_rank)


def test_a_new_estimator_without_input_builders_is_reported():
    def needs_critic(token_level_rewards, response_mask, critic_scores, gamma=1.0):
        return token_level_rewards, token_level_rewards

    try:
        R.register_advantage_estimator("test_needs_critic")(needs_critic)
        assert "test_needs_critic" in R.list_advantage_estimators()
        assert C.missing_inputs(R.get_advantage_estimator("test_needs_critic")) == ["critic_scores"]
    finally:
        registry._REGISTRY.pop("test_needs_critic", None)


def test_oracle_check_fails_on_a_wrong_formula():
    def biased_std(token_level_rewards, response_mask, index):  # population std instead
        scores = torch.where(response_mask, token_level_rewards, 0).sum(-1)
        ids = torch.as_tensor(index)
        adv = torch.zeros_like(scores)
        for g in ids.unique():
            members = ids == g
            s = scores[members]
            if members.sum() > 1 and s.std() > 0:
                adv[members] = (s - s.mean()) / (s.std(unbiased=False) + 1e-6)
        out = torch.where(response_mask, adv[:, None], 0)
        return out, out

    with pytest.raises(AssertionError):
        C.check_oracle(biased_std, ORACLES["grpo"], C.make_batch())
    C.check_oracle(_grpo, ORACLES["grpo"], C.make_batch())
