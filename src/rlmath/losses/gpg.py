"""Group Policy Gradient (Chu et al. 2025, https://arxiv.org/abs/2504.02546).

GPG drops the surrogate, the ratio and the clip altogether and minimises the
plain policy-gradient loss ``l = −A · log π_θ``; its advantage
estimator is in :mod:`rlmath.advantages`.
"""

from __future__ import annotations

import torch

from rlmath.losses.aggregation import Count, agg_loss
from rlmath.losses.ratio import policy_metrics, prepare_policy_inputs

__all__ = ["compute_policy_loss_gpg"]


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    dp_size: int = 1,
    norm_length: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG loss ``−A · log π_θ`` per token, aggregated.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`.
    ``old_log_prob`` only feeds the metrics (``ppo_kl``); verl returns no
    metrics for GPG.
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
