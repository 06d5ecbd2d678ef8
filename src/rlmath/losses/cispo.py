"""Clipped IS-weight Policy Optimization (MiniMax-M1, https://arxiv.org/abs/2506.13585).

CISPO clips the importance weight instead of the update, and stops its gradient:

    l = −sg(clip(r, 1 − ε_low, 1 + ε_high)) · A · log π_θ

so every token keeps a gradient ``−clip(r)·A·∇log π_θ`` (PPO drops the
gradient of tokens outside the band; those are often the rare "fork" tokens
of long reasoning).

**verl vs TRL.** verl's ``cispo`` (the default here) clips on both sides with
the PPO ranges ``[1 − ε_low, 1 + ε_high]``. TRL's ``loss_type="cispo"`` (in
releases after 0.24, which has no CISPO) truncates from above only, at an
absolute cap ``epsilon_high`` (the cap itself, not ``1 + ε``):
``sg(min(r, epsilon_high))``, and raises the weight of no token.
``upper_only=True`` gives TRL's form with the cap ``1 + clip_ratio_high``, so
TRL's ``epsilon_high=E`` is ``clip_ratio_high=E − 1`` here.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath.losses._policy_inputs import (
    check_loss_args,
    clip_bounds,
    policy_metrics,
    prepare_policy_inputs,
)
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_cispo"]


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    upper_only: bool = False,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO loss (verl's two-sided definition; ``upper_only=True`` for TRL's).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`.
    Metrics: ``pg_clipfrac_high``/``pg_clipfrac_low`` are the fractions of
    tokens with ``A ≠ 0`` whose weight was truncated at ``1 + ε_high`` / raised
    to ``1 − ε_low`` (CISPO rescales these tokens' gradients, it never removes
    them); verl counts every token outside the band, whatever its advantage.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    if not isinstance(upper_only, bool):
        raise TypeError(f"upper_only must be a bool, got {type(upper_only).__name__}")
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    r = inp.ratio.detach()
    weight = r.clamp(max=1 + high) if upper_only else r.clamp(1 - low, 1 + high)
    adv = inp.advantages
    loss_mat = -weight * adv * inp.log_prob
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    active = adv != 0
    clipped_low = None if upper_only else active & (r < 1 - low)
    metrics = policy_metrics(inp, clipped_high=active & (r > 1 + high), clipped_low=clipped_low)
    return loss, metrics
