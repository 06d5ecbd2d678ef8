"""OPO: on-policy RL with the optimal (length-weighted) baseline.

Hao et al., 2025, arXiv:2505.23585.
"""

from __future__ import annotations

from typing import Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range
from rlmath.advantages._common import outcome_inputs, valid_counts
from rlmath.advantages.groups import group_moments, segment_sum, to_samples
from rlmath.advantages.registry import register_advantage_estimator

__all__ = ["compute_opo_outcome_advantage"]


@register_advantage_estimator("opo")
@torch.no_grad()
@threads_per_call
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s_i − b_g`` with the length-weighted baseline ``b_g = Σ l_j s_j / Σ l_j``.

    ``l_j`` is the number of valid tokens of response ``j``; the sums run over
    the group. Singleton and all-equal groups give exactly 0; a group whose
    responses are all empty has baseline 0 (and its outputs are masked anyway).

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
    s, ids = x.scores, x.ids
    length = valid_counts(x.valid).to(s.dtype)
    weighted = to_samples(segment_sum(length * s, ids), ids)
    total = to_samples(segment_sum(length, ids), ids)
    baseline = weighted / torch.where(total > 0, total, 1)
    scalar = torch.where(group_moments(s, ids).zero_std, 0, s - baseline)
    advantages = x.to_tokens(scalar)
    return advantages, advantages
