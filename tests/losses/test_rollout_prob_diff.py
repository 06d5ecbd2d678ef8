"""The probability-difference filter (ROLL's diff filters) against loops, by hand, with junk."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import rollout_prob_diff_filter

from ..host_sync import forbid_host_reads
from .test_rollout_correction import _batch

LEVELS = ("token", "geometric", "sequence", "segment")


def test_worked_example():
    # π_old = (0.5, 0.9, ·, 0.2), μ = (0.2, 0.85, ·, 0.2): d = (0.3, 0.05, ·, 0).
    old = torch.log(torch.tensor([[0.5, 0.9, 0.7, 0.2]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.2, 0.85, 1e-9, 0.2]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False, True]])
    token = rollout_prob_diff_filter(old, rollout, mask)  # [−0.2, 0.2]: the 0.3 is out
    assert token.keep.tolist() == [[False, True, False, True]]
    assert token.metrics["masked_fraction"].item() == pytest.approx(1 / 3)
    # geometric: mean 0.35/3 ≈ 0.117 in range; sequence: sum 0.35 out, the whole row.
    assert rollout_prob_diff_filter(old, rollout, mask, level="geometric").keep.sum() == 3
    assert rollout_prob_diff_filter(old, rollout, mask, level="sequence").keep.sum() == 0
    # segment: turn 1 (0.3, 0.05) has mean 0.175: kept; turn 2 (0) kept.
    seg = rollout_prob_diff_filter(old, rollout, mask, level="segment", high=0.17)
    assert seg.keep.tolist() == [[False, False, False, True]]
    torch.testing.assert_close(seg.statistic[0, :2], torch.full((2,), 0.175, dtype=torch.float64))


def _reference(old, rollout, mask, level, low, high):
    b, t = mask.shape
    keep = torch.zeros_like(mask)
    for i in range(b):
        cols = [j for j in range(t) if mask[i, j]]
        d = {j: math.exp(min(float(old[i, j]), 0)) - math.exp(min(float(rollout[i, j]), 0))
             for j in cols}  # fmt: skip
        for j in cols:
            if level == "token":
                x = d[j]
            elif level == "sequence":
                x = sum(d.values())
            elif level == "geometric":
                x = sum(d.values()) / len(d)
            else:
                start, end = j, j
                while start > 0 and mask[i, start - 1]:
                    start -= 1
                while end + 1 < t and mask[i, end + 1]:
                    end += 1
                x = sum(d[k] for k in range(start, end + 1)) / (end - start + 1)
            keep[i, j] = low <= x <= high
    return keep


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("low", "high"), [(-0.2, 0.2), (-0.05, 0.1), (0.0, 0.0)])
def test_matches_reference(level, low, high):
    old, rollout, mask = _batch(21, b=7, t=10, scale=0.8)
    got = rollout_prob_diff_filter(old, rollout, mask, level=level, low=low, high=high)
    want = _reference(old, rollout, mask, level, low, high)
    assert torch.equal(got.keep, want)
    assert torch.equal(got.response_mask, mask & want)


@given(
    level=st.sampled_from(LEVELS),
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    seed=st.integers(0, 1000),
)
def test_masked_values_never_leak(level, garbage, seed):
    old, rollout, mask = _batch(seed)
    a = rollout_prob_diff_filter(old, rollout, mask, level=level)
    b = rollout_prob_diff_filter(
        torch.where(mask, old, garbage), torch.where(mask, rollout, -garbage), mask, level=level
    )
    assert torch.equal(a.keep, b.keep) and torch.equal(a.statistic, b.statistic)
    for k in a.metrics:
        assert torch.equal(a.metrics[k], b.metrics[k])


def test_empty_low_precision_no_sync_and_bad_input():
    for shape in ((0, 3), (2, 0)):
        z = torch.zeros(shape)
        out = rollout_prob_diff_filter(z, z, torch.ones(shape, dtype=torch.bool), level="segment")
        assert out.keep.shape == shape and all(v.item() == 0 for v in out.metrics.values())
    old, rollout, mask = _batch(3)
    low = rollout_prob_diff_filter(old.bfloat16(), rollout.bfloat16(), mask)
    wide = rollout_prob_diff_filter(old.bfloat16().double(), rollout.bfloat16().double(), mask)
    assert low.statistic.dtype == torch.float32
    # exp of bf16-exact inputs in fp32: within 2 fp32 roundings of the fp64 difference.
    torch.testing.assert_close(low.statistic.double(), wide.statistic, rtol=0, atol=3e-7)
    with forbid_host_reads():
        for level in LEVELS:
            rollout_prob_diff_filter(old.float(), rollout.float(), mask, level=level)
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="level"):
        rollout_prob_diff_filter(x, x, m, level="seq")
    with pytest.raises(ValueError, match="low must be <= high"):
        rollout_prob_diff_filter(x, x, m, low=0.3, high=0.1)
    with pytest.raises(ValueError, match="high"):
        rollout_prob_diff_filter(x, x, m, high=float("nan"))
    with pytest.raises(ValueError, match="rollout_log_prob"):
        rollout_prob_diff_filter(x, torch.zeros(3, 2), m)
