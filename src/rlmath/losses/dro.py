"""Policy gradient with a quadratic log-ratio penalty (verl's ``dro`` loss).

Instead of clipping, the update is regularised towards the behaviour policy by
a squared log-ratio (the policy-mirror-descent gradient of Kimi k1.5,
https://arxiv.org/abs/2501.12599, which verl names after Direct Reward
Optimisation, Richemond et al. 2024, https://arxiv.org/abs/2405.19107):

    l = −(A · log π_θ − (β/2) · (log π_θ − log π_old)²)

The penalty uses the raw (unclamped) log-ratio: its gradient β·(log π_θ −
log π_old) is what pulls a drifted token back, and it is finite for any finite
input.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_dro"]


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    dro_beta: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO loss; ``dro_beta`` (β > 0) is required, as in verl (whose default is None).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    if dro_beta is None:
        raise ValueError("dro_beta is required for the DRO loss (a number > 0), got None")
    dro_beta = check_in_range("dro_beta", dro_beta, 0.0, None, low_inclusive=False)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    loss_mat = -(inp.advantages * inp.log_prob - 0.5 * dro_beta * inp.log_ratio.square())
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    return loss, policy_metrics(inp)
