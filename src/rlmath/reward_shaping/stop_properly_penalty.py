"""The stop-properly penalty: scale (or replace) the reward of truncated responses.

ProRL's recipe (Liu et al. 2025, https://arxiv.org/abs/2505.24864), shipped
by OpenRLHF (``--stop_properly_penalty_coef``) and NeMo-RL
(``stop_properly_penalty_coef``): a response that hit the length limit keeps
only a fraction of its reward,

    R ← coef · R                 (0 ≤ coef ≤ 1, both frameworks)
    R ← coef                     (coef < 0, OpenRLHF only: a fixed penalty)

Token rewards are scaled row-wise (the reward is their sum); a replaced
reward is put on the row's last valid token, the others set to 0.
"""

from __future__ import annotations

import torch

from rlmath._validation import check_in_range
from rlmath.reward_shaping._common import (
    RewardShaping,
    check_truncated,
    last_valid,
    row_fraction,
    shaping_inputs,
)
from rlmath.reward_shaping.registry import register_reward_shaping

__all__ = ["stop_properly_penalty"]


@register_reward_shaping("stop_properly_penalty")
def stop_properly_penalty(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    stop_properly_penalty_coef: float,
    truncated: torch.Tensor | None = None,
) -> RewardShaping:
    """Scale the rewards of truncated rows by ``coef`` in ``[0, 1]``, or set them to ``coef < 0``.

    Args:
        token_level_rewards: ``(B, T)`` float.
        response_mask: bool or 0/1 ``(B, T)``; returned unchanged.
        stop_properly_penalty_coef: finite, at most 1.
        truncated: bool ``(B,)``, required.

    Returns:
        :class:`RewardShaping`; metric ``truncated_frac``.
    """
    x = shaping_inputs(token_level_rewards, response_mask)
    coef = check_in_range("stop_properly_penalty_coef", stop_properly_penalty_coef, None, 1.0)
    cut = check_truncated(truncated, x.rewards.shape[0], x.rewards.device).unsqueeze(-1)
    if coef >= 0:
        shaped = torch.where(cut, coef * x.rewards, x.rewards)
    else:
        fixed = torch.where(last_valid(x.valid), x.rewards.new_full((), coef), 0)
        shaped = torch.where(cut, fixed, x.rewards)
    metrics = {"truncated_frac": row_fraction(cut, x.dtype).detach()}
    return RewardShaping(shaped, response_mask, metrics)
