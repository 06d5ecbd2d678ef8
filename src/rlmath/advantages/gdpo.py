"""GDPO: group reward-decoupled normalization (arXiv:2601.05242).

GRPO sums the reward components before normalizing, so a component with a
large spread drowns the others. GDPO normalizes each component within its
group first, sums them with weights, then whitens over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range, check_tensor
from rlmath.advantages._common import (
    outcome_inputs,
    valid_counts,
    whiten_batch,
)
from rlmath.advantages.groups import group_moments
from rlmath.advantages.registry import register_advantage_estimator

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["compute_gdpo_outcome_advantage"]


@register_advantage_estimator("gdpo")
@torch.no_grad()
@threads_per_call
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | torch.Tensor | None = None,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-component GRPO normalization, weighted sum, then batch whitening.

    For each component ``k``: ``A_k = (r_k − mean_g) / (std_g + ε)`` within
    the group (``r_k − mean_g`` when ``norm_adv_by_std_in_grpo`` is False);
    then ``A = Σ_k w_k A_k`` on every valid token, whitened over the batch
    (masked, unbiased variance, eps 1e-8). Singleton and all-equal groups
    contribute 0 for that component (verl: the raw score for singletons).

    verl reads the components from ``non_tensor_batch`` under
    ``algorithm.gdpo_reward_keys`` and places each at the last response token;
    here they are passed directly as a ``(B, K)`` tensor.

    Args:
        token_level_rewards: Shape ``(B, T)``, floating. Used as the single
            component (its sum over valid tokens) when ``reward_components``
            is None.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group id per sample (tensor, numpy array or list of hashable ids).
        epsilon: ``ε`` added to each component's group std.
        norm_adv_by_std_in_grpo: Divide each component by its group std.
        reward_components: Shape ``(B, K)``, floating: the score of each
            reward component (verl's ``gdpo_reward_keys``) per response.
        reward_weights: ``K`` weights (verl's ``gdpo_reward_weights``);
            default all 1.
        group: ``torch.distributed`` process group over which the batch is
            split (data parallel): whitening uses the mean and variance of the
            whole batch across its ranks, and every rank must call. ``None``
            (default): this process's batch only. Groups of ``index`` are
            formed per rank: keep each group on one rank.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 when an input is fp64), 0 at masked positions.
    """
    eps = check_in_range("epsilon", epsilon, 0.0, None)
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    batch = x.scores.shape[0]
    if reward_components is None:
        components = x.scores.unsqueeze(-1)
    else:
        check_tensor("reward_components", reward_components, floating=True)
        if reward_components.dim() != 2 or reward_components.shape[0] != batch:
            raise ValueError(
                f"reward_components must have shape ({batch}, K), "
                f"got {tuple(reward_components.shape)}"
            )
        dtype = torch.promote_types(x.scores.dtype, reward_components.dtype)
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        components = reward_components.to(device=x.scores.device, dtype=dtype)
    weights = _weights(reward_weights, components)
    m = group_moments(components, x.ids)
    normalized = m.centered
    if norm_adv_by_std_in_grpo:  # a flat group gives 0 for any epsilon, 0 included
        normalized = torch.where(m.zero_std, 0, m.centered / (m.std + eps))
    combined = (normalized * weights).sum(-1)
    whitened = whiten_batch(combined, counts=valid_counts(x.valid), group=group)
    advantages = x.to_tokens(whitened)
    return advantages, advantages


def _weights(
    weights: Sequence[float] | torch.Tensor | None, components: torch.Tensor
) -> torch.Tensor:
    k = components.shape[-1]
    if weights is None:
        return components.new_ones(k)
    w = torch.as_tensor(weights, dtype=components.dtype, device=components.device)
    if w.shape != (k,):
        raise ValueError(
            f"reward_weights must hold one weight per reward component ({k}), got shape {tuple(w.shape)}"
        )
    return w
