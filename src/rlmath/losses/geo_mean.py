"""Geometric-Mean Policy Optimization, GMPO (Zhao et al. 2025, https://arxiv.org/abs/2507.20673).

GMPO maximises the geometric mean of the token-level clipped objectives of a
sequence instead of their arithmetic mean. In log space, with the
token log-ratio ``x_t`` clipped to ``[−ε_low, ε_high]`` in the direction that
matters for the sign of the advantage,

    x̃_t = sgn(A_t) · min(sgn(A_t) · x_t, sgn(A_t) · clip(x_t, −ε_low, ε_high))
    L_i = −Â_i · exp((1/|y_i|) Σ_t x̃_t)

where ``Â_i`` is the masked mean advantage of sequence i (the method is defined
for sequence-level advantages). The clip range is in log space (the paper
uses ±0.4; the default here is verl's 0.2).

``L_i`` is a per-sequence loss: it is spread over the sequence's valid tokens
and aggregated with ``loss_agg_mode``; the default ``seq-mean-token-mean`` is
the paper's mean over sequences.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath.losses._policy_inputs import (
    check_loss_args,
    clip_bounds,
    policy_metrics,
    prepare_policy_inputs,
)
from rlmath.losses.aggregation import AggregationKwargs, aggregate
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_geo_mean"]


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO loss.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`.
    ``rollout_is_weights`` enter as their per-sequence geometric mean (like
    verl). verl ignores ``loss_agg_mode`` for this loss and averages over every
    row, fully masked ones included; rlmath honours the mode and never counts
    a fully masked sequence.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    x, adv = inp.clamped_log_ratio, inp.advantages
    sign = torch.sign(adv)
    x_tilde = sign * torch.minimum(sign * x, sign * x.clamp(-low, high))
    seq_log_ratio = inp.mean(x_tilde, axis=-1)
    seq_adv = inp.mean(adv, axis=-1)
    seq_loss = -seq_adv * torch.exp(seq_log_ratio)
    if rollout_is_weights is not None:
        assert inp.is_weights is not None
        log_w = torch.log(inp.is_weights.clamp(min=0) + 1e-10)
        seq_loss = seq_loss * torch.exp(inp.mean(log_w, axis=-1))
    loss_mat = seq_loss.unsqueeze(-1).expand_as(x)
    loss = aggregate(loss_mat, inp.valid, inp.weights, loss_agg_mode, agg)
    xd = x.detach()
    metrics = policy_metrics(
        inp, clipped_high=(adv > 0) & (xd > high), clipped_low=(adv < 0) & (xd < -low)
    )
    return loss, metrics
