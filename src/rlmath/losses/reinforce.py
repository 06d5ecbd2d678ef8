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

from rlmath.losses.aggregation import Count, agg_loss
from rlmath.losses.ratio import policy_metrics, prepare_policy_inputs

__all__ = ["compute_policy_loss_reinforce"]


def compute_policy_loss_reinforce(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-sum",
    rollout_is_weights: torch.Tensor | None = None,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    dp_size: int = 1,
    norm_length: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE loss ``−w·A·log π_θ`` per token, aggregated.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``old_log_prob`` is the rollout policy's log-prob (verl's
    ``rollout_log_prob``). The default aggregation ``seq-mean-token-sum`` is
    verl's for this loss.
    """
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    loss = agg_loss(
        inp.apply_is_weights(-inp.advantages * inp.log_prob), response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        dp_size=dp_size, norm_length=norm_length,
    )  # fmt: skip
    return loss, policy_metrics(inp)
