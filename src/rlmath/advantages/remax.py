"""ReMax (Li et al., 2023, arXiv:2310.10505): the greedy response's reward as baseline."""

from __future__ import annotations

import torch

from rlmath._threads import threads_per_call
from rlmath.advantages._common import check_token_inputs, outcome_inputs
from rlmath.advantages.registry import register_advantage_estimator
from rlmath.advantages.scan import _reverse_scan

__all__ = ["compute_remax_outcome_advantage"]


@register_advantage_estimator("remax")
@torch.no_grad()
@threads_per_call
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return-to-go minus the sample's baseline, on every valid token.

    ``returns[t] = Σ_{s ≥ t, valid} r[s]`` (undiscounted, masked rewards
    ignored) and ``advantages = returns − reward_baselines``; both are 0 at
    masked positions (verl leaves the running return there).

    Args:
        token_level_rewards: Shape ``(B, T)``, floating.
        reward_baselines: Shape ``(B,)``, floating; e.g. the reward of the
            greedy response to the same prompt.
        response_mask: Shape ``(B, T)``, bool or 0/1.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, fp32 (fp64 when an input
        is fp64), 0 at masked positions.
    """
    rewards, _ = check_token_inputs(token_level_rewards, response_mask)
    if not isinstance(reward_baselines, torch.Tensor) or not reward_baselines.is_floating_point():
        raise TypeError(
            "reward_baselines must be a floating-point torch.Tensor, got "
            f"{getattr(reward_baselines, 'dtype', type(reward_baselines).__name__)}"
        )
    if reward_baselines.shape != (rewards.shape[0],):
        raise ValueError(
            f"reward_baselines must have shape ({rewards.shape[0]},), "
            f"got {tuple(reward_baselines.shape)}"
        )
    x = outcome_inputs(token_level_rewards, response_mask, grouped=False)
    dtype = torch.promote_types(x.rewards.dtype, reward_baselines.dtype)
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    returns = torch.where(x.valid, _reverse_scan(x.rewards.to(dtype), 1.0), 0)
    baseline = reward_baselines.to(device=returns.device, dtype=dtype).unsqueeze(-1)
    advantages = torch.where(x.valid, returns - baseline, 0)
    return advantages, returns
