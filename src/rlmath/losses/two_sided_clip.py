"""Two-sided ratio clipping, INTELLECT-2's GRPO loss (Prime Intellect 2025, https://arxiv.org/abs/2505.07291, §4.1).

PPO's clip leaves a negative-advantage token whose ratio exploded with an
unbounded loss ``−r·A``. INTELLECT-2 bounds the ratio from above by ``δ``
before the min (TRL's ``delta``, Liger's chunked GRPO loss):

    l = −min(min(r, δ)·A, clip(r, 1 − ε_low, 1 + ε_high)·A),     δ > 1 + ε_high

For ``A > 0`` the bound never binds (the clipped term is the smaller one
beyond ``1 + ε_high < δ``); for ``A < 0`` and ``r > δ`` the loss is the
constant ``−δ·A`` with no gradient. That is exactly the dual clip of Ye et
al. (2020) with ``c = δ``, so this loss is ``vanilla`` with
``clip_ratio_c=delta`` and TRL's validation of ``δ``; the equality is what
the fp64 reference (written as the min above) checks.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range
from rlmath.losses._policy_inputs import clip_bounds
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.ppo_clip import compute_policy_loss_vanilla
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_two_sided_clip"]


@register_policy_loss("two_sided_clip")
def compute_policy_loss_two_sided_clip(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    delta: float = 4.0,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """INTELLECT-2's two-sided clipped loss.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``delta`` (δ, INTELLECT-2's 4.0) is the upper bound of the ratio and must
    exceed ``1 + clip_ratio_high``. ``pg_clipfrac_lower`` is the fraction of
    tokens (A < 0) whose ratio exceeded δ.
    """
    _, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    delta = check_in_range("delta", delta, 1.0 + high, None, low_inclusive=False)
    return compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=delta, rollout_is_weights=rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp, **aggregation,
    )  # fmt: skip
