"""Entropy bonus: the aggregated per-token entropy of the policy's distribution."""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import (
    check_choice,
    check_in_range,
    check_mask,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.log_probs.log_probs import log_probs_and_entropy_from_logits
from rlmath.losses.aggregation import LOSS_AGG_MODES, Aggregation, AggregationKwargs, aggregate

_SKIP = -1  # the label of masked positions: the entropy there is never computed

__all__ = ["compute_entropy_loss"]


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    temperature: float = 1.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``agg(H(softmax(logits / temperature)))`` over the valid tokens.

    Args:
        logits: shape ``(B, T, V)``, any float dtype (bf16 is not upcast as a
            whole: the entropy is computed in fp32 chunk by chunk).
        response_mask: bool or 0/1, shape ``(B, T)``.
        loss_agg_mode: see :func:`rlmath.agg_loss`.
        temperature: the sampling temperature (> 0). The logits of masked rows
            are never read (they are skipped as ignored positions of the
            vocabulary engine), so NaN or inf there cannot reach the loss or the
            gradient, without a copy of ``logits``.
        **aggregation: ``global_num_tokens``, ``global_num_seqs``, ``dp_size``,
            ``norm_length`` (:class:`rlmath.losses.aggregation.Aggregation`).

    Returns:
        ``(loss, metrics)``: the 0-d aggregated entropy, fp32 (fp64 for fp64
        logits), and ``{"entropy": ...}``, its detached value. Subtract ``coef ·``
        the loss from the policy loss to encourage exploration.
    """
    check_tensor("logits", logits, floating=True)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (*, T, V), got {tuple(logits.shape)}")
    check_mask("response_mask", response_mask, "logits[..., 0]", logits[..., 0])
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    agg = Aggregation.of(aggregation)
    temperature = check_in_range("temperature", temperature, 0.0, None, low_inclusive=False)
    valid = valid_mask(response_mask)
    labels = torch.where(valid, 0, _SKIP)
    _, entropy = log_probs_and_entropy_from_logits(
        logits, labels, temperature=temperature, ignore_index=_SKIP
    )
    dtype = result_dtype(logits)
    weight = None
    if response_mask.dtype != torch.bool:
        weight = torch.where(valid, response_mask.to(dtype), 0)
    loss = aggregate(entropy, valid, weight, loss_agg_mode, agg)
    return loss, {"entropy": loss.detach()}
