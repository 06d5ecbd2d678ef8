"""Entropy bonus: the aggregated per-token entropy of the policy's distribution."""

from __future__ import annotations

import torch

from rlmath._validation import check_in_range, check_mask, check_tensor
from rlmath.logprobs.entropy import entropy_from_logits
from rlmath.losses.aggregation import Count, agg_loss

__all__ = ["compute_entropy_loss"]


def compute_entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    temperature: float = 1.0,
    sanitize_logits: bool = True,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> torch.Tensor:
    """``agg(H(softmax(logits / temperature)))`` over the valid tokens.

    Args:
        logits: shape ``(B, T, V)``, any float dtype (bf16 is not upcast as a
            whole: the entropy is computed in fp32 chunk by chunk).
        response_mask: bool or 0/1, shape ``(B, T)``.
        loss_agg_mode, global_num_tokens, global_num_seqs, dp_size, norm_length:
            see :func:`rlmath.agg_loss`.
        temperature: the sampling temperature (> 0).
        sanitize_logits: replace the logits of masked rows by 0 first, so that
            NaN/inf there cannot reach the gradient. This costs one copy of
            ``logits``; pass False when masked rows are known to be finite.

    Returns:
        0-d tensor, fp32 (fp64 for fp64 logits). Subtract ``coef ·`` it from
        the policy loss to encourage exploration.
    """
    check_tensor("logits", logits, floating=True)
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (*, T, V), got {tuple(logits.shape)}")
    check_mask("response_mask", response_mask, "logits[..., 0]", logits[..., 0])
    temperature = check_in_range("temperature", temperature, 0.0, None, low_inclusive=False)
    if sanitize_logits:
        valid = response_mask if response_mask.dtype == torch.bool else response_mask != 0
        logits = torch.where(valid.unsqueeze(-1), logits, 0)
    entropy = entropy_from_logits(logits, temperature=float(temperature))
    return agg_loss(
        entropy, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
        dp_size=dp_size, norm_length=norm_length,
    )  # fmt: skip
