"""Optimal token baseline (OTB): a per-timestep baseline from group statistics.

For each group and timestep ``t`` the baseline is the variance-weighted mean
of the group's returns-to-go, ``B_t = Σ_i G_t^i W_t^i / (Σ_i W_t^i + ε)``,
where ``W_t = Σ_{j ≤ t} w_j`` accumulates the per-token proxy of the squared
score-function norm ``w_j = 1 − 2π_j + Σ_v π_v²`` (``π_j`` the sampled token's
probability, ``Σ π²`` over the vocabulary). With rollout importance weights
``ρ``, ``w_j`` is scaled by ``ρ_j²``. The advantage is ``G_t − B_t``.

The multi-turn variant (verl: ``tir_optimal_token_baseline``) aligns the
trajectories of a group by their k-th *valid* token instead of by column, so
tool-output spans do not misalign the per-step statistics.

Both are segment reductions over ``[B, T]`` (the group sums are ``[G, T]``
rows of an ``index_add``): no Python loop over samples or groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range, result_dtype
from rlmath.advantages._common import (
    ValidTokens,
    check_token_tensor,
    outcome_inputs,
    valid_values,
)
from rlmath.advantages.groups import segment_reduce, segment_sum, to_samples
from rlmath.advantages.registry import register_advantage_estimator
from rlmath.advantages.scan import _reverse_scan

__all__ = [
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_optimal_token_baseline_advantage",
]

_DOC_ARGS = """
    Args:
        token_level_rewards: Shape ``(B, T)``, floating.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group (prompt) id per sample (tensor, numpy array or list of
            hashable ids).
        old_log_prob: Shape ``(B, T)``, floating; log-probability of each
            sampled token under the rollout policy.
        sum_pi_squared: Shape ``(B, T)``, floating; ``Σ_v π_v²`` over the
            vocabulary at each position.
        rollout_is_weights: Optional ``(B, T)`` importance weights ``ρ``.
        handle_zero_tail: In a group whose longest trajectory is strictly
            longer than all others, set its baseline to 0 past the
            second-longest length (no other trajectory informs it there).
        epsilon: ``ε`` added to the denominator ``Σ W``.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, fp32 (fp64 when an input
        is fp64), 0 at masked positions; ``returns`` is the undiscounted
        return-to-go over the valid tokens.
"""


@register_advantage_estimator("optimal_token_baseline")
@torch.no_grad()
@threads_per_call
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB advantages with trajectories aligned by column ``t``.

    Differences from verl: singleton groups give advantage 0 (verl: the
    return), a step where every valid trajectory of the group has the same
    return gets exactly 0 (verl: ``G·ε/(ΣW+ε)``), and ``returns`` is 0 at
    masked positions.
    """
    return _optimal_token_baseline(
        token_level_rewards,
        response_mask,
        index,
        old_log_prob,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
        multi_turn=False,
    )


@register_advantage_estimator("tir_optimal_token_baseline")
@torch.no_grad()
@threads_per_call
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB advantages with trajectories aligned by their k-th valid token.

    Statistics at step ``k`` pool the k-th valid token of every trajectory of
    the group; empty trajectories are not group members (as in verl).
    Differences from verl as in :func:`compute_optimal_token_baseline_advantage`.
    """
    return _optimal_token_baseline(
        token_level_rewards,
        response_mask,
        index,
        old_log_prob,
        sum_pi_squared,
        rollout_is_weights,
        handle_zero_tail,
        epsilon,
        multi_turn=True,
    )


compute_optimal_token_baseline_advantage.__doc__ = (
    compute_optimal_token_baseline_advantage.__doc__ or ""
) + _DOC_ARGS
compute_multi_turn_optimal_token_baseline_advantage.__doc__ = (
    compute_multi_turn_optimal_token_baseline_advantage.__doc__ or ""
) + _DOC_ARGS


def _optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    handle_zero_tail: bool,
    epsilon: float,
    *,
    multi_turn: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    eps = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    rewards, valid, ids = x.rewards, x.valid, x.ids
    extra = [check_token_tensor("old_log_prob", old_log_prob, token_level_rewards)]
    extra.append(check_token_tensor("sum_pi_squared", sum_pi_squared, token_level_rewards))
    if rollout_is_weights is not None:
        extra.append(
            check_token_tensor("rollout_is_weights", rollout_is_weights, token_level_rewards)
        )
    dtype = result_dtype(rewards, *extra)
    rewards = rewards.to(dtype)
    batch, length = rewards.shape

    returns = torch.where(valid, _reverse_scan(rewards, 1.0), 0)
    pi = valid_values(old_log_prob, valid, dtype).exp()
    w = 1 - 2 * pi + valid_values(sum_pi_squared, valid, dtype)
    if rollout_is_weights is not None:
        w = w * valid_values(rollout_is_weights, valid, dtype).square()
    cum_w = torch.where(valid, w, 0).cumsum(-1)

    lengths = valid.sum(-1)
    if multi_turn:
        tokens = ValidTokens(valid)
        g_ret = tokens.pack(returns, dtype)[:, :length]
        g_w = tokens.pack(cum_w, dtype)[:, :length]
        step_valid = torch.arange(length, device=valid.device) < lengths.unsqueeze(-1)
        member = lengths > 0
    else:
        g_ret, g_w, step_valid = returns, torch.where(valid, cum_w, 0), valid
        member = torch.ones_like(lengths, dtype=torch.bool)

    numerator = segment_sum(g_ret * g_w, ids)
    denominator = segment_sum(g_w, ids) + eps
    baseline = to_samples(numerator / denominator, ids)
    # Where every valid trajectory of the group has the same return at this
    # step, the weighted mean is that return: use it exactly so the advantage
    # is exactly 0 (this also covers singletons and single-survivor steps).
    high = to_samples(segment_reduce(torch.where(step_valid, g_ret, -torch.inf), ids, "amax"), ids)
    low = to_samples(segment_reduce(torch.where(step_valid, g_ret, torch.inf), ids, "amin"), ids)
    baseline = torch.where(high == low, g_ret, baseline)

    if handle_zero_tail:
        baseline = torch.where(_zero_tail(lengths, member, ids, length), 0, baseline)

    advantages = torch.where(step_valid, g_ret - baseline, 0)
    if multi_turn:
        advantages = tokens.unpack(F.pad(advantages, (0, 1)))
    return advantages, returns


def _zero_tail(
    lengths: torch.Tensor, member: torch.Tensor, ids: torch.Tensor, length: int
) -> torch.Tensor:
    """``(B, T)`` bool: steps of a group's unique longest trajectory past the runner-up's length.

    Only groups of at least two members qualify; non-members take no part.
    """
    n = torch.where(member, lengths, -1).to(torch.float64)
    longest = to_samples(segment_reduce(n, ids, "amax"), ids)
    is_longest = member & (n == longest)
    n_longest = to_samples(segment_sum(is_longest.to(torch.float64), ids), ids)
    n_members = to_samples(segment_sum(member.to(torch.float64), ids), ids)
    runner_up = to_samples(segment_reduce(torch.where(is_longest, -1.0, n), ids, "amax"), ids)
    applies = is_longest & (n_longest == 1) & (n_members >= 2)
    steps = torch.arange(length, device=lengths.device, dtype=torch.float64)
    return applies.unsqueeze(-1) & (steps >= runner_up.unsqueeze(-1))
