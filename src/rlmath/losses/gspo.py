"""Group Sequence Policy Optimization (Zheng et al. 2025, https://arxiv.org/abs/2507.18071).

GSPO replaces PPO's per-token ratio by the length-normalised sequence ratio

    s_i = (π_θ(y_i|x) / π_old(y_i|x))^{1/|y_i|} = exp((1/|y_i|) Σ_t log r_{i,t})

where the mean runs over the valid tokens of sequence i only (padding never
enters it). As in every loss, each token's log-ratio is clamped to
``±log_ratio_clamp`` (default 20) before it enters the mean or any ``exp``, so a
valid token with ``log π = −inf`` gives a finite loss (the clamped value, no
gradient through that token), like ``vanilla``. Both losses here use the
GSPO-token construction

    s_{i,t} = sg[s_i] · π_θ(y_{i,t}) / sg[π_θ(y_{i,t})]

whose value is ``s_i`` on every token and whose gradient is ``s_i ∇log π_θ(y_{i,t})``;
averaged over a sequence's tokens this is exactly ``∇s_i``, so any
aggregation mode gives the paper's sequence-level gradient.

* ``gspo`` (also registered as ``gspo_token``, the paper's name for this
  form): per-token advantages ``A_{i,t}`` with the sequence ratio — exactly
  what verl's registry calls ``gspo``, so a verl config migrates unchanged.
  With advantages constant within each sequence (GRPO, RLOO, ...) it *is* the
  paper's sequence-level GSPO.
* ``gspo_seq``: the paper's GSPO for any advantages: one advantage per
  sequence, the masked mean of ``advantages`` over its valid tokens, so the
  clip decision is per sequence even when the advantages vary per token.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath.losses._policy_inputs import (
    PolicyInputs,
    check_loss_args,
    clip_bounds,
    policy_metrics,
    prepare_policy_inputs,
)
from rlmath.losses.aggregation import AggregationKwargs, aggregate
from rlmath.losses.ppo_clip import ppo_clip_regions
from rlmath.losses.registry import register_policy_loss
from rlmath.masked import masked_mean

__all__ = [
    "compute_policy_loss_gspo",
    "compute_policy_loss_gspo_seq",
    "sequence_log_ratio",
]


def sequence_log_ratio(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, *, log_ratio_clamp: float = 20.0
) -> torch.Tensor:
    """``(1/|y_i|) Σ_t clamp(log r_{i,t}, ±log_ratio_clamp)`` per sequence, detached.

    Each token's log-ratio is clamped first, as in every loss (so an infinite
    log-ratio on a valid token, ``log π = −inf``, counts as ``−log_ratio_clamp``
    instead of making the mean ``−inf`` or, with a ``+inf`` next to it, NaN);
    the mean then lies in ``±log_ratio_clamp`` too. Equal to the mean of the
    raw log-ratios whenever none exceeds the clamp.

    Shape: ``log_ratio`` and ``response_mask`` ``(B, T)``; result ``(B, 1)``,
    fp32 (fp64 for fp64). A fully masked sequence gets 0.
    """
    clamped = log_ratio.detach().clamp(-log_ratio_clamp, log_ratio_clamp)
    return masked_mean(clamped, response_mask, axis=-1).unsqueeze(-1)


def _gspo(
    inp: PolicyInputs,
    adv: torch.Tensor,
    low: float,
    high: float,
    log_ratio_clamp: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seq_lr = inp.mean(inp.log_ratio.detach().clamp(-log_ratio_clamp, log_ratio_clamp), axis=-1)
    seq_lr = seq_lr.unsqueeze(-1)
    # Straight-through: value s_i, gradient s_i ∇log π_θ per token. Built from the
    # clamped log-ratio (value exactly 0, never inf − inf; no gradient beyond the
    # clamp, as in the token-level losses).
    lr = inp.clamped_log_ratio
    st_log = seq_lr + (lr - lr.detach())
    seq_ratio = torch.exp(st_log)
    clipped_high, clipped_low = ppo_clip_regions(seq_ratio, adv, low, high)
    clipped = clipped_high | clipped_low
    loss_mat = torch.where(clipped, -adv * seq_ratio.clamp(1 - low, 1 + high), -adv * seq_ratio)
    metrics = policy_metrics(inp, clipped_high=clipped_high, clipped_low=clipped_low)
    live = inp.valid.any(dim=-1)  # sequences with a valid token
    seq_mean = torch.where(live, seq_lr.squeeze(-1), 0).sum() / live.sum().clamp_min(1)
    metrics["seq_log_ratio_mean"] = seq_mean.detach()
    return inp.apply_is_weights(loss_mat), metrics


@register_policy_loss("gspo_seq")
def compute_policy_loss_gspo_seq(
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
    """The paper's GSPO with one advantage per sequence (the masked mean of ``advantages``).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_gspo`.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    seq_adv = inp.mean(inp.advantages, axis=-1).unsqueeze(-1)
    adv = torch.where(inp.valid, seq_adv.expand_as(inp.advantages), 0)
    loss_mat, metrics = _gspo(inp, adv, low, high, log_ratio_clamp)
    loss = aggregate(loss_mat, inp.valid, inp.weights, loss_agg_mode, agg)
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
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
    """GSPO(-token): the sequence ratio with per-token advantages; verl's ``gspo``.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`
    (no dual clip). The GSPO paper uses tiny ranges (ε_low = 3e-4,
    ε_high = 4e-4); the defaults are verl's 0.2. The default aggregation is
    ``seq-mean-token-mean`` (the paper's sequence mean). Extra metric:
    ``seq_log_ratio_mean`` (mean over sequences of log s_i).
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    loss_mat, metrics = _gspo(inp, inp.advantages, low, high, log_ratio_clamp)
    loss = aggregate(loss_mat, inp.valid, inp.weights, loss_agg_mode, agg)
    return loss, metrics


# The paper's name for this variant (GSPO-token), registered beside verl's "gspo".
register_policy_loss("gspo_token")(compute_policy_loss_gspo)
