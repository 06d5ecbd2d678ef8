"""MaxRL: maximum-likelihood RL (Tajwar et al. 2026, arXiv:2602.02710).

For binary (pass/fail) rewards a prompt's success probability ``p`` is a
likelihood; maximising ``log p`` instead of ``p`` weights each prompt's
gradient by ``1/p``. With ``n`` samples of which ``K`` pass, the paper's
estimator of ``∇ log p`` averages ``∇ log π`` over the passing samples only;
with the group mean as a baseline this is the advantage

    A_i = (s_i − mean_g) / mean_g

(the GRPO advantage with the group *mean* in place of its standard
deviation), i.e. ``n/K − 1`` for a passing sample and ``−1`` for a failing
one. SkyRL ships it as ``maxrl``.
"""

from __future__ import annotations

from typing import Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range
from rlmath.advantages._common import outcome_inputs
from rlmath.advantages.groups import group_moments
from rlmath.advantages.registry import register_advantage_estimator

__all__ = ["compute_maxrl_outcome_advantage"]


@register_advantage_estimator("maxrl")
@torch.no_grad()
@threads_per_call
def compute_maxrl_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MaxRL: ``(s − mean_g) / (mean_g + ε)``, broadcast to the valid tokens.

    Meant for rewards in ``[0, 1]`` (pass/fail), where ``mean_g`` is the
    group's pass rate. Singleton groups and groups whose scores are all equal
    (every sample failed, or every one passed) get exactly 0; SkyRL gives a
    singleton its raw score.

    Args:
        token_level_rewards: Shape ``(B, T)``, floating; score = sum over valid tokens.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group (prompt) id per sample: tensor, numpy array or list of
            hashable ids; groups need not be contiguous or equal-sized.
        epsilon: ``ε`` added to the group mean (>= 0; SkyRL's default 1e-6).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 for fp64 rewards), 0 at masked positions.
    """
    eps = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    m = group_moments(x.scores, x.ids)
    # A flat group has centered == 0 exactly; its mean (possibly 0) is never divided by.
    denominator = torch.where(m.zero_std, torch.ones_like(m.mean), m.mean + eps)
    advantages = x.to_tokens(m.centered / denominator)
    return advantages, advantages
