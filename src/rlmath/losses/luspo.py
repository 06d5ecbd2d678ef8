"""Length-Unbiased Sequence Policy Optimization (Liu et al. 2026, https://arxiv.org/abs/2602.05261).

GSPO averages each sequence's clipped objective over its tokens, which
favours short answers (their per-token weight is larger), and its length
collapses. LUSPO scales each sequence's GSPO loss by its length ``|y_i|``:

    L = (1/G) Σ_i |y_i| · l_i^GSPO

With the GSPO-token construction of :func:`rlmath.compute_policy_loss_gspo`
(one value ``l_i`` on every token of the sequence, the sequence-level
gradient), ``|y_i|·l_i`` is the sum of the sequence's per-token losses, so
LUSPO is GSPO aggregated with ``seq-mean-token-sum``: that is its default
mode here, and TRL's ``loss_type="luspo"`` (``mean_i(|y_i|·l_i)``, with
``importance_sampling_level="sequence"``). Another ``loss_agg_mode`` is
honoured as given (``seq-mean-token-mean`` gives back GSPO).
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.gspo import compute_policy_loss_gspo
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_luspo"]


@register_policy_loss("luspo")
def compute_policy_loss_luspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-sum",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """LUSPO: GSPO(-token) with each sequence's loss weighted by its length.

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_gspo`;
    the default aggregation is ``seq-mean-token-sum`` (the paper's
    ``(1/G) Σ_i |y_i|·l_i``). Rows without a valid token never count (TRL
    counts them in ``G``).
    """
    return compute_policy_loss_gspo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        rollout_is_weights=rollout_is_weights, log_ratio_clamp=log_ratio_clamp, **aggregation,
    )  # fmt: skip
