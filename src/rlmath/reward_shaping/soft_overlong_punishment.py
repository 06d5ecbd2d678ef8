"""DAPO's soft overlong punishment (Yu et al. 2025, https://arxiv.org/abs/2503.14476, eq. 13).

A response truncated at the length limit gets no useful reward signal and
teaches the policy nothing; DAPO instead penalises length smoothly in a
buffer of ``L_cache`` tokens before the limit ``L_max``:

    R_length(y) = 0                                  |y| ≤ L_max − L_cache
                = ((L_max − L_cache) − |y|) / L_cache   L_max − L_cache < |y| ≤ L_max
                = −1                                 |y| > L_max

times ``penalty_factor``, added to the response's reward. Written here as
``−factor · clamp((|y| − (L_max − L_cache)) / L_cache, 0, 1)``, which is the
paper's (and TRL's ``get_soft_overlong_punishment``) for every ``|y|``, and
OpenRLHF's ``apply_overlong_penalty``. verl's ``DAPORewardManager`` and AReaL
use the same line without the floor at ``−factor``: they differ only for
``|y| > L_max``, which a generator capped at ``L_max`` never produces.
"""

from __future__ import annotations

import torch

from rlmath._validation import check_in_range, check_int, check_tensor
from rlmath.reward_shaping._common import (
    RewardShaping,
    last_valid,
    row_fraction,
    shaping_inputs,
)
from rlmath.reward_shaping.registry import register_reward_shaping

__all__ = ["soft_overlong_punishment"]


@register_reward_shaping("soft_overlong_punishment")
def soft_overlong_punishment(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    max_response_length: int,
    overlong_buffer_length: int,
    penalty_factor: float = 1.0,
    response_length: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
) -> RewardShaping:
    """Add DAPO's length penalty to each response's reward, on its last valid token.

    Args:
        token_level_rewards: ``(B, T)`` float; a response's reward is the sum
            of its valid tokens' (the outcome estimators' score).
        response_mask: bool or 0/1 ``(B, T)``; returned unchanged.
        max_response_length: ``L_max``, an int >= 1.
        overlong_buffer_length: ``L_cache``, an int in ``[1, L_max]``.
        penalty_factor: the penalty at (and beyond) ``L_max``, >= 0 (verl's
            ``overlong_buffer.penalty_factor``).
        response_length: ``(B,)`` lengths ``|y|`` when they are not the
            number of valid tokens (e.g. tool outputs masked out of a
            multi-turn response but counted towards the limit).
        truncated: unused (the common signature).

    Returns:
        :class:`RewardShaping`; metrics ``overlong_penalty_mean`` (over rows)
        and ``overlong_frac`` (rows with a penalty).
    """
    del truncated
    x = shaping_inputs(token_level_rewards, response_mask)
    l_max = check_int("max_response_length", max_response_length, 1)
    buffer = check_int("overlong_buffer_length", overlong_buffer_length, 1, l_max)
    factor = check_in_range("penalty_factor", penalty_factor, 0.0, None)
    lengths = x.lengths
    if response_length is not None:
        check_tensor("response_length", response_length, real=True)
        if response_length.shape != lengths.shape:
            raise ValueError(
                f"response_length must have shape {tuple(lengths.shape)}, "
                f"got {tuple(response_length.shape)}"
            )
        lengths = response_length.to(lengths.device)
    excess = (lengths.to(x.dtype) - (l_max - buffer)) / buffer
    penalty = -factor * excess.clamp(0, 1)
    rewards = x.rewards + torch.where(last_valid(x.valid), penalty.unsqueeze(-1), 0)
    metrics = {
        "overlong_penalty_mean": penalty.sum() / max(penalty.numel(), 1),
        "overlong_frac": row_fraction(penalty < 0, x.dtype),
    }
    return RewardShaping(rewards, response_mask, {k: v.detach() for k, v in metrics.items()})
