"""PPO's clipped value loss (Schulman et al. 2017; the clipped form of OpenAI baselines' PPO2).

    v_clip = clip(vpreds, values − c, values + c)
    loss   = 0.5 · agg(max((vpreds − returns)², (v_clip − returns)²))

``cliprange_value=None`` disables clipping (plain ``0.5·agg((vpreds − returns)²)``).
"""

from __future__ import annotations

import torch

from rlmath._validation import (
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
)
from rlmath.losses.aggregation import Count, agg_loss
from rlmath.masked import masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value-function loss and the fraction of tokens where the clipped term was larger.

    Args:
        vpreds: current value predictions (gradients flow through them).
            Shape ``(B, T)``, float.
        returns: value targets. Shape ``(B, T)``, float.
        values: value predictions of the rollout (the clip centre). Shape ``(B, T)``.
        response_mask: bool or 0/1, shape ``(B, T)``; values under 0 never
            reach the loss, the metric or the gradient.
        cliprange_value: c >= 0, or None for no clipping.
        loss_agg_mode, global_num_tokens, global_num_seqs, dp_size, norm_length:
            see :func:`rlmath.agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: 0-d tensors, fp32 (fp64 for fp64 inputs);
        ``vf_clipfrac`` is detached (0 when clipping is off).
    """
    check_tensor("vpreds", vpreds, floating=True)
    check_tensor("returns", returns, floating=True)
    check_tensor("values", values, floating=True)
    check_same_shape("returns", returns, "vpreds", vpreds)
    check_same_shape("values", values, "vpreds", vpreds)
    check_mask("response_mask", response_mask, "vpreds", vpreds)
    dtype = result_dtype(vpreds, returns, values)
    valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    pred = torch.where(valid, vpreds.to(dtype), 0)
    target = torch.where(valid, returns.detach().to(dtype), 0)
    loss1 = (pred - target).square()
    if cliprange_value is None:
        loss_mat = loss1
        clipfrac = torch.zeros((), dtype=dtype, device=pred.device)
    else:
        c = check_in_range("cliprange_value", cliprange_value, 0.0, None)
        old = torch.where(valid, values.detach().to(dtype), 0)
        loss2 = (torch.clamp(pred, old - c, old + c) - target).square()
        larger = loss2 > loss1
        loss_mat = torch.where(larger, loss2, loss1)
        clipfrac = masked_mean(larger.to(dtype), response_mask).detach()
    loss = 0.5 * agg_loss(
        loss_mat, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        dp_size=dp_size, norm_length=norm_length,
    )  # fmt: skip
    return loss, clipfrac
