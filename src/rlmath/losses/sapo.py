"""Soft Adaptive Policy Optimization (Gao et al. 2025, https://arxiv.org/abs/2511.20347).

SAPO replaces the hard clip by a smooth gate of the token ratio r:

    f(r; τ) = σ(τ (r − 1)) · 4/τ,      l = −f(r; τ) · A

with ``τ = τ_pos`` where ``A > 0`` and ``τ_neg`` otherwise. The gate's slope
at ``r = 1`` is 1 (so on-policy it is the vanilla policy gradient) and it
decays smoothly as r leaves 1, the faster the larger τ; ``τ_neg > τ_pos``
damps negative-advantage updates more strongly.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_sapo"]


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO's soft-gated policy loss.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``tau_pos``/``tau_neg`` (> 0) are the gate temperatures. The default
    aggregation is ``seq-mean-token-mean`` like the paper; unlike verl, which
    always uses that mode for SAPO whatever it is given, an explicit
    ``loss_agg_mode`` is honoured. No token is clipped, so the clip-fraction
    metrics are 0.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    tau_pos = check_in_range("tau_pos", tau_pos, 0.0, None, low_inclusive=False)
    tau_neg = check_in_range("tau_neg", tau_neg, 0.0, None, low_inclusive=False)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    adv = inp.advantages
    tau = torch.where(adv > 0, adv.new_full((), tau_pos), adv.new_full((), tau_neg))
    gate = torch.sigmoid(tau * (inp.ratio - 1)) * (4 / tau)
    loss = inp.aggregate(-gate * adv, loss_agg_mode, agg)
    return loss, policy_metrics(inp)
