"""Off-policy sequence masking, OPSM (DeepSeek-AI 2025, DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, eq. 9).

A negative-advantage sequence that the current policy has drifted far from
teaches little and destabilises training (its tokens are pushed down where
the policy no longer goes). DeepSeek-V3.2 drops it from the loss:

    δ_i = (1/|o_i|) Σ_t (log π_old(o_t) − log π_θ(o_t))      (a KL estimate, mean over valid tokens)
    M_{i,t} = 0  if  A_{i,t} < 0  and  δ_i > threshold,  else 1

``π_old`` is the policy that *sampled* the tokens (the rollout engine's
log-probs when they are available, so that the training/inference mismatch
counts too), ``π_θ`` the current one (detached). TRL
(``off_policy_mask_threshold``) and slime (``--use-opsm``, ``--opsm-delta``)
multiply the per-token loss by ``M`` and keep their normalisers: pass
``keep`` as (a factor of) ``rollout_is_weights`` for that; putting it into
``response_mask`` instead also removes the dropped tokens from the counts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlmath._validation import (
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)

__all__ = ["OffPolicySequenceMask", "off_policy_sequence_mask"]


class OffPolicySequenceMask(NamedTuple):
    """What :func:`off_policy_sequence_mask` returns.

    ``keep``: bool ``(B, T)``, True on the valid tokens that stay in the loss.
    ``sequence_kl``: ``(B,)`` fp32 (fp64 for fp64 inputs), ``δ_i`` (0 for a
    sequence without valid tokens). ``metrics``: detached 0-d tensors
    ``opsm_masked_frac`` (valid tokens dropped), ``opsm_seq_masked_frac``
    (sequences with a valid token that lost one) and ``opsm_sequence_kl_mean``
    (mean ``δ`` over those sequences).
    """

    keep: torch.Tensor
    sequence_kl: torch.Tensor
    metrics: dict[str, torch.Tensor]


def off_policy_sequence_mask(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    threshold: float,
) -> OffPolicySequenceMask:
    """DeepSeek-V3.2's off-policy sequence mask (module docstring).

    Args:
        old_log_prob: log-probs of the sampling policy (rollout engine, or
            π_old). Shape ``(B, T)``, float.
        log_prob: the current policy's log-probs (read detached). ``(B, T)``.
        advantages: ``(B, T)`` (or ``(B, 1)``, one per sequence), float.
        response_mask: bool or 0/1 (or weights), ``(B, T)``; values under 0
            never count (NaN there is ignored).
        threshold: δ, a finite number ``>= 0`` (TRL's example: 0.5).

    Returns:
        :class:`OffPolicySequenceMask`; nothing is read on the host.
    """
    check_tensor("old_log_prob", old_log_prob, floating=True)
    check_tensor("log_prob", log_prob, floating=True)
    check_tensor("advantages", advantages, floating=True)
    check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
    check_mask("response_mask", response_mask, "log_prob", log_prob)
    if log_prob.dim() == 0:
        raise ValueError("log_prob must have at least one dimension (tokens), got a 0-d tensor")
    if advantages.shape != log_prob.shape and advantages.shape != (*log_prob.shape[:-1], 1):
        raise ValueError(
            f"advantages must have the shape of log_prob {tuple(log_prob.shape)} or "
            f"{(*log_prob.shape[:-1], 1)}, got {tuple(advantages.shape)}"
        )
    threshold = check_in_range("threshold", threshold, 0.0, None)
    dtype = result_dtype(old_log_prob, log_prob, advantages)
    valid = valid_mask(response_mask)
    weights = torch.where(valid, response_mask.to(dtype), 0)
    kl = torch.where(valid, old_log_prob.detach().to(dtype) - log_prob.detach().to(dtype), 0)
    count = weights.sum(-1)
    live = count > 0
    seq_kl = (kl * weights).sum(-1) / torch.where(live, count, 1)
    adv = torch.where(valid, advantages.detach().to(dtype).expand_as(kl), 0)
    dropped = valid & (adv < 0) & (seq_kl.unsqueeze(-1) > threshold)
    keep = valid & ~dropped
    n_tokens = weights.sum()
    n_seqs = live.sum().to(dtype)
    hit = dropped.any(dim=-1)
    metrics = {
        "opsm_masked_frac": (dropped.to(dtype) * weights).sum()
        / torch.where(n_tokens > 0, n_tokens, 1),
        "opsm_seq_masked_frac": hit.sum().to(dtype) / n_seqs.clamp(min=1),
        "opsm_sequence_kl_mean": torch.where(live, seq_kl, 0).sum() / n_seqs.clamp(min=1),
    }
    return OffPolicySequenceMask(keep, seq_kl, {k: v.detach() for k, v in metrics.items()})
