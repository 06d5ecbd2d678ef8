"""PPO's clipped surrogate with asymmetric ranges and dual clip (registry name ``vanilla``).

Per valid token, with ratio ``r = exp(clamp(log π − log π_old, ±20))`` and
advantage ``A`` (Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 7):

    l = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)

Asymmetric ranges ("clip-higher") follow DAPO (https://arxiv.org/abs/2503.14476).
Dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729) bounds the
loss of negative-advantage tokens whose ratio exploded: for ``A < 0``,
``l = min(l, −c·A)`` with ``c > 1``.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range
from rlmath.losses._policy_inputs import (
    check_loss_args,
    clip_bounds,
    policy_metrics,
    prepare_policy_inputs,
)
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_vanilla", "ppo_clip_regions"]


def ppo_clip_regions(
    ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where PPO's clip is the active term of the min, i.e. the token's gradient is removed.

    Returns ``(clipped_high, clipped_low)``: ``A > 0`` and ``r > 1 + ε_high``;
    ``A < 0`` and ``r < 1 − ε_low``. Outside these regions ``−min(rA, clip(r)A)``
    equals the unclipped ``−rA`` (for ``A = 0`` both terms are 0).
    """
    r = ratio.detach()
    return (advantages > 0) & (r > 1 + high), (advantages < 0) & (r < 1 - low)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped policy loss with optional asymmetric ranges and dual clip.

    Args:
        old_log_prob: log π_old of the sampled tokens. Shape ``(B, T)``, float.
        log_prob: log π_θ of the same tokens (gradients flow through it only).
            Shape ``(B, T)``, float.
        advantages: per-token advantages. Shape ``(B, T)``, float.
        response_mask: bool or 0/1, shape ``(B, T)``; values under 0 are ignored
            (NaN/inf there never reach the loss, metrics or gradients).
        loss_agg_mode: see :func:`rlmath.agg_loss`.
        clip_ratio: ε, the default for both ``clip_ratio_low`` and ``clip_ratio_high``.
        clip_ratio_low, clip_ratio_high: ε_low, ε_high (>= 0); the band is
            ``[1 − ε_low, 1 + ε_high]``.
        clip_ratio_c: dual-clip constant c (> 1), applied only where A < 0.
            ``None`` disables dual clip.
        rollout_is_weights: optional detached per-token weights (``(B, T)``)
            multiplying the per-token loss, e.g. from :func:`rlmath.rollout_correction`.
        **aggregation: ``global_num_tokens``, ``global_num_seqs``, ``dp_size``,
            ``norm_length`` (:class:`rlmath.AggregationKwargs`, or ``**info`` from
            :func:`rlmath.global_batch_info`), forwarded to :func:`rlmath.agg_loss`
            (exact data-parallel aggregation).
        log_ratio_clamp: the log-ratio is clamped to ±this before ``exp``.

    Returns:
        ``(loss, metrics)``: 0-d fp32 loss (fp64 for fp64 inputs) and a dict of
        detached 0-d tensors (``pg_clipfrac``, ``pg_clipfrac_high``,
        ``pg_clipfrac_low``, ``pg_clipfrac_lower`` = dual-clip fraction,
        ``ppo_kl``, ``log_ratio_clamped_frac``).
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    low, high = clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None:
        clip_ratio_c = check_in_range("clip_ratio_c", clip_ratio_c, 1.0, None, low_inclusive=False)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    ratio, adv = inp.ratio, inp.advantages
    r = ratio.detach()
    negative = adv < 0
    # ppo_clip_regions, sharing A < 0 with the dual clip.
    clipped_high = (adv > 0) & (r > 1 + high)
    clipped_low = negative & (r < 1 - low)
    neg_adv = -adv
    loss_mat = torch.where(
        clipped_high | clipped_low, neg_adv * ratio.clamp(1 - low, 1 + high), neg_adv * ratio
    )
    dual = None
    if clip_ratio_c is not None:
        dual = negative & (r > clip_ratio_c)
        loss_mat = torch.where(dual, neg_adv * clip_ratio_c, loss_mat)
    # Every term is a product with the masked advantage: ±0 wherever the mask is 0.
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg, masked=True)
    metrics = policy_metrics(
        inp, clipped_high=clipped_high, clipped_low=clipped_low, clipped_lower=dual, masked=True
    )
    return loss, metrics
