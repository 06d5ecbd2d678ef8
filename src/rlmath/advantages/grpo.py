"""GRPO (Shao et al., 2024, arXiv:2402.03300), Dr.GRPO and GRPO pass@k.

Outcome supervision: a response's score is the sum of its valid token
rewards, and its advantage compares the score with the other responses to the
same prompt (same group id), broadcast to every valid token.
"""

from __future__ import annotations

from typing import Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range
from rlmath.advantages._common import outcome_inputs
from rlmath.advantages.groups import group_moments, segment_reduce, segment_sum, to_samples
from rlmath.advantages.registry import register_advantage_estimator

__all__ = ["compute_grpo_outcome_advantage", "compute_grpo_passk_outcome_advantage"]


@register_advantage_estimator("grpo")
@register_advantage_estimator("grpo_vectorized")
@torch.no_grad()
@threads_per_call
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``(s − mean_g) / (std_g + ε)``; Dr.GRPO: ``s − mean_g``.

    ``std_g`` is the unbiased standard deviation of the group's scores. With
    ``norm_adv_by_std_in_grpo=False`` the advantage is not scaled, as in
    Dr.GRPO (Liu et al., 2025, arXiv:2503.20783). Singleton groups and groups
    whose scores are all equal get exactly 0 (verl gives a singleton its raw
    score).

    Args:
        token_level_rewards: Shape ``(B, T)``, floating; score = sum over valid tokens.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group (prompt) id per sample: tensor, numpy array or list of
            hashable ids; groups need not be contiguous or equal-sized.
        epsilon: ``ε`` added to the std.
        norm_adv_by_std_in_grpo: Divide by ``std_g + ε`` (GRPO) or not (Dr.GRPO).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice (as verl),
        fp32 (fp64 for fp64 rewards), 0 at masked positions.
    """
    eps = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    m = group_moments(x.scores, x.ids)
    # A flat group (singletons too) has centered scores and std of exactly 0:
    # its advantage is 0 for any epsilon, including 0 (not 0 / 0).
    scalar = (
        torch.where(m.zero_std, 0, m.centered / (m.std + eps))
        if norm_adv_by_std_in_grpo
        else m.centered
    )
    advantages = x.to_tokens(scalar)
    return advantages, advantages


@register_advantage_estimator("grpo_passk")
@torch.no_grad()
@threads_per_call
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (arXiv:2503.19595): only the best response of a group counts.

    In each group the response with the highest score gets
    ``s_max − s_second`` (divided by ``std_g + ε`` when
    ``norm_adv_by_std_in_grpo``); every other response gets 0. When the top
    score is shared the gap is 0, so ties give 0 to everyone. Singletons give 0
    (verl raises for groups of fewer than 2).

    Args: as :func:`compute_grpo_outcome_advantage` (verl reads
    ``norm_adv_by_std_in_grpo`` from its config; here it is a keyword).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 for fp64 rewards), 0 at masked positions.
    """
    eps = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    s, ids = x.scores, x.ids
    m = group_moments(s, ids)
    top = to_samples(segment_reduce(s, ids, "amax"), ids)
    is_top = s == top
    n_top = to_samples(segment_sum(is_top.to(s.dtype), ids), ids)
    runner_up = to_samples(segment_reduce(torch.where(is_top, -torch.inf, s), ids, "amax"), ids)
    unique_top = is_top & (n_top == 1) & ~m.zero_std
    gap = torch.where(unique_top, top - runner_up, 0)
    scalar = torch.where(m.zero_std, 0, gap / (m.std + eps)) if norm_adv_by_std_in_grpo else gap
    advantages = x.to_tokens(scalar)
    return advantages, advantages
