"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
https://arxiv.org/abs/2505.22617).

Both act on the few tokens with the largest centred covariance

    cov_t = (A_t − mean(A)) · (log π_θ(y_t) − mean(log π_θ))

(means over the valid tokens of the batch), which drive entropy collapse:

* **Clip-Cov**: among tokens PPO did not already clip whose covariance
  lies in ``(clip_cov_lb, clip_cov_ub)``, a random subset of
  ``max(⌊clip_cov_ratio · N⌋, 1)`` tokens has its gradient removed.
* **KL-Cov**: the ``max(⌊kl_cov_ratio · N⌋, 1)`` tokens of largest
  covariance get a KL penalty ``ppo_kl_coef · |log π_θ − log π_old|`` added to the
  unclipped surrogate ``−r·A``; the others keep ``−r·A``.

The selection is made on the device (random keys from ``generator`` and a rank
comparison; no ``.item()``, no ``nonzero``, no CPU round trip as in verl).

**Not decomposable across micro-batches.** The means, the count ``N`` and the
random/top-k choice are statistics of the tensor passed in, so splitting a
batch into micro-batches or data-parallel ranks selects different tokens than
the full batch would (as in verl). To make a split run reproduce the full
batch exactly, compute the selection once on the full batch with
:func:`clip_cov_selection` / :func:`kl_cov_selection` and pass the matching
slice as ``selection=``; with the selection fixed, the losses are exact under
:func:`rlmath.agg_loss`'s data-parallel scaling.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range, check_same_shape, check_tensor
from rlmath.losses._policy_inputs import (
    PolicyInputs,
    check_loss_args,
    clip_bounds,
    policy_metrics,
    prepare_policy_inputs,
)
from rlmath.losses._selection import random_subset, selection_count, top_k
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.ppo_clip import ppo_clip_regions
from rlmath.losses.registry import register_policy_loss

__all__ = [
    "clip_cov_selection",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
    "kl_cov_selection",
]


def _covariance(inp: PolicyInputs) -> torch.Tensor:
    adv, logp = inp.advantages, inp.log_prob.detach()
    return (adv - inp.mean(adv)) * (logp - inp.mean(logp))


def _check_selection(selection: torch.Tensor, inp: PolicyInputs) -> torch.Tensor:
    check_tensor("selection", selection)
    if selection.dtype != torch.bool:
        raise TypeError(f"selection must be a bool tensor, got dtype {selection.dtype}")
    check_same_shape("selection", selection, "log_prob", inp.log_prob)
    return selection & inp.valid


def _clip_cov_select(
    inp: PolicyInputs,
    ppo_clipped: torch.Tensor,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    cov = _covariance(inp)
    candidate = inp.valid & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    return random_subset(candidate, selection_count(inp.valid, clip_cov_ratio), generator)


def _check_clip_cov(clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float) -> None:
    clip_cov_ratio = check_in_range("clip_cov_ratio", clip_cov_ratio, 0.0, 1.0, low_inclusive=False)
    clip_cov_lb = check_in_range("clip_cov_lb", clip_cov_lb)
    clip_cov_ub = check_in_range("clip_cov_ub", clip_cov_ub)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(
            f"clip_cov_lb must be < clip_cov_ub, got clip_cov_lb={clip_cov_lb}, "
            f"clip_cov_ub={clip_cov_ub}"
        )


def clip_cov_selection(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """The tokens Clip-Cov removes from the gradient: a bool ``(B, T)`` tensor.

    Same arguments as :func:`compute_policy_loss_clip_cov`; the same
    ``generator`` state gives the same selection as the loss would make.
    """
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    _check_clip_cov(clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, log_ratio_clamp=log_ratio_clamp
    )
    hi, lo = ppo_clip_regions(inp.ratio, inp.advantages, low, high)
    return _clip_cov_select(inp, hi | lo, clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    selection: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO's clipped loss (no dual clip) with a covariance-selected subset detached.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`, plus:
    ``clip_cov_ratio`` (fraction of valid tokens to select, in (0, 1]),
    ``clip_cov_lb < clip_cov_ub`` (covariance band of the candidates),
    ``generator`` (a ``torch.Generator`` on the tensors' device for the random
    choice) and ``selection`` (a bool ``(B, T)`` tensor that replaces the
    internal choice, e.g. a slice of :func:`clip_cov_selection` on the full
    batch). Metrics: ``pg_clipfrac_*`` count PPO-clipped and selected tokens
    (both lose their gradient; verl's ``pg_clipfrac`` counts the selected ones
    only), ``clip_cov_frac`` the selected fraction.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    _check_clip_cov(clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    ratio, adv = inp.ratio, inp.advantages
    clipped_high, clipped_low = ppo_clip_regions(ratio, adv, low, high)
    clipped = clipped_high | clipped_low
    if selection is None:
        selected = _clip_cov_select(
            inp, clipped, clip_cov_ratio, clip_cov_lb, clip_cov_ub, generator
        )
    else:
        selected = _check_selection(selection, inp)
    loss_mat = torch.where(clipped, -adv * ratio.clamp(1 - low, 1 + high), -adv * ratio)
    loss_mat = torch.where(selected, 0, loss_mat)
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    metrics = policy_metrics(
        inp,
        clipped_high=clipped_high | (selected & (adv > 0)),
        clipped_low=clipped_low | (selected & (adv < 0)),
    )
    metrics["clip_cov_frac"] = inp.frac(selected)
    return loss, metrics


def kl_cov_selection(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    generator: torch.Generator | None = None,
    log_ratio_clamp: float = 20.0,
) -> torch.Tensor:
    """The tokens KL-Cov penalises: a bool ``(B, T)`` tensor (see :func:`compute_policy_loss_kl_cov`)."""
    kl_cov_ratio = check_in_range("kl_cov_ratio", kl_cov_ratio, 0.0, 1.0, low_inclusive=False)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, log_ratio_clamp=log_ratio_clamp
    )
    return top_k(_covariance(inp), inp.valid, selection_count(inp.valid, kl_cov_ratio), generator)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    generator: torch.Generator | None = None,
    selection: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: ``−r·A`` everywhere, plus ``ppo_kl_coef·|log r|`` on the top-covariance tokens.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`, plus
    ``kl_cov_ratio`` (in (0, 1]), ``ppo_kl_coef`` (>= 0; verl's PolicyLossConfig
    default 0.1), ``generator`` (random tie-breaking among equal covariances;
    None breaks ties by position) and ``selection`` (see
    :func:`compute_policy_loss_clip_cov`). The penalty uses the raw log-ratio.
    Metrics: ``ppo_kl`` is the usual masked mean of ``−log r``; ``ppo_kl_abs``
    the masked mean of ``|log r|`` (what verl reports as ``ppo_kl`` for this
    loss); ``kl_cov_frac`` the selected fraction.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    kl_cov_ratio = check_in_range("kl_cov_ratio", kl_cov_ratio, 0.0, 1.0, low_inclusive=False)
    ppo_kl_coef = check_in_range("ppo_kl_coef", ppo_kl_coef, 0.0, None)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    if selection is None:
        k = selection_count(inp.valid, kl_cov_ratio)
        selected = top_k(_covariance(inp), inp.valid, k, generator)
    else:
        selected = _check_selection(selection, inp)
    base = -inp.advantages * inp.ratio
    loss_mat = torch.where(selected, base + ppo_kl_coef * inp.log_ratio.abs(), base)
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    metrics = policy_metrics(inp)
    metrics["ppo_kl_abs"] = inp.mean(inp.log_ratio.detach().abs()).detach()
    metrics["kl_cov_frac"] = inp.frac(selected)
    return loss, metrics
