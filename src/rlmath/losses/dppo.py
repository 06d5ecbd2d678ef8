"""Divergence PPO, binary approximations (Qi et al. 2026, https://arxiv.org/abs/2602.04879).

DPPO replaces PPO's ratio clip by a trust region on an estimate of the policy
divergence at each token. The *binary* approximation collapses the vocabulary
to {sampled token, everything else}, so with ``p = π_θ(y_t)`` and
``p_old = π_old(y_t)``:

* Binary TV: ``p − p_old`` (signed), valid when ``p − p_old ≤ δ_high`` for
  ``A > 0`` and ``p − p_old ≥ −δ_low`` otherwise;
* Binary KL: ``KL(Bern(p_old) ‖ Bern(p)) = p_old log(p_old/p) +
  (1 − p_old) log((1 − p_old)/(1 − p))``, valid when it is ≤ δ_high or the
  update moves p down (``p ≤ p_old``) for ``A > 0``, and ≤ δ_low or p moves up
  for ``A ≤ 0``.

Tokens outside the trust region are masked (the mask is detached). Valid
tokens get the policy gradient weighted by the truncated, detached ratio
(the paper's truncated importance sampling instead of dual clip):

    l = −A · sg(min(r, c)) · log π_θ · valid

``clip_ratio``/``clip_ratio_low``/``clip_ratio_high`` are the divergence
thresholds δ (verl reuses its PPO clip fields for them). The default
``clip_ratio_c = 3.0`` is what verl's ActorConfig passes (verl's code falls
back to 20 only for configs without the field); the paper recommends a large
threshold, which limits the truncation bias.

Probabilities come from log-probs clamped at 0 (a log-prob is never
positive), and the binary KL is computed in log space (``log(1 − e^x)``
evaluated stably) instead of verl's ``+1e-8`` guard; the two agree except for
``1 − p`` below about 1e-6.
"""

from __future__ import annotations

import math

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range
from rlmath.losses._policy_inputs import (
    PolicyInputs,
    check_loss_args,
    clip_bounds,
    policy_metrics,
    prepare_policy_inputs,
)
from rlmath.losses.aggregation import Aggregation, AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["binary_kl", "compute_policy_loss_dppo_kl", "compute_policy_loss_dppo_tv"]


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − e^x)`` for ``x ≤ 0`` (Mächler 2012): −inf at x = 0."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_kl(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(p_old) ‖ Bern(p))`` from log-probs (clamped at 0), detached.

    Shape: both ``(*)``; result ``(*)`` in their dtype, ≥ 0, +inf when p = 1
    and p_old < 1. 0 where ``p_old == p``.
    """
    old = old_log_prob.detach().clamp(max=0)
    new = log_prob.detach().clamp(max=0)
    p_old = torch.exp(old)
    one_minus_old = -torch.expm1(old)
    head = p_old * (old - new)
    tail = torch.where(one_minus_old > 0, one_minus_old * (_log1mexp(old) - _log1mexp(new)), 0)
    return torch.where(old == new, 0, head + tail)


def _dppo(
    inp: PolicyInputs,
    valid: torch.Tensor,
    clip_ratio_c: float,
    loss_agg_mode: str,
    agg: Aggregation,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    adv = inp.advantages
    trunc = inp.ratio.detach().clamp(max=clip_ratio_c)
    loss_mat = torch.where(valid, -adv * trunc * inp.log_prob, 0)
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    truncated = valid & (adv != 0) & (inp.ratio.detach() > clip_ratio_c)
    metrics = policy_metrics(
        inp,
        clipped_high=(adv > 0) & ~valid,
        clipped_low=(adv < 0) & ~valid,
        clipped_lower=truncated,
    )
    return loss, metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV loss.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    the clip ranges are TV thresholds δ and ``clip_ratio_c`` (> 0) truncates
    the detached ratio. Metrics: ``pg_clipfrac_high``/``_low`` are the
    fractions of A > 0 / A < 0 tokens outside the trust region,
    ``pg_clipfrac_lower`` the fraction of kept tokens whose ratio was truncated.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    clip_ratio_c = check_in_range("clip_ratio_c", clip_ratio_c, 0.0, None, low_inclusive=False)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    diff = torch.exp(inp.log_prob.detach().clamp(max=0)) - torch.exp(inp.old_log_prob.clamp(max=0))
    # Written as "not outside" so that NaN on a valid token stays visible in the loss.
    valid = ~torch.where(inp.advantages > 0, diff > high, diff < -low)
    return _dppo(inp, valid, clip_ratio_c, loss_agg_mode, agg)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL loss; as :func:`compute_policy_loss_dppo_tv` with KL thresholds."""
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    clip_ratio_c = check_in_range("clip_ratio_c", clip_ratio_c, 0.0, None, low_inclusive=False)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    kl = binary_kl(inp.old_log_prob, inp.log_prob)
    new, old = inp.log_prob.detach().clamp(max=0), inp.old_log_prob.clamp(max=0)
    # Outside: too far *and* moving in the direction the advantage pushes.
    outside = torch.where(inp.advantages > 0, (kl > high) & (new > old), (kl > low) & (new < old))
    valid = ~outside
    return _dppo(inp, valid, clip_ratio_c, loss_agg_mode, agg)
