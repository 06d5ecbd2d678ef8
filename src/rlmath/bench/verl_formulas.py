"""verl's formulas as straightforward torch code, for the small-call benchmark.

Each function computes what the verl function of the same name computes
(verl 0.8/0.9: ``verl.trainer.ppo.core_algos`` and
``verl.utils.torch_functional``), op for op, so that a ratio in
``rlmath bench small`` compares rlmath with the code a verl user runs
today, also where verl itself is not installed. Differences in semantics
(verl's ``+ 1e-8`` in the denominators, its ``torch.std`` of a group,
no masking of NaN under the mask) are verl's and kept; the numbers each
function returns are close to rlmath's on the benchmark's inputs, which are
finite.

:func:`find_verl` returns verl's own functions where ``import verl``
works, for the table's second reference column.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "agg_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "entropy_from_logits",
    "find_verl",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """``Σ mask·values``, NaN under the mask selected out first."""
    valid = torch.where(mask.bool(), values, 0.0)
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """``Σ mask·values / (Σ mask + 1e-8)``."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def _masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    # verl raises for a mask sum of 0 or 1: a host read of the count.
    if mask_sum == 0 or mask_sum == 1:
        raise ValueError("at least two elements of the mask must be 1")
    return variance * (mask_sum / (mask_sum - 1))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """``(values − mean) · rsqrt(var + 1e-8)``, mean and unbiased variance over the mask."""
    mean, var = masked_mean(values, mask), _masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's path without flash-attn (``logprobs_from_logits_v2``).

    fp32/fp64: ``logits[label] − logsumexp`` with a loop over the rows for the
    log-sum-exp; other dtypes: ``log_softmax`` row by row, in the input dtype.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    out = []
    for row, label in zip(logits, labels, strict=True):
        out.append(F.log_softmax(row, dim=-1).gather(-1, label.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(z) − Σ softmax(z)·z`` in the input dtype."""
    pd = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> torch.Tensor:
    """verl's aggregation of a ``(B, T)`` loss matrix."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-mean":
        seq_tokens = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_tokens + 1e-8)
        seq_mask = (seq_tokens > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_scale_factor is None:
            loss_scale_factor = loss_mask.shape[-1]
        return torch.sum(seq_losses) / loss_scale_factor
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped loss with dual clip, and its three metrics (as tensors: no ``.item()``)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }
    return pg_loss, metrics


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss and the clipped fraction."""
    clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """``agg_loss`` of :func:`entropy_from_logits`."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The per-token KL estimators (``+``: k2's gradient with the estimator's value)."""
    if kl_penalty in ("kl", "k1"):
        value = logprob - ref_logprob
    elif kl_penalty == "abs":
        value = (logprob - ref_logprob).abs()
    elif kl_penalty in ("mse", "k2"):
        value = 0.5 * (logprob - ref_logprob).square()
    elif kl_penalty.removesuffix("+") in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        value = torch.clamp((torch.exp(kl) - kl - 1).contiguous(), min=-10, max=10)
    else:
        raise NotImplementedError(kl_penalty)
    if not kl_penalty.endswith("+"):
        return value
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + value.detach()


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE as a backward loop over the tokens, skipping masked ones; whitened advantages."""
    with torch.no_grad():
        nextvalues: Any = 0
        lastgaelam: Any = 0
        reversed_advantages = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            step = delta + gamma * lam * lastgaelam
            m = response_mask[:, t]
            nextvalues = values[:, t] * m + (1 - m) * nextvalues
            lastgaelam = step * m + (1 - m) * lastgaelam
            reversed_advantages.append(lastgaelam)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        return masked_whiten(advantages, response_mask), returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each response's score less its group's mean, over the group's ``torch.std``."""
    scores = token_level_rewards.sum(dim=-1)
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    mean: dict[Any, torch.Tensor] = {}
    std: dict[Any, torch.Tensor] = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            groups[index[i]].append(scores[i])
        for key, members in groups.items():
            if len(members) == 1:
                mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
            else:
                stacked = torch.stack(members)
                mean[key], std[key] = torch.mean(stacked), torch.std(stacked)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def find_verl() -> dict[str, Callable[..., Any]]:
    """verl's own functions by the names above, where ``import verl`` works (else empty)."""
    try:
        from verl.trainer.ppo import core_algos  # type: ignore[import-not-found]
        from verl.utils import torch_functional as vf  # type: ignore[import-not-found]
    except Exception:
        return {}
    found: dict[str, Callable[..., Any]] = {}
    for name in ("agg_loss", "compute_gae_advantage_return", "compute_grpo_outcome_advantage",
                 "compute_value_loss", "compute_entropy_loss", "kl_penalty"):  # fmt: skip
        if hasattr(core_algos, name):
            found[name] = getattr(core_algos, name)
    for name in ("logprobs_from_logits", "entropy_from_logits", "masked_mean", "masked_whiten"):
        if hasattr(vf, name):
            found[name] = getattr(vf, name)
    return found
