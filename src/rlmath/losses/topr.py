"""Tapered Off-Policy REINFORCE (Le Roux et al. 2025, https://arxiv.org/abs/2503.14286, eq. 8).

REINFORCE off-policy with an asymmetric, truncated importance weight: samples
with a non-negative reward get the plain (SFT-like) update, samples with a
negative one the truncated-IS update, which fades as the policy makes them
unlikely:

    ∇J = Σ_{R ≥ 0} μ(τ) R ∇log π(τ) + Σ_{R < 0} μ(τ) [π(τ)/μ(τ)]_0^1 R ∇log π(τ)

Per token, with ``A`` the advantage (the paper's ``R(τ)``, or ``R − c`` with
its baseline ``c``):

    l = −w_+ · A · log π_θ                     (A ≥ 0)
    l = −w_− · sg(min(ρ, 1)) · A · log π_θ     (A < 0)

where ``ρ`` is the *trajectory* ratio ``π(τ)/μ(τ) = exp(Σ_t log r_t)``
(``ratio_level="sequence"``, the paper; each token's log-ratio clamped to
``±log_ratio_clamp`` first) or each token's own ratio
(``ratio_level="token"``, ROLL's ``pg_variant="topr"``). ROLL also splits the
samples by the sign of the raw score (``score > 0``) rather than of the
advantage; here the advantage is the reward the loss sees, as in the paper.
``w_+``/``w_−`` are ROLL's ``topr_positive_weight``/``topr_negative_weight``.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_choice, check_in_range
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["TOPR_RATIO_LEVELS", "compute_policy_loss_topr"]

#: Accepted values of ``ratio_level``.
TOPR_RATIO_LEVELS: tuple[str, ...] = ("sequence", "token")


@register_policy_loss("topr")
def compute_policy_loss_topr(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-sum",
    ratio_level: str = "sequence",
    positive_weight: float = 1.0,
    negative_weight: float = 1.0,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TOPR loss (module docstring).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``old_log_prob`` is the log-prob of the sampling policy μ. ``ratio_level``:
    ``"sequence"`` or ``"token"``; ``positive_weight``/``negative_weight`` (>= 0)
    scale the two parts. The default aggregation ``seq-mean-token-sum`` is the
    paper's mean over trajectories of ``R·log π(τ)``. ``pg_clipfrac_low`` is
    the fraction of negative-advantage tokens whose ratio was truncated at 1
    (their gradient is rescaled, not removed).
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    check_choice("ratio_level", ratio_level, TOPR_RATIO_LEVELS)
    w_pos = check_in_range("positive_weight", positive_weight, 0.0, None)
    w_neg = check_in_range("negative_weight", negative_weight, 0.0, None)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    lr = inp.clamped_log_ratio.detach()
    if ratio_level == "sequence":
        lr = torch.where(inp.valid, lr, 0).mul(inp.weights).sum(-1, keepdim=True)
    # min(ρ, 1) = exp(min(log ρ, 0)): no overflow for a long sequence's product.
    truncated = torch.exp(lr.clamp(max=0)).expand_as(inp.log_prob)
    adv = inp.advantages
    negative = adv < 0
    weight = torch.where(negative, w_neg * truncated, w_pos)
    loss_mat = -weight * adv * inp.log_prob
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    return loss, policy_metrics(inp, clipped_low=negative & (lr > 0).expand_as(negative))
