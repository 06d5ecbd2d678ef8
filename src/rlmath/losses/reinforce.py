"""REINFORCE (Williams 1992) with optional importance weights.

``l = −w · A · log π_θ`` per token, where ``w`` are detached importance
weights (``rollout_is_weights``, e.g. truncated π_θ/π_rollout from
:func:`rlmath.rollout_correction`) or 1. No ratio, no clip. This is verl's
``compute_policy_loss_reinforce`` (used by its bypass mode); the first
argument is the log-prob of the policy that sampled the tokens and only
feeds the ``ppo_kl`` metric.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_reinforce"]


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-sum",
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE loss ``−w·A·log π_θ`` per token, aggregated.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``old_log_prob`` is the rollout policy's log-prob (verl's
    ``rollout_log_prob``). The default aggregation ``seq-mean-token-sum`` is
    verl's for this loss.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    loss = inp.aggregate(-inp.advantages * inp.log_prob, loss_agg_mode, agg)
    return loss, policy_metrics(inp)
