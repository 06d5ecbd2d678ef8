"""VAPO's positive-example language-model loss (Yue et al. 2025, https://arxiv.org/abs/2504.05118, eq. 10).

VAPO adds to its PPO loss the negative log-likelihood of the *correct*
responses of the batch, so that the rare successes on hard prompts are
imitated directly:

    L_NLL = −(1 / Σ_{o ∈ T} |o|) · Σ_{o ∈ T} Σ_t log π_θ(o_t),      L = L_PPO + μ·L_NLL

with ``T`` the correct responses (NeMo-RL: reward > 0) and ``μ = 0.1``. The
normaliser is the number of tokens of the correct responses, not of the
whole batch, so this is not a policy loss of the shared signature: it is an
auxiliary loss like the entropy bonus, aggregated over the positive tokens
with any ``loss_agg_mode`` (``token-mean`` is eq. 10). For exact data
parallelism pass the global counts of the *positive* mask,
``global_batch_info(response_mask * positive[:, None])`` (NeMo-RL divides by
the micro-batch's own count).
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import (
    check_choice,
    check_mask,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.losses.aggregation import LOSS_AGG_MODES, Aggregation, AggregationKwargs, aggregate

__all__ = ["compute_positive_example_nll_loss"]


def compute_positive_example_nll_loss(
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    positive: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``agg(−log π_θ)`` over the valid tokens of the positive (correct) responses.

    Args:
        log_prob: log π_θ of the sampled tokens (gradients flow through it).
            Shape ``(B, T)``, float.
        response_mask: bool or 0/1 (or weights), shape ``(B, T)``.
        positive: which responses are correct: bool or 0/1, shape ``(B,)``
            (one flag per response) or ``(B, T)`` (per token). Detached.
        loss_agg_mode: see :func:`rlmath.agg_loss`; ``token-mean`` is VAPO's.
        **aggregation: the counts of the positive mask for data parallelism
            (module docstring), ``dp_size``, ``norm_length``.

    Returns:
        ``(loss, metrics)``: 0-d fp32 loss (fp64 for fp64 ``log_prob``), 0
        when no valid token is positive; metrics (detached 0-d):
        ``positive_nll`` (mean NLL over the positive tokens of this call) and
        ``positive_token_frac`` (their share of the valid tokens).
    """
    check_tensor("log_prob", log_prob, floating=True)
    check_mask("response_mask", response_mask, "log_prob", log_prob)
    if log_prob.dim() == 0:
        raise ValueError("log_prob must have at least one dimension (tokens), got a 0-d tensor")
    check_tensor("positive", positive, real=True)
    if positive.device != log_prob.device:
        raise ValueError(f"positive is on {positive.device} but log_prob is on {log_prob.device}")
    if positive.shape == log_prob.shape[:-1]:
        positive = positive.unsqueeze(-1)
    elif positive.shape != log_prob.shape:
        raise ValueError(
            f"positive must have shape {tuple(log_prob.shape[:-1])} (one flag per response) or "
            f"{tuple(log_prob.shape)} (per token), got {tuple(positive.shape)}"
        )
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    agg = Aggregation.of(aggregation)
    dtype = result_dtype(log_prob)
    valid = valid_mask(response_mask)
    selected = valid & valid_mask(positive.detach()).expand_as(valid)
    weights = torch.where(selected, response_mask.to(dtype), 0)
    nll = torch.where(selected, -log_prob.to(dtype), 0)
    loss = aggregate(nll, selected, weights, loss_agg_mode, agg)
    count = weights.sum()
    all_weights = torch.where(valid, response_mask.to(dtype), 0).sum()
    metrics = {
        "positive_nll": (nll.detach() * weights).sum() / torch.where(count > 0, count, 1),
        "positive_token_frac": count / torch.where(all_weights > 0, all_weights, 1),
    }
    return loss, {k: v.detach() for k, v in metrics.items()}
