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
@pytest.mark.parametrize("level", ["token", "sequence", "geometric", "segment"])
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
        assert value.shape == () and value.item() == (name == "batch_norm_factor"), name
    loss, _ = compute_policy_loss_reinforce(old, rollout, old, out_mask, rollout_is_weights=weights)
    assert loss.item() == 0.0


def _segment_ref(old, rollout, mask):
    """Per token: exp(mean log-ratio over its run of consecutive valid tokens)."""
    b, t = mask.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        j = 0
        while j < t:
            if not mask[i, j]:
                j += 1
                continue
            end = j
            while end < t and mask[i, end]:
                end += 1
            lr = [float(old[i, k] - rollout[i, k]) for k in range(j, end)]
            for k in range(j, end):
                out[i, k] = math.exp(sum(lr) / len(lr))
            j = end
    return out


def test_segment_level_by_hand():
    # One row, two turns around a masked tool output: log-ratios (0.2, 0.4 | junk | −0.3).
    # Turn 1 gets exp(0.3), turn 2 exp(−0.3); with threshold_high 1.2 (mask mode, lower
    # 1/1.2) turn 1 (1.35) is rejected as a whole and turn 2 (0.74) too, below 0.83.
    old = torch.tensor([[-1.0, -1.0, 50.0, -1.0]], dtype=torch.float64)
    rollout = old - torch.tensor([[0.2, 0.4, 0.0, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, True]])
    res = rollout_correction(old, rollout, mask, level="segment", threshold_high=10.0)
    e = math.exp(0.3)
    torch.testing.assert_close(res.weights, torch.tensor([[e, e, 0, 1 / e]], dtype=torch.float64))
    assert res.metrics["log_ratio_mean"].item() == pytest.approx(0.0)  # two segments: ±0.3
    res = rollout_correction(old, rollout, mask, level="segment", mode="mask", threshold_high=1.2)
    assert res.response_mask.tolist() == [[False, False, False, False]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("low", "high"), [(None, 2.0), (0.8, 1.2)])
def test_segment_level_matches_reference(mode, low, high):
    old, rollout, mask = _batch(11, b=6, t=12)
    res = rollout_correction(
        old, rollout, mask, level="segment", mode=mode, threshold_low=low, threshold_high=high
    )
    raw = _segment_ref(old, rollout, mask)
    if mode == "mask" and low is None:
        low = 1 / high
    inside = (raw >= (low or 0)) & (raw <= high)
    if mode == "truncate":
        want = raw.clamp(min=low, max=high) * mask
        assert torch.equal(res.response_mask, mask)
    else:
        want = torch.where(inside & mask, raw, 0)
        assert torch.equal(res.response_mask, mask & inside)
    torch.testing.assert_close(res.weights, want, rtol=1e-12, atol=1e-12)
    # A response of one segment gets the geometric level's weight.
    full = torch.ones_like(mask)
    seg = rollout_correction(old, rollout, full, level="segment", threshold_high=1e9)
    geo = rollout_correction(old, rollout, full, level="geometric", threshold_high=1e9)
    torch.testing.assert_close(seg.weights, geo.weights, rtol=1e-13, atol=0)


def test_chi2_metrics():
    old, rollout, mask = _batch(12)
    res = rollout_correction(old, rollout, mask)
    lr = old - rollout
    token = (lr[mask].exp() ** 2).mean() - 1
    rows = [lr[i][mask[i]].sum() for i in range(mask.shape[0]) if mask[i].any()]
    seq = torch.stack([(2 * r).exp() for r in rows]).mean() - 1
    assert res.metrics["chi2_token"].item() == pytest.approx(token.item(), rel=1e-12)
    assert res.metrics["chi2_seq"].item() == pytest.approx(seq.item(), rel=1e-12)
    assert res.metrics["batch_norm_factor"].item() == 1.0


def _unit_mean_ref(weights, mask, level):
    units = []
    for i in range(mask.shape[0]):
        cols = [j for j in range(mask.shape[1]) if mask[i, j]]
        if not cols:
            continue
        if level == "token":
            units += [float(weights[i, j]) for j in cols]
        elif level in ("sequence", "geometric"):
            units.append(sum(float(weights[i, j]) for j in cols) / len(cols))
        else:  # one unit per run; its weight is constant along it
            units += [float(weights[i, j]) for j in cols if j == 0 or not mask[i, j - 1]]
    return sum(units) / len(units)


