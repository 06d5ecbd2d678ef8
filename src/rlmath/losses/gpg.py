"""Group Policy Gradient (Chu et al. 2025, https://arxiv.org/abs/2504.02546).

GPG drops the surrogate, the ratio and the clip altogether and minimises the
plain policy-gradient loss ``l = −A · log π_θ``; its advantage
estimator is in :mod:`rlmath.advantages`.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_gpg"]


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG loss ``−A · log π_θ`` per token, aggregated.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`.
    ``old_log_prob`` only feeds the metrics (``ppo_kl``); verl returns no
    metrics for GPG.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    loss = inp.aggregate(-inp.advantages * inp.log_prob, loss_agg_mode, agg)
    return loss, policy_metrics(inp)
