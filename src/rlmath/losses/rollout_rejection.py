"""Rejection of rollout tokens or sequences whose trainer/rollout mismatch is too large.

The rollout engine samples with log-probs ``log μ`` that differ from the
trainer's ``log π_old`` for the same weights. :func:`rlmath.rollout_correction`
reweights by ``π_old/μ``; this module instead *removes* tokens (or whole
sequences) from the loss mask when an estimate of the divergence between the
two policies is too large — a hard trust region (Liu et al. 2025, "When speed
kills stability", https://richardli.xyz/rl-collapse). It covers every
rejection criterion of verl's ``rollout_rs`` option.

With the per-token log-ratio ``δ = clamp(log π_old − log μ, ±log_ratio_clamp)``
and ``r = e^δ = π_old/μ``, three per-token statistics estimate KL(μ‖π_old)
from the rollout's samples (Schulman 2020, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html):

* ``k1 = −δ = log(μ/π_old)`` (unbiased, signed);
* ``k2 = δ²/2`` (≥ 0);
* ``k3 = r − 1 − log r = expm1(δ) − δ`` (unbiased, ≥ 0).

A *criterion* is ``<level>_<statistic>`` with level

* ``token``: each valid token is judged on its own statistic;
* ``seq_sum`` / ``seq_mean``: a sequence is judged on the sum / mean of its
  valid tokens' statistics (all its tokens are kept or rejected together);
* ``seq_max``: on the largest one (``k2`` and ``k3`` only: the maximum of a
  signed statistic is not a divergence).

Thresholds (every bound inclusive, as in verl):

* ``k1`` criteria bound a **ratio** ``μ/π_old`` (its product over the sequence
  for ``seq_sum``, its geometric mean for ``seq_mean``): ``(lower, upper)``
  keeps ``log lower ≤ k1 ≤ log upper``; a single number ``u`` means
  ``(1/u, u)``. Note the direction: ``k1`` is ``log μ/π_old``, the inverse of
  the importance weight of :func:`rlmath.rollout_correction`.
* ``k2`` / ``k3`` criteria take one upper bound ``u > 0``: keep ``stat ≤ u``.

Several criteria are chained: a token survives only if every criterion keeps
it. A NaN statistic on a valid token fails every comparison, so that token is
rejected (its NaN still shows in the metrics). Everything is detached and
computed on the device with no host synchronisation; metrics are 0-d tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from rlmath._validation import (
    check_choice,
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
)
from rlmath.masked import masked_mean, masked_sum

__all__ = [
    "ROLLOUT_REJECTION_OPTIONS",
    "RolloutRejection",
    "rollout_rejection",
    "rollout_rejection_bounds",
    "rollout_rejection_statistic",
]

#: Every criterion name (verl 0.9.1's ``rollout_rs`` options).
ROLLOUT_REJECTION_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)

Threshold = float | tuple[float, float]


class RolloutRejection(NamedTuple):
    """What :func:`rollout_rejection` returns.

    ``response_mask``: the input mask with every rejected position set to 0
    (same dtype and shape). ``keep``: bool ``(*, T)``, True on valid tokens
    that every criterion keeps. ``statistics``: per criterion, the statistic
    it judged: ``(*, T)`` for token criteria (0 at masked positions), ``(*,)``
    for sequence criteria (0 for sequences without valid tokens).
    ``rejected``: per criterion, bool ``(*, T)``: the valid tokens that this
    criterion alone rejects. ``metrics``: dict of detached 0-d tensors.
    """

    response_mask: torch.Tensor
    keep: torch.Tensor
    statistics: dict[str, torch.Tensor]
    rejected: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor]


def _split(option: str) -> tuple[str, str]:
    level, estimator = option.rsplit("_", 1)
    return level, estimator


def rollout_rejection_bounds(option: str, threshold: object) -> tuple[float | None, float]:
    """The validated ``(lower, upper)`` bounds of one criterion.

    ``lower`` is None for ``k2``/``k3`` criteria. For ``k1`` criteria the
    bounds are on the ratio ``μ/π_old`` (not its log): a number ``u`` gives
    ``(1/u, u)``, a pair ``(l, u)`` needs ``0 < l ≤ u``.
    """
    check_choice("criterion", option, ROLLOUT_REJECTION_OPTIONS)
    if _split(option)[1] == "k1":
        if isinstance(threshold, (tuple, list)):
            if len(threshold) != 2:
                raise ValueError(
                    f"the threshold of {option!r} must be a number or a (lower, upper) pair, "
                    f"got {threshold!r}"
                )
            lower = check_in_range(
                f"lower bound of {option!r}", threshold[0], 0.0, None, low_inclusive=False
            )
            upper = check_in_range(
                f"upper bound of {option!r}", threshold[1], 0.0, None, low_inclusive=False
            )
        else:
            upper = check_in_range(
                f"threshold of {option!r}", threshold, 0.0, None, low_inclusive=False
            )
            lower = 1.0 / upper
        if lower > upper:
            raise ValueError(
                f"the bounds of {option!r} must satisfy lower <= upper, got lower={lower:g}, "
                f"upper={upper:g} (a single number u means (1/u, u), so it must be >= 1)"
            )
        return lower, upper
    if isinstance(threshold, (tuple, list)):
        raise ValueError(
            f"{option!r} takes a single upper bound (its statistic is >= 0), got {threshold!r}"
        )
    return None, check_in_range(
        f"threshold of {option!r}", threshold, 0.0, None, low_inclusive=False
    )


def _masked_extreme(x: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    fill = -torch.inf if largest else torch.inf
    picked = torch.where(valid, x, fill)
    top = picked.max() if largest else picked.min()
    return torch.where(valid.any(), top, torch.zeros_like(top))


def _prepare(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    log_ratio_clamp: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("old_log_prob", old_log_prob, floating=True)
    check_tensor("rollout_log_prob", rollout_log_prob, floating=True)
    check_same_shape("rollout_log_prob", rollout_log_prob, "old_log_prob", old_log_prob)
    check_mask("response_mask", response_mask, "old_log_prob", old_log_prob)
    if old_log_prob.dim() == 0:
        raise ValueError("old_log_prob must have at least one dimension (tokens), got a 0-d tensor")
    check_in_range("log_ratio_clamp", log_ratio_clamp, 0.0, None, low_inclusive=False)
    dtype = result_dtype(old_log_prob, rollout_log_prob)
    valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    old = torch.where(valid, old_log_prob.detach().to(dtype), 0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(dtype), 0)
    return (old - rollout).clamp(-log_ratio_clamp, log_ratio_clamp), valid


def _token_statistic(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio


def _statistic(
    log_ratio: torch.Tensor, valid: torch.Tensor, response_mask: torch.Tensor, option: str
) -> torch.Tensor:
    level, estimator = _split(option)
    token = torch.where(valid, _token_statistic(log_ratio, estimator), 0)
    if level == "token":
        return token
    if level == "seq_sum":
        return masked_sum(token, response_mask, axis=-1)
    if level == "seq_mean":
        return masked_mean(token, response_mask, axis=-1)
    return _masked_extreme_rows(token, valid)


def _masked_extreme_rows(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    top = torch.where(valid, x, -torch.inf).amax(dim=-1)
    return torch.where(valid.any(dim=-1), top, torch.zeros_like(top))


def rollout_rejection_statistic(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    criterion: str,
    *,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """The statistic one criterion judges (module docstring).

    Shapes: inputs ``(*, T)``; result ``(*, T)`` for token criteria (0 at
    masked positions), ``(*,)`` for sequence criteria (0 for sequences with
    no valid token). Dtype fp32 (fp64 for fp64 inputs). Detached.
    """
    check_choice("criterion", criterion, ROLLOUT_REJECTION_OPTIONS)
    log_ratio, valid = _prepare(old_log_prob, rollout_log_prob, response_mask, log_ratio_clamp)
    return _statistic(log_ratio, valid, response_mask, criterion)


def rollout_rejection(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    criteria: Mapping[str, Threshold],
    log_ratio_clamp: float = 20.0,
) -> RolloutRejection:
    """Remove from the mask the tokens or sequences that fail a divergence criterion.

    Args:
        old_log_prob: the trainer's log-probs of the sampled tokens (log π_old).
            Shape ``(*, T)`` (usually ``(B, T)``), float.
        rollout_log_prob: the rollout engine's log-probs of the same tokens
            (log μ). Shape ``(*, T)``, float.
        response_mask: bool or 0/1, shape ``(*, T)``; masked positions never
            influence anything (NaN there is ignored) and stay masked.
        criteria: ``{criterion: threshold}``, e.g.
            ``{"token_k1": (0.5, 2.0), "seq_max_k3": 3.0}``; criteria and
            thresholds as in the module docstring (:data:`ROLLOUT_REJECTION_OPTIONS`).
        log_ratio_clamp: the per-token log-ratio is clamped to ±this first.

    Returns:
        :class:`RolloutRejection`. Metrics (0-d tensors; "units" are valid
        tokens for token criteria and sequences with a valid token for
        sequence criteria): ``<criterion>_mean`` / ``_max`` (of the statistic
        over its units), ``<criterion>_masked_fraction`` (valid tokens this
        criterion rejects), ``masked_fraction`` (valid tokens rejected by any
        criterion) and ``seq_masked_fraction`` (sequences with a valid token
        that lost at least one).
    """
    if not isinstance(criteria, Mapping) or not criteria:
        raise TypeError(
            "criteria must be a non-empty mapping {criterion: threshold}, e.g. "
            "{'token_k1': (0.5, 2.0)}; got " + repr(criteria)
        )
    bounds = {option: rollout_rejection_bounds(option, t) for option, t in criteria.items()}
    log_ratio, valid = _prepare(old_log_prob, rollout_log_prob, response_mask, log_ratio_clamp)
    dtype = log_ratio.dtype
    seq_valid = valid.any(dim=-1)
    statistics: dict[str, torch.Tensor] = {}
    rejected: dict[str, torch.Tensor] = {}
    metrics: dict[str, torch.Tensor] = {}
    any_rejected = torch.zeros_like(valid)
    for option, (lower, upper) in bounds.items():
        stat = _statistic(log_ratio, valid, response_mask, option)
        if lower is not None:
            passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            passed = stat <= upper
        is_token = _split(option)[0] == "token"
        units = valid if is_token else seq_valid
        rej = valid & ~(passed if is_token else passed.unsqueeze(-1))
        statistics[option] = stat
        rejected[option] = rej
        any_rejected = any_rejected | rej
        metrics[f"{option}_mean"] = masked_mean(stat, units)
        metrics[f"{option}_max"] = _masked_extreme(stat, units, largest=True)
        metrics[f"{option}_masked_fraction"] = masked_mean(rej.to(dtype), response_mask)
    keep = valid & ~any_rejected
    metrics["masked_fraction"] = masked_mean(any_rejected.to(dtype), response_mask)
    metrics["seq_masked_fraction"] = masked_mean(any_rejected.any(dim=-1).to(dtype), seq_valid)
    out_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    return RolloutRejection(
        out_mask, keep, statistics, rejected, {k: v.detach() for k, v in metrics.items()}
    )
