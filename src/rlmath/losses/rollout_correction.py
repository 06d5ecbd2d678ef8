"""Importance-sampling correction for the training/inference mismatch.

The rollout engine (vLLM, SGLang, ...) samples with log-probs ``log μ`` that
differ from the trainer's ``log π_old`` for the same weights (kernels,
precision, MoE routing). The policy-gradient estimate then needs the weight
``π_old/μ`` (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training", https://fengyao.notion.site/off-policy-rl; Liu et al.
2025, "When speed kills stability", https://richardli.xyz/rl-collapse).
:func:`rollout_correction` computes it at one of three levels:

* ``token``: ``w_t = π_old(y_t)/μ(y_t)`` (biased, low variance);
* ``sequence``: ``w_i = Π_t π_old/μ = exp(Σ_t log-ratio)`` (unbiased, high variance);
* ``geometric``: ``w_i = exp(mean_t log-ratio)``, the per-token geometric mean:
  length-normalised, so a sequence's decision does not depend on its length.

and bounds it in one of two ways:

* ``truncate`` (TIS): ``w ← clip(w, threshold_low, threshold_high)``
  (no lower bound when ``threshold_low`` is None);
* ``mask`` (rejection, IcePop-style): tokens (or whole sequences, for the
  sequence levels) whose weight leaves ``[threshold_low, threshold_high]`` are
  removed from the returned mask and get weight 0; kept ones keep their
  weight. ``threshold_low=None`` means ``1/threshold_high`` in this mode.

Everything is detached and computed on the device; metrics are 0-d tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlmath._validation import (
    check_choice,
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)

__all__ = [
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "RolloutCorrection",
    "rollout_correction",
]

ROLLOUT_CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
ROLLOUT_CORRECTION_MODES: tuple[str, ...] = ("truncate", "mask")


class RolloutCorrection(NamedTuple):
    """What :func:`rollout_correction` returns (unpacks as a 3-tuple).

    ``weights``: detached ``(B, T)`` fp32 (fp64 for fp64 inputs), 0 at masked
    and rejected positions; pass as ``rollout_is_weights`` to a policy loss.
    ``response_mask``: the mask to train with: the input mask unchanged in
    ``truncate`` mode, with rejected positions zeroed in ``mask`` mode (same
    dtype as the input). ``metrics``: dict of detached 0-d tensors.
    """

    weights: torch.Tensor
    response_mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _mean(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, 0 where ``count`` is 0 (the total is 0 there)."""
    return total / torch.where(count == 0, torch.ones_like(count), count)


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over ``valid``; 0 when nothing is valid, including an empty tensor."""
    if x.numel() == 0:  # a shape, known on the host: max() of nothing raises
        return torch.zeros((), dtype=x.dtype, device=x.device)
    top = torch.where(valid, x, -torch.inf).max()
    return torch.where(valid.any(), top, torch.zeros_like(top))


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold_low: float | None = None,
    threshold_high: float = 2.0,
    log_ratio_clamp: float = 20.0,
) -> RolloutCorrection:
    """Importance weights ``π_old/μ`` between trainer and rollout engine, truncated or masked.

    Args:
        old_log_prob: the trainer's log-probs of the sampled tokens (log π_old).
            Shape ``(B, T)``, float.
        rollout_log_prob: the rollout engine's log-probs of the same tokens
            (log μ). Shape ``(B, T)``, float.
        response_mask: bool or 0/1, shape ``(B, T)``; masked positions never
            influence anything and get weight 0.
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (module docstring).
        mode: ``"truncate"`` or ``"mask"`` (module docstring).
        threshold_low: lower bound (> 0, < ``threshold_high``) or None.
        threshold_high: upper bound (> 0).
        log_ratio_clamp: log-ratios are clamped to ±this before ``exp``.

    Returns:
        :class:`RolloutCorrection` ``(weights, response_mask, metrics)``.
        Metrics (over valid tokens; fully masked sequences do not count):
        ``log_ratio_mean``/``log_ratio_max`` (of the level's log-ratio),
        ``mismatch_kl_k1`` (mean of ``log μ − log π_old``, an estimate of
        KL(μ‖π_old) from μ's samples), ``mismatch_kl_k3`` (mean of
        ``r − 1 − log r`` with ``r = π_old/μ``: same KL, low variance, ≥ 0),
        ``weight_mean``/``weight_max`` (of the returned weights), ``ess``
        (normalised effective sample size ``(Σw)²/(N·Σw²)`` ∈ [0, 1]),
        ``fraction_high``/``fraction_low`` (raw weight above/below the
        bounds), ``fraction_truncated`` (truncate mode) and
        ``fraction_masked`` (mask mode; the other one is 0). An empty batch
        (``B = 0`` or ``T = 0``) gives empty weights and every metric 0.
    """
    check_tensor("old_log_prob", old_log_prob, floating=True)
    check_tensor("rollout_log_prob", rollout_log_prob, floating=True)
    check_same_shape("rollout_log_prob", rollout_log_prob, "old_log_prob", old_log_prob)
    check_mask("response_mask", response_mask, "old_log_prob", old_log_prob)
    if old_log_prob.dim() == 0:
        raise ValueError("old_log_prob must have at least one dimension (tokens), got a 0-d tensor")
    check_choice("level", level, ROLLOUT_CORRECTION_LEVELS)
    check_choice("mode", mode, ROLLOUT_CORRECTION_MODES)
    high = check_in_range("threshold_high", threshold_high, 0.0, None, low_inclusive=False)
    low: float | None = None
    if threshold_low is not None:
        low = check_in_range("threshold_low", threshold_low, 0.0, None, low_inclusive=False)
        if not low < high:
            raise ValueError(
                f"threshold_low must be < threshold_high, got threshold_low={low}, "
                f"threshold_high={high}"
            )
    elif mode == "mask":
        low = 1.0 / high
        if not low < high:
            raise ValueError(
                f"threshold_high must be > 1 when threshold_low is None in mask mode "
                f"(the lower bound is 1/threshold_high), got {high}"
            )
    log_ratio_clamp = check_in_range(
        "log_ratio_clamp", log_ratio_clamp, 0.0, None, low_inclusive=False
    )

    dtype = result_dtype(old_log_prob, rollout_log_prob)
    valid = valid_mask(response_mask)
    weight = torch.where(valid, response_mask.to(dtype), 0)  # the mask's weights, 0 if masked
    old = torch.where(valid, old_log_prob.detach().to(dtype), 0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(dtype), 0)
    token_lr = old - rollout

    if level == "token":
        level_lr = unit_lr = token_lr
        unit_valid = valid
    else:
        seq_sum = (token_lr * weight).sum(-1)
        unit_lr = seq_sum if level == "sequence" else _mean(seq_sum, weight.sum(-1))
        level_lr = unit_lr.unsqueeze(-1).expand_as(token_lr)
        unit_valid = valid.any(dim=-1)
    raw = torch.exp(level_lr.clamp(-log_ratio_clamp, log_ratio_clamp))

    above = raw > high
    below = raw < low if low is not None else torch.zeros_like(above)
    if mode == "truncate":
        weights = raw.clamp(min=low, max=high)
        out_mask = response_mask
    else:
        keep = ~(above | below)
        weights = torch.where(keep, raw, 0)
        out_mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    weights = torch.where(valid, weights, 0).detach()

    zero = torch.zeros((), dtype=dtype, device=old.device)
    n = weight.sum()

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return _mean((torch.where(valid, x, 0) * weight).sum(), n)

    frac_high = token_mean(above.to(dtype))
    frac_low = token_mean(below.to(dtype))
    w_sum = (weights * weight).sum()
    w_sq = (weights.square() * weight).sum()
    ess = w_sum.square() / torch.where(w_sq > 0, n * w_sq, torch.ones_like(w_sq))
    clamped_lr = token_lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    units = unit_valid.sum().to(dtype)
    metrics = {
        "log_ratio_mean": _mean(torch.where(unit_valid, unit_lr, 0).sum(), units),
        "log_ratio_max": _masked_max(unit_lr, unit_valid),
        "mismatch_kl_k1": token_mean(-token_lr),
        "mismatch_kl_k3": token_mean(torch.expm1(clamped_lr) - clamped_lr),
        "weight_mean": token_mean(weights),
        "weight_max": _masked_max(weights, valid),
        "ess": ess,
        "fraction_high": frac_high,
        "fraction_low": frac_low,
        "fraction_truncated": frac_high + frac_low if mode == "truncate" else zero,
        "fraction_masked": frac_high + frac_low if mode == "mask" else zero,
    }
    return RolloutCorrection(weights, out_mask, {k: v.detach() for k, v in metrics.items()})
