"""PPO's clipped value loss (Schulman et al. 2017; the clipped form of OpenAI baselines' PPO2).

    v_clip = clip(vpreds, values − c, values + c)
    loss   = 0.5 · agg(max((vpreds − returns)², (v_clip − returns)²))

``cliprange_value=None`` disables clipping (plain ``0.5·agg((vpreds − returns)²)``).
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._valid_select import where_valid
from rlmath._validation import (
    as_dtype,
    check_choice,
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.losses.aggregation import LOSS_AGG_MODES, Aggregation, AggregationKwargs, aggregate

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value-function loss, and the fraction of tokens where the clipped term was larger.

    Args:
        vpreds: current value predictions (gradients flow through them).
            Shape ``(B, T)``, float.
        returns: value targets. Shape ``(B, T)``, float.
        values: value predictions of the rollout (the clip centre). Shape ``(B, T)``.
        response_mask: bool or 0/1, shape ``(B, T)``; values under 0 never
            reach the loss, the metric or the gradient.
        cliprange_value: c >= 0, or None for no clipping.
        loss_agg_mode: see :func:`rlmath.agg_loss`.
        **aggregation: ``global_num_tokens``, ``global_num_seqs``, ``dp_size``,
            ``norm_length`` (:class:`rlmath.losses.aggregation.Aggregation`).

    Returns:
        ``(loss, metrics)``: the 0-d loss, fp32 (fp64 for fp64 inputs), and
        ``{"vf_clipfrac": ...}``, the fraction of valid tokens whose clipped
        term was the larger (a detached 0-d tensor; 0 when clipping is off).
    """
    check_tensor("vpreds", vpreds, floating=True)
    check_tensor("returns", returns, floating=True)
    check_tensor("values", values, floating=True)
    check_same_shape("returns", returns, "vpreds", vpreds)
    check_same_shape("values", values, "vpreds", vpreds)
    check_mask("response_mask", response_mask, "vpreds", vpreds)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    agg = Aggregation.of(aggregation)
    dtype = result_dtype(vpreds, returns, values)
    bool_mask = response_mask.dtype == torch.bool
    valid = valid_mask(response_mask)
    weight = None if bool_mask else where_valid(valid, response_mask.to(dtype))
    pred = where_valid(valid, as_dtype(vpreds, dtype))
    target = where_valid(valid, as_dtype(returns.detach(), dtype))
    loss1 = (pred - target).square()
    count: torch.Tensor | None = None  # valid tokens of a bool mask, counted once
    if cliprange_value is None:
        loss_mat = loss1
        clipfrac = torch.zeros((), dtype=dtype, device=pred.device)
    else:
        c = check_in_range("cliprange_value", cliprange_value, 0.0, None)
        old = where_valid(valid, as_dtype(values.detach(), dtype))
        loss2 = (torch.clamp(pred, old - c, old + c) - target).square()
        # Both terms are 0 where the mask is 0: larger is False there.
        larger = loss2 > loss1
        loss_mat = torch.where(larger, loss2, loss1)
        if weight is None:
            count = _token_count(valid, dtype)
            clipfrac = torch.count_nonzero(larger) / count
        else:
            n = weight.sum()
            clipfrac = ((larger.to(dtype) * weight).sum() / torch.where(n == 0, 1.0, n)).detach()
    if (
        weight is None
        and loss_agg_mode == "token-mean"
        and agg.global_num_tokens is None
        and agg.dp_size == 1
    ):
        # aggregate's token mean: loss_mat is already 0 wherever the mask is 0.
        if count is None:
            count = _token_count(valid, dtype)
        return 0.5 * (loss_mat.sum() / count), {"vf_clipfrac": clipfrac}
    loss = 0.5 * aggregate(loss_mat, valid, weight, loss_agg_mode, agg)
    return loss, {"vf_clipfrac": clipfrac}


def _token_count(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The number of valid tokens (1 if there is none) in ``dtype``: exact."""
    return valid.sum().clamp_min(1).to(dtype)
