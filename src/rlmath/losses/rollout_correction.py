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
  length-normalised, so a sequence's decision does not depend on its length;
* ``segment``: the geometric mean over each *segment*, a maximal run of
  consecutive valid tokens (one assistant turn of a multi-turn response,
  between masked tool outputs): every turn gets its own weight (ROLL's
  ``segment`` granularity).

and bounds it in one of two ways:

* ``truncate`` (TIS): ``w ← clip(w, threshold_low, threshold_high)``
  (no lower bound when ``threshold_low`` is None);
* ``mask`` (rejection, IcePop-style): tokens (or whole sequences, for the
  sequence levels) whose weight leaves ``[threshold_low, threshold_high]`` are
  removed from the returned mask and get weight 0; kept ones keep their
  weight. ``threshold_low=None`` means ``1/threshold_high`` in this mode.

``batch_normalize=True`` then rescales the weights to mean 1 over the
level's units (tokens; sequences for ``sequence``/``geometric``; segments),
over every rank of ``group`` when one is given (verl's
``rollout_is_batch_normalize``).

Everything is detached and computed on the device; metrics are 0-d tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

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

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ROLLOUT_CORRECTION_LEVELS",
    "ROLLOUT_CORRECTION_MODES",
    "RolloutCorrection",
    "rollout_correction",
    "segment_labels",
]

ROLLOUT_CORRECTION_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric", "segment")
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


def segment_labels(valid: torch.Tensor) -> torch.Tensor:
    """Each valid token's segment number in its row (1, 2, ...), 0 at masked positions.

    A segment is a maximal run of consecutive valid tokens. Shape ``(*, T)``
    in, int64 ``(*, T)`` out; computed on the device.
    """
    previous = torch.zeros_like(valid)
    previous[..., 1:] = valid[..., :-1]
    starts = valid & ~previous
    return torch.where(valid, starts.cumsum(-1), 0)


def _segment_means(
    x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per-token mean of its segment, per-slot (mean, live))`` for row-wise segment labels.

    Slot ``k`` of a row's ``(T + 1)``-wide buffer is its segment ``k``; slot 0
    collects the masked positions (weight 0) and is never live.
    """
    width = x.shape[-1] + 1
    shape = (*x.shape[:-1], width)
    sums = x.new_zeros(shape).scatter_add_(-1, labels, x * weight)
    counts = x.new_zeros(shape).scatter_add_(-1, labels, weight)
    live = counts > 0
    means = sums / torch.where(live, counts, torch.ones_like(counts))
    live[..., 0] = False
    return means.gather(-1, labels), torch.stack([means, live.to(x.dtype)])


def _all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return x
    # Imported here: single-process callers never load torch.distributed code.
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold_low: float | None = None,
    threshold_high: float = 2.0,
    batch_normalize: bool = False,
    group: ProcessGroup | None = None,
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
        level: ``"token"``, ``"sequence"``, ``"geometric"`` or ``"segment"``
            (module docstring).
        mode: ``"truncate"`` or ``"mask"`` (module docstring).
        threshold_low: lower bound (> 0, < ``threshold_high``) or None.
        threshold_high: upper bound (> 0).
        batch_normalize: rescale the returned weights to mean 1 over the
            level's units (no rescaling when that mean is <= 1e-8).
        group: ``torch.distributed`` process group over which the batch is
            split: the normalising mean is over every rank (every rank must
            call). Ignored without ``batch_normalize``.
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
        ``fraction_masked`` (mask mode; the other one is 0),
        ``chi2_token`` and ``chi2_seq`` (``E[ρ²] − 1`` of the raw token
        ratios and of the sequence products ``Π_t ρ_t``: estimates of the
        χ² divergence of π_old from μ, whose growth is what makes importance
        weights unreliable) and ``batch_norm_factor`` (the mean the weights
        were divided by; 1 without ``batch_normalize``). The weight metrics
        are those of the weights before batch normalisation (as verl). An
        empty batch (``B = 0`` or ``T = 0``) gives empty weights and every
        metric 0 (the factor 1).
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
    if not isinstance(batch_normalize, bool):
        raise TypeError(f"batch_normalize must be a bool, got {type(batch_normalize).__name__}")

    dtype = result_dtype(old_log_prob, rollout_log_prob)
    valid = valid_mask(response_mask)
    weight = torch.where(valid, response_mask.to(dtype), 0)  # the mask's weights, 0 if masked
    old = torch.where(valid, old_log_prob.detach().to(dtype), 0)
    rollout = torch.where(valid, rollout_log_prob.detach().to(dtype), 0)
    token_lr = old - rollout

    segments = None
    if level == "token":
        level_lr = unit_lr = token_lr
        unit_valid = valid
    elif level == "segment":
        segments = segment_labels(valid)
        level_lr, per_slot = _segment_means(token_lr, weight, segments)
        unit_lr, unit_valid = per_slot[0], per_slot[1] > 0
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
    live = valid.any(dim=-1)
    seq_lr = (token_lr * weight).sum(-1).clamp(-log_ratio_clamp, log_ratio_clamp)
    chi2_seq = _mean(torch.where(live, torch.exp(2 * seq_lr), 0).sum(), live.sum().to(dtype)) - 1
    factor = torch.ones((), dtype=dtype, device=old.device)
    normalized = weights
    if batch_normalize:
        factor = _unit_mean(weights, valid, weight, level, segments, group)
        ok = factor > 1e-8
        factor = torch.where(ok, factor, torch.ones_like(factor))
        normalized = (weights / factor).detach()
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
        "chi2_token": token_mean(torch.exp(2 * clamped_lr)) - (n > 0).to(dtype),
        "chi2_seq": torch.where(live.any(), chi2_seq, zero),
        "batch_norm_factor": factor,
    }
    metrics = {k: v.to(dtype).detach() for k, v in metrics.items()}
    return RolloutCorrection(normalized, out_mask, metrics)


def _unit_mean(
    weights: torch.Tensor,
    valid: torch.Tensor,
    weight: torch.Tensor,
    level: str,
    segments: torch.Tensor | None,
    group: ProcessGroup | None,
) -> torch.Tensor:
    """Mean of the weights over the level's units (of every rank of ``group``)."""
    if level == "token":
        total, count = (weights * weight).sum(), weight.sum()
    elif level == "segment":
        assert segments is not None
        _, per_slot = _segment_means(weights, weight, segments)
        total, count = (per_slot[0] * per_slot[1]).sum(), per_slot[1].sum()
    else:
        rows = weight.sum(-1)
        live = rows > 0
        per_row = (weights * weight).sum(-1) / torch.where(live, rows, torch.ones_like(rows))
        total, count = torch.where(live, per_row, 0).sum(), live.sum().to(weights.dtype)
    sums = _all_reduce_sum(torch.stack([total, count]), group)
    return _mean(sums[0], sums[1])
