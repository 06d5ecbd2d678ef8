"""Filter rollout tokens by the *probability* difference between trainer and rollout engine.

:func:`rlmath.rollout_correction` and :func:`rlmath.rollout_rejection` judge
the mismatch between the trainer's ``π_old`` and the rollout engine's ``μ``
by their ratio. A ratio is large for a token both find unlikely
(``1e-6`` vs ``1e-5``), which matters little; ROLL's train/infer filters
(``TrainInferFilterConfig``, ``diff_enabled``) also bound the absolute
difference of probabilities, which flags only tokens whose probability
really moved:

    d_t = π_old(y_t) − μ(y_t)

at one of four levels: ``token`` (``d_t``), ``geometric`` (the mean of
``d_t`` over the sequence's valid tokens, ROLL's name), ``sequence`` (their
sum) or ``segment`` (the mean over each run of consecutive valid tokens, one
turn). A token (or its whole sequence or segment) is kept when
``low ≤ d ≤ high`` (both inclusive; ROLL's defaults ``−0.2, 0.2``).
Probabilities come from log-probs clamped at 0. Everything is detached and
computed on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlmath._validation import (
    check_choice,
    check_finite_scalar,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.losses.rollout_correction import _segment_means, segment_labels

__all__ = ["ROLLOUT_PROB_DIFF_LEVELS", "RolloutProbDiffFilter", "rollout_prob_diff_filter"]

#: Accepted values of ``level``.
ROLLOUT_PROB_DIFF_LEVELS: tuple[str, ...] = ("token", "geometric", "sequence", "segment")


class RolloutProbDiffFilter(NamedTuple):
    """What :func:`rollout_prob_diff_filter` returns.

    ``response_mask``: the input mask with rejected positions set to 0 (same
    dtype). ``keep``: bool ``(*, T)``, the valid tokens kept. ``statistic``:
    ``(*, T)``, the level's difference at each valid token (0 elsewhere).
    ``metrics``: detached 0-d ``prob_diff_mean`` / ``prob_diff_abs_max``
    (over valid tokens, of the level's statistic) and ``masked_fraction``.
    """

    response_mask: torch.Tensor
    keep: torch.Tensor
    statistic: torch.Tensor
    metrics: dict[str, torch.Tensor]


def rollout_prob_diff_filter(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    low: float = -0.2,
    high: float = 0.2,
) -> RolloutProbDiffFilter:
    """Reject tokens whose ``π_old − μ`` leaves ``[low, high]`` (module docstring).

    Args:
        old_log_prob: the trainer's log-probs (log π_old), ``(*, T)`` float.
        rollout_log_prob: the rollout engine's log-probs (log μ), same shape.
        response_mask: bool or 0/1 (or weights), same shape; masked positions
            are never read and stay masked.
        level: one of :data:`ROLLOUT_PROB_DIFF_LEVELS`.
        low, high: finite bounds, ``low <= high``.
    """
    check_tensor("old_log_prob", old_log_prob, floating=True)
    check_tensor("rollout_log_prob", rollout_log_prob, floating=True)
    check_same_shape("rollout_log_prob", rollout_log_prob, "old_log_prob", old_log_prob)
    check_mask("response_mask", response_mask, "old_log_prob", old_log_prob)
    if old_log_prob.dim() == 0:
        raise ValueError("old_log_prob must have at least one dimension (tokens), got a 0-d tensor")
    check_choice("level", level, ROLLOUT_PROB_DIFF_LEVELS)
    lo = check_finite_scalar("low", low)
    hi = check_finite_scalar("high", high)
    if lo > hi:
        raise ValueError(f"low must be <= high, got low={lo}, high={hi}")
    dtype = result_dtype(old_log_prob, rollout_log_prob)
    valid = valid_mask(response_mask)
    weight = torch.where(valid, response_mask.to(dtype), 0)
    old = torch.where(valid, old_log_prob.detach().to(dtype), 0).clamp(max=0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(dtype), 0).clamp(max=0)
    diff = torch.where(valid, torch.exp(old) - torch.exp(rollout), 0)
    if level == "token":
        stat = diff
    elif level == "segment":
        stat, _ = _segment_means(diff, weight, segment_labels(valid))
    else:
        total = (diff * weight).sum(-1, keepdim=True)
        count = weight.sum(-1, keepdim=True)
        per_row = total if level == "sequence" else total / torch.where(count > 0, count, 1)
        stat = per_row.expand_as(diff)
    stat = torch.where(valid, stat, 0)
    # Written as "not outside" so that a NaN statistic is rejected (it fails both bounds).
    keep = valid & (stat >= lo) & (stat <= hi)
    out_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    n = weight.sum()
    denominator = torch.where(n > 0, n, 1)
    abs_stat = torch.where(valid, stat.abs(), 0)
    metrics = {
        "prob_diff_mean": (stat * weight).sum() / denominator,
        "prob_diff_abs_max": abs_stat.amax() if abs_stat.numel() else n * 0,
        "masked_fraction": ((valid & ~keep).to(dtype) * weight).sum() / denominator,
    }
    return RolloutProbDiffFilter(out_mask, keep, stat, {k: v.detach() for k, v in metrics.items()})
