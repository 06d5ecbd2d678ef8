"""Input checks and the result type shared by the reward shapings."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlmath._validation import check_mask, check_tensor, result_dtype, valid_mask

__all__ = ["RewardShaping"]


class RewardShaping(NamedTuple):
    """What every reward shaping returns (unpacks as a 3-tuple).

    ``token_level_rewards``: ``(B, T)`` fp32 (fp64 for fp64 input), 0 at
    masked positions. ``response_mask``: the mask to train with, the input's
    dtype. ``metrics``: detached 0-d tensors.
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    metrics: dict[str, torch.Tensor]


class ShapingInputs(NamedTuple):
    rewards: torch.Tensor  # (B, T) result dtype, 0 at masked positions
    valid: torch.Tensor  # (B, T) bool
    lengths: torch.Tensor  # (B,) number of valid tokens, int64
    dtype: torch.dtype


def shaping_inputs(token_level_rewards: object, response_mask: object) -> ShapingInputs:
    rewards = check_tensor("token_level_rewards", token_level_rewards, floating=True)
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must have shape (B, T), got {tuple(rewards.shape)}")
    mask = check_mask("response_mask", response_mask, "token_level_rewards", rewards)
    valid = valid_mask(mask)
    dtype = result_dtype(rewards)
    return ShapingInputs(torch.where(valid, rewards.to(dtype), 0), valid, valid.sum(-1), dtype)


def check_truncated(truncated: object, batch: int, device: torch.device) -> torch.Tensor:
    """A bool ``(B,)`` tensor (0/1 integers accepted) on the rewards' device."""
    if truncated is None:
        raise ValueError(
            "truncated is required: a bool tensor (B,), True where generation hit the length limit"
        )
    t = check_tensor("truncated", truncated, real=True)
    if t.shape != (batch,):
        raise ValueError(f"truncated must have shape ({batch},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"truncated is on {t.device} but token_level_rewards is on {device}")
    return valid_mask(t)


def last_valid(valid: torch.Tensor) -> torch.Tensor:
    """bool ``(B, T)``: the last valid token of each row (none for an empty row)."""
    t = valid.shape[-1]
    positions = torch.arange(t, device=valid.device)
    last = (
        torch.where(valid, positions, -1).amax(-1, keepdim=True)
        if t
        else valid.sum(-1, keepdim=True)
    )
    return valid & (positions == last)


def row_fraction(flags: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return flags.sum().to(dtype) / max(flags.numel(), 1)
