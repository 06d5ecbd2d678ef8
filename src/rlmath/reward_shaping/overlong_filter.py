"""Overlong filtering: truncated responses leave the loss (DAPO §3.4; TRL, NeMo-RL).

A response cut at the length limit has a reward that says nothing about its
reasoning (it never answered). DAPO masks such samples out of the loss
instead of penalising them; TRL's ``mask_truncated_completions`` and
NeMo-RL's ``overlong_filtering`` do the same. Here the truncated rows'
mask is zeroed and their rewards, now masked, read 0.
"""

from __future__ import annotations

import torch

from rlmath.reward_shaping._common import (
    RewardShaping,
    check_truncated,
    row_fraction,
    shaping_inputs,
)
from rlmath.reward_shaping.registry import register_reward_shaping

__all__ = ["overlong_filter"]


@register_reward_shaping("overlong_filter")
def overlong_filter(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    truncated: torch.Tensor | None = None,
) -> RewardShaping:
    """Drop truncated responses from the mask.

    Args:
        token_level_rewards: ``(B, T)`` float.
        response_mask: bool or 0/1 ``(B, T)``.
        truncated: bool ``(B,)``, required: True where generation hit the
            length limit.

    Returns:
        :class:`RewardShaping` with the truncated rows masked; metric
        ``truncated_frac`` (truncated rows / rows).
    """
    x = shaping_inputs(token_level_rewards, response_mask)
    cut = check_truncated(truncated, x.rewards.shape[0], x.rewards.device)
    keep = x.valid & ~cut.unsqueeze(-1)
    mask = torch.where(keep, response_mask, torch.zeros_like(response_mask))
    rewards = torch.where(keep, x.rewards, 0)
    metrics = {"truncated_frac": row_fraction(cut, x.dtype).detach()}
    return RewardShaping(rewards, mask, metrics)
