"""Advantage estimators that whiten over the batch, with the batch split over data-parallel ranks.

With ``group=`` the whitened advantages on each rank equal the single-process
estimator's on the concatenated batch (gloo, 2 processes; rank 1 also runs a
case where it holds no valid token). Without ``group`` each rank whitens only
its own rows, which differs: the test checks that too, so it cannot pass by
accident.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlmath.advantages import (
    compute_gae_advantage_return,
    compute_gdpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
)
from rlmath.distributed import run_distributed

SPLIT = 3  # rank 0 holds rows [0, 3), rank 1 rows [3, 8)
INDEX = [0, 0, 0, 1, 1, 2, 2, 2]  # prompt groups never straddle the two ranks


def batch(empty_rank1: bool):
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(8, 7, generator=g, dtype=torch.float64)
    values = torch.randn(8, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(8, 7, generator=g) < 0.7
    mask[:, 0] = True
    if empty_rank1:
        mask[SPLIT:] = False
    components = torch.randn(8, 2, generator=g, dtype=torch.float64)
    return rewards, values, mask, components


def estimators(rows: slice, empty_rank1: bool, group) -> dict[str, torch.Tensor]:
    rewards, values, mask, components = batch(empty_rank1)
    r, v, m = rewards[rows], values[rows], mask[rows]
    index = INDEX[rows]
    out = {
        "gae": compute_gae_advantage_return(r, v, m, 0.9, 0.8, group=group)[0],
        "reinforce_pp": compute_reinforce_plus_plus_outcome_advantage(
            r, m, gamma=0.95, group=group
        )[0],
    }
    if not empty_rank1:
        out["reinforce_pp_baseline"] = compute_reinforce_plus_plus_baseline_outcome_advantage(
            r, m, index, group=group
        )[0]
        out["gdpo"] = compute_gdpo_outcome_advantage(
            r, m, index, reward_components=components[rows], group=group
        )[0]
    return out


def whitening_worker() -> dict:
    rank = dist.get_rank()
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, 8)
    return {
        "global": estimators(rows, False, dist.group.WORLD),
        "global_empty_rank1": estimators(rows, True, dist.group.WORLD),
        "local": estimators(rows, False, None),
    }


@pytest.mark.integration
def test_whitening_over_the_group_equals_single_process():
    results = run_distributed(whitening_worker, 2)
    rows = [slice(0, SPLIT), slice(SPLIT, 8)]
    for key, empty in (("global", False), ("global_empty_rank1", True)):
        expected = estimators(slice(0, 8), empty, None)
        for name, want in expected.items():
            got = torch.cat([results[r][key][name] for r in range(2)])
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{key} {name}")
            assert torch.isfinite(got).all()
    # Without a group each rank whitens its own rows: different numbers.
    expected = estimators(slice(0, 8), False, None)
    for name, want in expected.items():
        got = torch.cat([results[r]["local"][name] for r in range(2)])
        assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3), name
        for r in range(2):
            assert torch.equal(results[r]["local"][name], estimators(rows[r], False, None)[name])
