"""REINFORCE++ and REINFORCE++-baseline (Hu, 2025, arXiv:2501.03262)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range
from rlmath.advantages._common import (
    ValidTokens,
    as_unit_scalar,
    outcome_inputs,
    valid_counts,
    whiten_batch,
)
from rlmath.advantages.groups import group_moments
from rlmath.advantages.registry import register_advantage_estimator
from rlmath.advantages.scan import _reverse_scan

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
]


def discounted_returns(rewards: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over the valid tokens, masked tokens skipped; 0 at masked positions.

    ``G[k] = r[k] + γ·G[k+1]`` over the valid tokens of a row in order. ``rewards``
    must already be 0 at masked positions.
    """
    if gamma == 1.0:
        # Skipping a masked token and adding its zero reward are the same thing.
        return torch.where(valid, _reverse_scan(rewards, 1.0), 0)
    tokens = ValidTokens(valid)
    return tokens.unpack(_reverse_scan(tokens.pack(rewards, rewards.dtype), gamma))


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
@threads_per_call
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go per token, whitened over the batch.

    ``G[k] = r[k] + γ·G[k+1]`` over the valid tokens of each row: masked
    tokens (tool outputs in multi-turn rollouts) are skipped, so rewards after
    them still reach earlier tokens with one ``γ`` per valid step — the same
    rule as GAE. verl 0.9.1 also carries the return across masked tokens;
    older verl releases reset it there. Advantages are ``G`` whitened over all
    valid tokens of the batch (masked mean, unbiased variance, eps 1e-8).

    Args:
        token_level_rewards: Shape ``(B, T)``, floating.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        gamma: Discount ``γ`` in ``[0, 1]`` (verl's ``algorithm.gamma``, default 1).
        group: ``torch.distributed`` process group over which the batch is
            split (data parallel): whitening uses the mean and variance of the
            whole batch across its ranks, and every rank must call. ``None``
            (default): this process's batch only.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, fp32 (fp64 for fp64
        rewards), 0 at masked positions.
    """
    g = as_unit_scalar("gamma", gamma)
    x = outcome_inputs(token_level_rewards, response_mask, grouped=False)
    returns = discounted_returns(x.rewards, x.valid, g)
    return whiten_batch(returns, x.valid, group=group), returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
@threads_per_call
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    *,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s − mean_g`` broadcast to the valid tokens, then whitened over the batch.

    The group mean is the baseline; the batch whitening (masked, unbiased
    variance, eps 1e-8, over all valid tokens) sets the scale. Singleton and
    all-equal groups give 0 before whitening (verl keeps a singleton's raw
    score).

    Args:
        token_level_rewards: Shape ``(B, T)``, floating; score = sum over valid tokens.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group id per sample (tensor, numpy array or list of hashable ids).
        epsilon: Unused; kept for verl's signature.
        group: ``torch.distributed`` process group over which the batch is
            split (data parallel): whitening uses the mean and variance of the
            whole batch across its ranks, and every rank must call. ``None``
            (default): this process's batch only. Groups of ``index`` are
            formed per rank: keep each group on one rank.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 for fp64 rewards), 0 at masked positions.
    """
    epsilon = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    centered = group_moments(x.scores, x.ids).centered
    whitened = whiten_batch(centered, counts=valid_counts(x.valid), group=group)
    advantages = x.to_tokens(whitened)
    return advantages, advantages
