"""The base of every policy loss: input checks, masked inputs, clamped ratios, metrics.

Every policy loss starts from :func:`prepare_policy_inputs`, which checks its
tensors once and replaces whatever sits under ``response_mask == 0`` (NaN,
inf, garbage) by 0 with ``torch.where`` before any arithmetic, so masked
positions can never reach a value, a metric or a gradient. The log-ratio
``log π − log π_old`` is clamped to ``±log_ratio_clamp`` (default 20) in fp32
before ``exp`` (like verl). After that the loss trusts its inputs: means over
the valid tokens are :meth:`PolicyInputs.mean` (no second check of the mask)
and the reduction is :func:`rlmath.losses.aggregation.aggregate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlmath._valid_select import where_valid
from rlmath._validation import (
    as_dtype,
    check_choice,
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.losses.aggregation import LOSS_AGG_MODES, Aggregation, aggregate

__all__ = [
    "PolicyInputs",
    "check_clip_range",
    "check_loss_args",
    "clip_bounds",
    "policy_metrics",
    "prepare_policy_inputs",
]


@dataclass(frozen=True)
class PolicyInputs:
    """Masked, dtype-converted inputs of a policy loss (all of shape ``(B, T)``).

    ``old_log_prob``, ``log_prob``, ``advantages`` and ``is_weights`` are 0 where
    the mask is 0; ``log_ratio`` is their difference before clamping and
    ``clamped_log_ratio``/``ratio`` the clamped log-ratio and its exp.
    ``weights`` are the mask's weights in the compute dtype (0 where not valid):
    ``mask_weights``, or for a bool mask (``bool_mask``, ``mask_weights`` None)
    1 where valid, formed on first use.
    """

    valid: torch.Tensor
    mask: torch.Tensor
    mask_weights: torch.Tensor | None
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    is_weights: torch.Tensor | None
    log_ratio: torch.Tensor
    clamped_log_ratio: torch.Tensor
    ratio: torch.Tensor
    clamped: torch.Tensor
    bool_mask: bool = False
    # Values computed on first use and kept (a plain dict rather than
    # ``functools.cached_property``, whose lock ``torch.compile`` cannot trace).
    _cache: dict[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def weights(self) -> torch.Tensor:
        """The mask's weights in the compute dtype, 0 where not valid (1 where valid for a bool mask)."""
        if self.mask_weights is not None:
            return self.mask_weights
        if "weights" not in self._cache:
            self._cache["weights"] = self.valid.to(self.log_ratio.dtype)
        return self._cache["weights"]

    def zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=self.log_ratio.dtype, device=self.log_ratio.device)

    @property
    def _count(self) -> torch.Tensor:
        """``Σ w`` over every valid token, 1 where there is none: the denominator of a mean."""
        if "count" not in self._cache:
            if self.bool_mask:
                count = self.valid.sum().clamp_min(1).to(self.log_ratio.dtype)  # an exact count
            else:
                den = self.weights.sum()
                count = torch.where(den == 0, torch.ones_like(den), den)
            self._cache["count"] = count
        return self._cache["count"]

    def mean(self, x: torch.Tensor, axis: int | None = None) -> torch.Tensor:
        """Weighted mean of ``x`` over the valid tokens (of each row with ``axis=-1``); 0 if none.

        ``x`` has the inputs' shape; values under the mask never count.
        """
        dtype = self.log_ratio.dtype
        if axis is None:
            if self.bool_mask:
                if x.dtype == torch.bool:
                    return torch.count_nonzero(x & self.valid) / self._count
                return where_valid(self.valid, as_dtype(x, dtype)).sum() / self._count
            return (where_valid(self.valid, as_dtype(x, dtype)) * self.weights).sum() / self._count
        w = self.weights
        v = torch.where(self.valid, as_dtype(x, w.dtype), 0) * w
        num, den = v.sum(axis), w.sum(axis)
        return num / torch.where(den == 0, torch.ones_like(den), den)

    def mean_of_masked(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`mean` of an ``x`` that is already 0 (False) wherever the mask is 0."""
        if not self.bool_mask:
            return self.mean(x)
        if x.dtype == torch.bool:
            return torch.count_nonzero(x) / self._count
        return as_dtype(x, self.log_ratio.dtype).sum() / self._count

    def frac(self, condition: torch.Tensor) -> torch.Tensor:
        """Fraction of valid tokens where ``condition`` holds (mask weights respected)."""
        return self.mean(condition).detach()

    def apply_is_weights(self, loss_mat: torch.Tensor) -> torch.Tensor:
        return loss_mat if self.is_weights is None else loss_mat * self.is_weights

    def aggregate(
        self, loss_mat: torch.Tensor, loss_agg_mode: str, agg: Aggregation, *, masked: bool = False
    ) -> torch.Tensor:
        """``loss_mat`` (importance weights applied) reduced by ``loss_agg_mode``.

        ``masked``: ``loss_mat`` is already ±0 wherever the mask is 0 (a loss
        built from the masked inputs by products and selections only), so the
        token mean skips selecting it again (a sum of ±0 terms adds nothing).
        """
        if (
            loss_agg_mode == "token-mean"
            and agg.global_num_tokens is None
            and agg.dp_size == 1
            and self.bool_mask
        ):
            # aggregate's token mean, sharing the count of valid tokens with the metrics.
            loss_mat = self.apply_is_weights(loss_mat)
            if not masked:
                loss_mat = where_valid(self.valid, loss_mat)
            return loss_mat.sum() / self._count
        return aggregate(
            self.apply_is_weights(loss_mat),
            self.valid,
            None if self.bool_mask else self.weights,
            loss_agg_mode,
            agg,
        )


def prepare_policy_inputs(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    log_ratio_clamp: float = 20.0,
    old_name: str = "old_log_prob",
) -> PolicyInputs:
    """Check shapes/dtypes and mask the inputs of a policy loss.

    Shapes: every tensor ``(B, T)`` (any shape with tokens last works).
    The compute dtype is fp32, or fp64 when any of the three float inputs is
    fp64. ``rollout_is_weights`` are detached: importance weights change the
    measure, never the objective's gradient path.
    """
    check_tensor(old_name, old_log_prob, floating=True)
    check_tensor("log_prob", log_prob, floating=True)
    check_tensor("advantages", advantages, floating=True)
    check_same_shape(old_name, old_log_prob, "log_prob", log_prob)
    check_same_shape("advantages", advantages, "log_prob", log_prob)
    check_mask("response_mask", response_mask, "log_prob", log_prob)
    if log_prob.dim() == 0:
        raise ValueError("log_prob must have at least one dimension (tokens), got a 0-d tensor")
    log_ratio_clamp = check_in_range(
        "log_ratio_clamp", log_ratio_clamp, 0.0, None, low_inclusive=False
    )
    dtype = result_dtype(old_log_prob, log_prob, advantages)
    valid = valid_mask(response_mask)
    old = where_valid(valid, as_dtype(old_log_prob.detach(), dtype))
    logp = where_valid(valid, as_dtype(log_prob, dtype))
    adv = where_valid(valid, as_dtype(advantages.detach(), dtype))
    isw = None
    if rollout_is_weights is not None:
        check_tensor("rollout_is_weights", rollout_is_weights, floating=True)
        check_same_shape("rollout_is_weights", rollout_is_weights, "log_prob", log_prob)
        isw = where_valid(valid, as_dtype(rollout_is_weights.detach(), dtype))
    log_ratio = logp - old
    clamped_log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    clamped = log_ratio.detach().abs() > log_ratio_clamp
    bool_mask = response_mask.dtype == torch.bool
    return PolicyInputs(
        valid=valid,
        mask=response_mask,
        mask_weights=None if bool_mask else where_valid(valid, response_mask.to(dtype)),
        old_log_prob=old,
        log_prob=logp,
        advantages=adv,
        is_weights=isw,
        log_ratio=log_ratio,
        clamped_log_ratio=clamped_log_ratio,
        ratio=torch.exp(clamped_log_ratio),
        clamped=clamped,
        bool_mask=bool_mask,
    )


def check_loss_args(loss_agg_mode: object, aggregation: Mapping[str, Any]) -> Aggregation:
    """A policy loss's ``loss_agg_mode`` and aggregation keywords, checked once."""
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    return Aggregation.of(aggregation)


def check_clip_range(name: str, value: object) -> float:
    """A clip range ε is a finite number >= 0."""
    return check_in_range(name, value, 0.0, None)


def clip_bounds(
    clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None
) -> tuple[float, float]:
    """``(ε_low, ε_high)``: the asymmetric ranges, each defaulting to ``clip_ratio``.

    Every range must be >= 0, so the band ``[1 − ε_low, 1 + ε_high]`` is never
    inverted; ``ε_low >= 1`` leaves no lower bound on the ratio.
    """
    check_clip_range("clip_ratio", clip_ratio)
    low = check_clip_range(
        "clip_ratio_low", clip_ratio if clip_ratio_low is None else clip_ratio_low
    )
    high = check_clip_range(
        "clip_ratio_high", clip_ratio if clip_ratio_high is None else clip_ratio_high
    )
    return low, high


def policy_metrics(
    inp: PolicyInputs,
    *,
    clipped_high: torch.Tensor | None = None,
    clipped_low: torch.Tensor | None = None,
    clipped_lower: torch.Tensor | None = None,
    masked: bool = False,
) -> dict[str, torch.Tensor]:
    """The metrics every policy loss returns, as detached 0-d tensors.

    * ``pg_clipfrac_high`` / ``pg_clipfrac_low``: fraction of valid tokens
      whose gradient the upper (A > 0) / lower (A < 0) clip removed;
      ``pg_clipfrac`` is their sum (sign-aware: a token outside the band whose
      advantage sign makes the unclipped term the active one is not counted).
    * ``pg_clipfrac_lower``: fraction cut by the dual clip (A < 0, ratio > c)
      or, for DPPO, by the ratio truncation (verl's name).
    * ``ppo_kl``: masked mean of ``log π_old − log π`` (clamped, like verl).
    * ``log_ratio_clamped_frac``: fraction of valid tokens whose log-ratio
      exceeded ``±log_ratio_clamp``.

    ``masked``: the three conditions are already False wherever the mask is 0
    (conditions on the masked advantages' sign are).
    """
    ppo_kl = inp.mean_of_masked(inp.clamped_log_ratio.detach().neg())
    if (
        masked
        and inp.bool_mask
        and clipped_high is not None
        and clipped_low is not None
        and clipped_lower is not None
    ):
        # Four exact counts of valid tokens in one reduction, one division.
        conditions = torch.stack([clipped_high, clipped_low, clipped_lower, inp.clamped])
        counts = torch.count_nonzero(conditions.reshape(4, -1), dim=1)
        high, low, lower, clamped = (counts / inp._count).unbind()
        return {
            "pg_clipfrac": high + low,
            "pg_clipfrac_high": high,
            "pg_clipfrac_low": low,
            "pg_clipfrac_lower": lower,
            "ppo_kl": ppo_kl,
            "log_ratio_clamped_frac": clamped,
        }
    frac = inp.mean_of_masked if masked else inp.mean
    zero = inp.zero() if None in (clipped_high, clipped_low, clipped_lower) else None

    def of(condition: torch.Tensor | None) -> torch.Tensor:
        if condition is None:
            assert zero is not None
            return zero
        return frac(condition).detach()

    high, low = of(clipped_high), of(clipped_low)
    # The clamped log-ratio is 0, and the clamp flag False, wherever the mask is 0.
    return {
        "pg_clipfrac": high + low,
        "pg_clipfrac_high": high,
        "pg_clipfrac_low": low,
        "pg_clipfrac_lower": of(clipped_lower),
        "ppo_kl": ppo_kl,
        "log_ratio_clamped_frac": inp.mean_of_masked(inp.clamped),
    }