@pytest.mark.parametrize("level", [*LEVELS, "segment"])
@pytest.mark.parametrize("mode", MODES)
def test_batch_normalize(level, mode):
    old, rollout, mask = _batch(13, b=7, t=9)
    plain = rollout_correction(old, rollout, mask, level=level, mode=mode, threshold_high=1.5)
    res = rollout_correction(
        old, rollout, mask, level=level, mode=mode, threshold_high=1.5, batch_normalize=True
    )
    mean = _unit_mean_ref(plain.weights, mask, level)
    assert res.metrics["batch_norm_factor"].item() == pytest.approx(mean, rel=1e-12)
    torch.testing.assert_close(res.weights, plain.weights / mean, rtol=1e-12, atol=0)
    assert _unit_mean_ref(res.weights, mask, level) == pytest.approx(1.0, rel=1e-12)
    for key in ("weight_mean", "ess", "fraction_high"):  # metrics of the weights before
        assert torch.equal(res.metrics[key], plain.metrics[key])


def _dp_normalize_worker(seed):
    import torch.distributed as dist

    old, rollout, mask = _batch(seed, b=8, t=9)
    rank = dist.get_rank()
    rows = slice(0, 3) if rank == 0 else slice(3, 8)
    kw = {"threshold_high": 1.5, "batch_normalize": True, "group": dist.group.WORLD}
    return {
        level: rollout_correction(old[rows], rollout[rows], mask[rows], level=level, **kw).weights
        for level in (*LEVELS, "segment")
    }


@pytest.mark.integration
def test_batch_normalize_over_two_gloo_ranks():
    from rlmath.distributed import run_distributed

    results = run_distributed(_dp_normalize_worker, 2, 14)
    old, rollout, mask = _batch(14, b=8, t=9)
    for level in (*LEVELS, "segment"):
        whole = rollout_correction(
            old, rollout, mask, level=level, threshold_high=1.5, batch_normalize=True
        ).weights
        got = torch.cat([results[0][level], results[1][level]])
        torch.testing.assert_close(got, whole, rtol=1e-12, atol=0)


def test_sampler_matched_log_probs_remove_the_truncation_bias():
    """A rollout that sampled from vLLM's top-p kept set reports log-probs renormalised over it.
    Trainer log-probs over the full vocabulary make every ratio the kept mass (the mismatch KL
    is then the mean of ``-log mass``); with the same sampler arguments the weights are 1."""
    from rlmath import log_probs_from_logits
    from tests.logprobs.sampling_reference import reference

    B, T, V = 3, 5, 40
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B * T, V, generator=gen, dtype=torch.float64) * 2
    *_, kept = reference(logits, torch.zeros(B * T, dtype=torch.long), top_p=0.8)
    # The sampled token: one of each row's kept set.
    pick = torch.multinomial(kept.double(), 1, generator=gen).squeeze(-1)
    rollout, *_ = reference(logits, pick, top_p=0.8)
    mask = torch.ones(B, T, dtype=torch.bool)
    full = log_probs_from_logits(logits, pick)
    matched = log_probs_from_logits(logits, pick, top_p=0.8)
    mass = torch.logsumexp(logits.masked_fill(~kept, -math.inf), -1) - torch.logsumexp(logits, -1)
    assert bool((mass < -1e-3).all())  # the truncation cuts mass in every row
    shape = (B, T)
    out = rollout_correction(full.view(shape), rollout.view(shape), mask)
    assert abs(float(out.metrics["mismatch_kl_k1"]) - float(-mass.mean())) < 1e-12
    torch.testing.assert_close(out.weights.view(-1), mass.exp(), rtol=1e-12, atol=0)
    out = rollout_correction(matched.view(shape), rollout.view(shape), mask)
    assert abs(float(out.metrics["mismatch_kl_k1"])) < 1e-12
    torch.testing.assert_close(
        out.weights, torch.ones(shape, dtype=torch.float64), rtol=1e-12, atol=0
    )
