"""RLOO: REINFORCE leave-one-out (Ahmadian et al., 2024, arXiv:2402.14740)."""

from __future__ import annotations

from typing import Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range
from rlmath.advantages._common import outcome_inputs
from rlmath.advantages.groups import group_moments
from rlmath.advantages.registry import register_advantage_estimator

__all__ = ["compute_rloo_outcome_advantage"]


@register_advantage_estimator("rloo")
@register_advantage_estimator("rloo_vectorized")
@torch.no_grad()
@threads_per_call
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s_i − mean of the other scores of the group`` = ``n/(n−1) · (s_i − mean_g)``.

    Singleton groups (no other sample) and all-equal groups give exactly 0.

    Args:
        token_level_rewards: Shape ``(B, T)``, floating; score = sum over valid tokens.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group id per sample (tensor, numpy array or list of hashable ids).
        epsilon: Unused; kept for verl's signature.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 for fp64 rewards), 0 at masked positions.
    """
    epsilon = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    m = group_moments(x.scores, x.ids)
    scalar = m.centered * m.size / (m.size - 1).clamp(min=1)
    advantages = x.to_tokens(scalar)
    return advantages, advantages
