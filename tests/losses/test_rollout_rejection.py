"""rlmath.rollout_rejection: every criterion against a float64 per-token loop written from the math."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlmath
from tests.host_sync import forbid_host_reads

OPTIONS = rlmath.ROLLOUT_REJECTION_OPTIONS


def make(seed: int, b: int = 5, t: int = 7, scale: float = 0.6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    rollout = old + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0] = False  # a sequence with no valid token
    mask[1, :] = True
    return old.to(dtype), rollout.to(dtype), mask


def reference(old, rollout, mask, criteria):
    """Plain loops in Python floats (fp64): statistics, kept tokens."""
    b, t = mask.shape
    keep = [[bool(mask[i, j]) for j in range(t)] for i in range(b)]
    stats = {}
    for option, threshold in criteria.items():
        level, est = option.rsplit("_", 1)
        if est == "k1":
            lo, hi = threshold if isinstance(threshold, tuple) else (1 / threshold, threshold)
        else:
            lo, hi = None, threshold

        def tok(i, j, est=est):
            d = max(-20.0, min(20.0, float(old[i, j]) - float(rollout[i, j])))
            return {"k1": -d, "k2": 0.5 * d * d, "k3": math.expm1(d) - d}[est]

        def passes(x, lo=lo, hi=hi):
            return (math.log(lo) <= x <= math.log(hi)) if lo is not None else x <= hi

        if level == "token":
            s = [[tok(i, j) if mask[i, j] else 0.0 for j in range(t)] for i in range(b)]
            for i in range(b):
                for j in range(t):
                    if mask[i, j] and not passes(s[i][j]):
                        keep[i][j] = False
        else:
            s = []
            for i in range(b):
                vals = [tok(i, j) for j in range(t) if mask[i, j]]
                if not vals:
                    s.append(0.0)
                    continue
                v = {"seq_sum": sum(vals), "seq_mean": sum(vals) / len(vals), "seq_max": max(vals)}
                s.append(v[level])
                if not passes(s[-1]):
                    keep[i] = [False] * t
        stats[option] = torch.tensor(s, dtype=torch.float64)
    return stats, torch.tensor(keep)


CRITERIA = [
    {"token_k1": (0.6, 1.5)},
    {"token_k1": 1.4},
    {"token_k2": 0.05},
    {"token_k3": 0.05},
    {"seq_sum_k1": (0.3, 2.0)},
    {"seq_sum_k2": 0.2},
    {"seq_sum_k3": 0.2},
    {"seq_mean_k1": 1.2},
    {"seq_mean_k2": 0.08},
    {"seq_mean_k3": 0.08},
    {"seq_max_k2": 0.2},
    {"seq_max_k3": 0.2},
    {"token_k1": (0.5, 2.0), "seq_max_k3": 0.3},
    {"seq_mean_k1": (0.8, 1.3), "token_k2": 0.1, "seq_sum_k3": 0.5},
]


@pytest.mark.parametrize("criteria", CRITERIA, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_loop(criteria, seed):
    old, rollout, mask = make(seed)
    out = rlmath.rollout_rejection(old, rollout, mask, criteria=criteria)
    stats, keep = reference(old, rollout, mask, criteria)
    assert out.keep.dtype == torch.bool
    assert torch.equal(out.keep, keep)
    assert out.response_mask.dtype == mask.dtype
    assert torch.equal(out.response_mask, mask & keep)
    valid_seq = mask.any(-1)
    for option, s in stats.items():
        torch.testing.assert_close(out.statistics[option], s, rtol=1e-12, atol=1e-12)
        rejected = out.rejected[option]
        ref_units = s[mask] if option.startswith("token") else s[valid_seq]
        torch.testing.assert_close(
            out.metrics[f"{option}_mean"], ref_units.mean(), rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            out.metrics[f"{option}_max"], ref_units.max(), rtol=1e-12, atol=1e-12
        )
        assert not (rejected & ~mask).any()
        torch.testing.assert_close(
            out.metrics[f"{option}_masked_fraction"],
            rejected[mask].double().mean().to(out.metrics[f"{option}_masked_fraction"].dtype),
        )
    lost = mask & ~keep
    torch.testing.assert_close(out.metrics["masked_fraction"], lost[mask].double().mean())
    torch.testing.assert_close(
        out.metrics["seq_masked_fraction"], lost.any(-1)[valid_seq].double().mean()
    )


def test_the_criteria_reject_something_and_keep_something():
    # The thresholds above are chosen so that the loop comparison is not vacuous.
    old, rollout, mask = make(0)
    for criteria in CRITERIA:
        out = rlmath.rollout_rejection(old, rollout, mask, criteria=criteria)
        lost = mask & ~out.keep
        assert lost.any(), criteria
        assert out.keep.any(), criteria


def test_verl_mask_mode_example():
    # Sequence 0: log π_old − log μ = −1, so μ/π_old = e ≈ 2.72 > 2: rejected by token_k1
    # (0.5, 2.0). Sequence 1: −0.5 < 0 ... μ/π_old = e^-0.5 ≈ 0.61: kept.
    old = torch.full((2, 5), -2.0)
    rollout = torch.tensor([[-1.0] * 5, [-2.5] * 5])
    mask = torch.ones(2, 5)
    out = rlmath.rollout_rejection(old, rollout, mask, criteria={"token_k1": (0.5, 2.0)})
    assert torch.equal(out.response_mask, torch.tensor([[0.0] * 5, [1.0] * 5]))
    assert out.metrics["masked_fraction"] == 0.5
    assert out.metrics["seq_masked_fraction"] == 0.5


def test_k1_bounds_are_the_inverse_of_the_importance_weight_bounds():
    # token_k1 with (l, u) on μ/π_old keeps what rollout_correction's mask mode keeps with
    # importance-weight bounds (1/u, 1/l) on π_old/μ.
    old, rollout, mask = make(3, scale=0.8)
    out = rlmath.rollout_rejection(old, rollout, mask, criteria={"token_k1": (0.5, 1.6)})
    corr = rlmath.rollout_correction(
        old, rollout, mask, level="token", mode="mask", threshold_low=1 / 1.6, threshold_high=2.0
    )
    assert torch.equal(out.response_mask, corr.response_mask)
    out = rlmath.rollout_rejection(old, rollout, mask, criteria={"seq_mean_k1": (0.8, 1.25)})
    corr = rlmath.rollout_correction(
        old, rollout, mask, level="geometric", mode="mask", threshold_low=0.8, threshold_high=1.25
    )
    assert torch.equal(out.response_mask, corr.response_mask)


@settings(max_examples=25, deadline=None)
@given(
    junk=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 100.0]),
    option=st.sampled_from(OPTIONS),
    seed=st.integers(0, 10_000),
)
def test_masked_positions_change_nothing(junk, option, seed):
    old, rollout, mask = make(seed)
    threshold = (0.5, 2.0) if option.endswith("k1") else 0.2
    clean = rlmath.rollout_rejection(old, rollout, mask, criteria={option: threshold})
    dirty = rlmath.rollout_rejection(
        torch.where(mask, old, junk),
        torch.where(mask, rollout, -junk),
        mask,
        criteria={option: threshold},
    )
    assert torch.equal(clean.response_mask, dirty.response_mask)
    assert torch.equal(clean.statistics[option], dirty.statistics[option])
    for k, v in clean.metrics.items():
        assert torch.equal(v, dirty.metrics[k]), k


def test_nan_on_a_valid_token_rejects_it_and_shows_in_the_metrics():
    old, rollout, mask = make(4)
    old = old.clone()
    old[1, 2] = float("nan")
    out = rlmath.rollout_rejection(old, rollout, mask, criteria={"token_k3": 1e9})
    assert not out.keep[1, 2] and out.keep[1, 3]
    assert out.metrics["token_k3_mean"].isnan()


def test_half_precision_inputs_give_fp32_and_keep_the_mask_dtype():
    old, rollout, mask = make(5, dtype=torch.bfloat16)
    imask = mask.to(torch.int64)
    out = rlmath.rollout_rejection(old, rollout, imask, criteria={"seq_sum_k2": 0.3})
    assert out.statistics["seq_sum_k2"].dtype == torch.float32
    assert out.response_mask.dtype == torch.int64
    ref = rlmath.rollout_rejection(
        old.double(), rollout.double(), mask, criteria={"seq_sum_k2": 0.3}
    )
    torch.testing.assert_close(
        out.statistics["seq_sum_k2"].double(), ref.statistics["seq_sum_k2"], rtol=1e-6, atol=1e-6
    )


def test_empty_mask_gives_zeros_and_an_unchanged_mask():
    old, rollout, _ = make(6)
    mask = torch.zeros(old.shape, dtype=torch.bool)
    out = rlmath.rollout_rejection(
        old, rollout, mask, criteria={"token_k1": 2.0, "seq_max_k2": 0.1}
    )
    assert not out.response_mask.any()
    assert all(float(v) == 0.0 for v in out.metrics.values())


def test_inputs_are_not_modified_and_nothing_reads_the_host():
    old, rollout, mask = make(7)
    copies = [x.clone() for x in (old, rollout, mask)]
    with forbid_host_reads():
        out = rlmath.rollout_rejection(
            old, rollout, mask, criteria={"token_k1": (0.5, 2.0), "seq_max_k3": 0.3}
        )
        rlmath.rollout_rejection_statistic(old, rollout, mask, "seq_mean_k2")
    for x, c in zip((old, rollout, mask), copies):
        assert torch.equal(x, c)
    assert out.response_mask is not mask


def test_statistic_function_matches_the_result():
    old, rollout, mask = make(8)
    for option in OPTIONS:
        threshold = 2.0 if option.endswith("k1") else 0.2
        out = rlmath.rollout_rejection(old, rollout, mask, criteria={option: threshold})
        assert torch.equal(
            rlmath.rollout_rejection_statistic(old, rollout, mask, option), out.statistics[option]
        )


@pytest.mark.parametrize(
    ("criteria", "error", "match"),
    [
        ({}, TypeError, "criteria"),
        ([("token_k1", 2.0)], TypeError, "criteria"),
        ({"token_k4": 2.0}, ValueError, "token_k1"),
        ({"seq_max_k1": 2.0}, ValueError, "criterion"),
        ({"token_k1": 0.5}, ValueError, "lower <= upper"),
        ({"token_k1": (2.0, 0.5)}, ValueError, "lower <= upper"),
        ({"token_k1": (0.0, 2.0)}, ValueError, "lower bound of 'token_k1'"),
        ({"token_k1": (0.5, 1.0, 2.0)}, ValueError, "pair"),
        ({"token_k2": (0.1, 0.2)}, ValueError, "single upper bound"),
        ({"seq_sum_k3": -1.0}, ValueError, "threshold of 'seq_sum_k3'"),
        ({"seq_sum_k3": "1.0"}, TypeError, "threshold of 'seq_sum_k3'"),
    ],
)
def test_bad_criteria(criteria, error, match):
    old, rollout, mask = make(9)
    with pytest.raises(error, match=match):
        rlmath.rollout_rejection(old, rollout, mask, criteria=criteria)


def test_bad_tensors():
    old, rollout, mask = make(10)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        rlmath.rollout_rejection(old, rollout[:, :3], mask, criteria={"token_k2": 1.0})
    with pytest.raises(ValueError, match="response_mask"):
        rlmath.rollout_rejection(old, rollout, mask[:, :3], criteria={"token_k2": 1.0})
    with pytest.raises(TypeError, match="old_log_prob"):
        rlmath.rollout_rejection(old.long(), rollout, mask, criteria={"token_k2": 1.0})
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        rlmath.rollout_rejection(
            old, rollout, mask, criteria={"token_k2": 1.0}, log_ratio_clamp=0.0
        )
