"""rollout_correction against per-token / per-sequence references in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from rlmath import compute_policy_loss_reinforce, rollout_correction

from .helpers import ragged_mask

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")


def _batch(seed, b=5, t=6, scale=0.6):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(b, t, gen, empty_rows=(3,))
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(b, t, generator=gen, dtype=torch.float64) * scale
    return old, rollout, mask


def _ref(old, rollout, mask, level, mode, low, high):
    b, t = mask.shape
    weights = torch.zeros(b, t, dtype=torch.float64)
    keep = mask.clone()
    if mode == "mask" and low is None:
        low = 1 / high
    for i in range(b):
        cols = [j for j in range(t) if mask[i, j]]
        if not cols:
            continue
        lrs = [float(old[i, j] - rollout[i, j]) for j in cols]
        for j, lr in zip(cols, lrs):
            if level == "token":
                x = lr
            elif level == "sequence":
                x = sum(lrs)
            else:
                x = sum(lrs) / len(lrs)
            w = math.exp(max(-20.0, min(20.0, x)))
            if mode == "truncate":
                weights[i, j] = min(w, high) if low is None else min(max(w, low), high)
            elif low <= w <= high:
                weights[i, j] = w
            else:
                keep[i, j] = False
    return weights, keep


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("low", "high"), [(None, 2.0), (0.5, 1.5), (0.9, 1.1)])
def test_weights_and_mask_match_reference(level, mode, low, high):
    old, rollout, mask = _batch(1)
    res = rollout_correction(
        old, rollout, mask, level=level, mode=mode, threshold_low=low, threshold_high=high
    )
    w, keep = _ref(old, rollout, mask, level, mode, low, high)
    torch.testing.assert_close(res.weights, w, rtol=1e-12, atol=1e-12)
    assert torch.equal(res.response_mask, keep if mode == "mask" else mask)
    assert res.response_mask.dtype == mask.dtype
    assert not res.weights.requires_grad


def test_metrics():
    old, rollout, mask = _batch(2)
    res = rollout_correction(old, rollout, mask, level="token", mode="truncate", threshold_high=1.5)
    valid = mask
    lr = (old - rollout)[valid]
    w = res.weights[valid]
    m = res.metrics
    assert all(v.dim() == 0 for v in m.values())
    assert m["log_ratio_mean"].item() == pytest.approx(lr.mean().item())
    assert m["log_ratio_max"].item() == pytest.approx(lr.max().item())
    assert m["mismatch_kl_k1"].item() == pytest.approx((-lr).mean().item())
    assert m["mismatch_kl_k3"].item() == pytest.approx((lr.exp() - 1 - lr).mean().item())
    assert m["mismatch_kl_k3"].item() >= 0
    assert m["weight_mean"].item() == pytest.approx(w.mean().item())
    assert m["weight_max"].item() == pytest.approx(w.max().item())
    assert m["ess"].item() == pytest.approx((w.sum() ** 2 / (len(w) * (w**2).sum())).item())
    assert m["fraction_truncated"].item() == pytest.approx((lr.exp() > 1.5).double().mean().item())
    assert m["fraction_masked"].item() == 0.0


def test_sequence_metrics_count_sequences_not_tokens():
    old, rollout, mask = _batch(3)
    res = rollout_correction(old, rollout, mask, level="sequence")
    seq = [(old - rollout)[i][mask[i]].sum().item() for i in range(mask.shape[0]) if mask[i].any()]
    assert res.metrics["log_ratio_mean"].item() == pytest.approx(sum(seq) / len(seq))
    assert res.metrics["log_ratio_max"].item() == pytest.approx(max(seq))


def test_identical_policies_give_unit_weights():
    old, _, mask = _batch(4)
    for level in LEVELS:
        res = rollout_correction(old, old, mask, level=level, mode="mask")
        assert torch.equal(res.weights, mask.double())
        assert res.metrics["ess"].item() == pytest.approx(1.0)
        assert res.metrics["mismatch_kl_k3"].item() == 0.0


def test_geometric_level_is_length_invariant():
    """Duplicating a sequence to twice its length does not change its decision or weight."""
    old, rollout, mask = _batch(5, b=6, t=5, scale=0.3)
    old2, rollout2, mask2 = (torch.cat([x, x], dim=1) for x in (old, rollout, mask))
    for mode in MODES:
        a = rollout_correction(old, rollout, mask, level="geometric", mode=mode, threshold_high=1.1)
        b = rollout_correction(
            old2, rollout2, mask2, level="geometric", mode=mode, threshold_high=1.1
        )
        torch.testing.assert_close(b.weights[:, :5], a.weights, rtol=1e-12, atol=1e-12)
        assert torch.equal(b.response_mask[:, :5], a.response_mask)
    # The sequence level is not: the product of ratios squares.
    s1 = rollout_correction(old, rollout, mask, level="sequence", threshold_high=1e9)
    s2 = rollout_correction(old2, rollout2, mask2, level="sequence", threshold_high=1e9)
    torch.testing.assert_close(s2.weights[:, :5], s1.weights**2, rtol=1e-10, atol=1e-12)


def test_huge_log_ratios_stay_finite():
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1e4, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for level in LEVELS:
        for mode in MODES:
            res = rollout_correction(old, rollout, mask, level=level, mode=mode)
            assert torch.isfinite(res.weights).all()
            assert all(torch.isfinite(v) for v in res.metrics.values())


def test_weights_plug_into_a_loss():
    old, rollout, mask = _batch(6)
    logp = old.clone().requires_grad_()
    adv = torch.ones_like(old)
    res = rollout_correction(old, rollout, mask, mode="mask", threshold_high=1.3)
    loss, _ = compute_policy_loss_reinforce(
        rollout,
        logp,
        adv,
        res.response_mask,
        rollout_is_weights=res.weights,
        loss_agg_mode="token-sum",
    )
    loss.backward()
    torch.testing.assert_close(logp.grad, -res.weights * res.response_mask)


def test_bad_input():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="level"):
        rollout_correction(x, x, m, level="seq")
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(x, x, m, mode="clip")
    with pytest.raises(ValueError, match="threshold_high"):
        rollout_correction(x, x, m, threshold_high=0.0)
    with pytest.raises(ValueError, match="threshold_low"):
        rollout_correction(x, x, m, threshold_low=-1.0)
    with pytest.raises(ValueError, match="threshold_low must be < threshold_high"):
        rollout_correction(x, x, m, threshold_low=3.0, threshold_high=2.0)
    with pytest.raises(ValueError, match="threshold_high must be > 1"):
        rollout_correction(x, x, m, mode="mask", threshold_high=0.5)
    with pytest.raises(ValueError, match="rollout_log_prob"):
        rollout_correction(x, torch.zeros(3, 2), m)
    with pytest.raises(ValueError, match="response_mask"):
        rollout_correction(x, x, torch.ones(2, 2))


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_empty_batch(shape, level, mode):
    """An empty micro-batch (B = 0, or T = 0) gives empty weights and 0 metrics, like the losses."""
    old = torch.zeros(shape, dtype=torch.float64)
    rollout = torch.zeros(shape, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    weights, out_mask, metrics = rollout_correction(old, rollout, mask, level=level, mode=mode)
    assert weights.shape == shape and weights.dtype == torch.float64
    assert out_mask.shape == shape and out_mask.dtype == torch.bool
    for name, value in metrics.items():
        assert value.shape == () and value.item() == 0.0, name
    loss, _ = compute_policy_loss_reinforce(old, rollout, old, out_mask, rollout_is_weights=weights)
    assert loss.item() == 0.0
