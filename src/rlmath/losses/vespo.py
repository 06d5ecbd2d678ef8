"""Variational Sequence-level Soft Policy Optimization (VESPO, https://arxiv.org/abs/2602.10693).

VESPO replaces PPO's hard clip by a smooth weight of the *sequence*
importance ratio ``w_i = Π_t π_θ(y_{i,t})/π_old(y_{i,t})``, a Gamma-shaped
function normalised to ``φ(1) = 1``:

    φ(w) = e^λ · w^k · e^{−λ w} = exp(λ + k·log w − λ·w)

with ``(k, λ) = (k_pos, λ_pos)`` where ``A ≥ 0`` and ``(k_neg, λ_neg)``
otherwise. ``w^k`` damps sequences the current policy has made unlikely
(``w < 1``), ``e^{−λ w}`` those it has made much likelier (``w > 1``). The
weight is detached and scales the policy gradient of every token:

    l_{i,t} = −sg(φ(w_i)) · A_{i,t} · log π_θ(y_{i,t})

As in TRL's ``loss_type="vespo"``, ``log w`` is the sum of the clamped
(±``log_ratio_clamp``) token log-ratios over the valid tokens, optionally
plus the log of token-level rollout importance ratios (``π_old/μ`` from a
vLLM-style engine, folded into ``w`` instead of multiplying the loss), and is
clamped to ``[log 1e-8, 20]`` before ``φ`` is evaluated in log space.
"""

from __future__ import annotations

import math

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range, check_same_shape, check_tensor
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_vespo", "vespo_weight"]

_LOG_W_MIN = math.log(1e-8)
_LOG_W_MAX = 20.0


def vespo_weight(
    log_w: torch.Tensor,
    advantages: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """``φ(w) = exp(λ + k log w − λ w)`` for ``log w`` clamped to ``[log 1e-8, 20]``, detached.

    Shapes: ``log_w`` and ``advantages`` broadcastable; the sign of the
    advantage picks ``(k, λ)`` (``A ≥ 0``: the ``_pos`` pair). ``λ`` below
    1e-4 is raised to 1e-4. The clamp keeps ``φ`` finite; NaN stays NaN.
    """
    for name, value in (("k_pos", k_pos), ("k_neg", k_neg)):
        check_in_range(name, value, 0.0, None)
    for name, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        check_in_range(name, value, 0.0, None)
    log_w = log_w.detach().clamp(_LOG_W_MIN, _LOG_W_MAX)
    nonneg = advantages.detach() >= 0
    k = torch.where(nonneg, log_w.new_full((), k_pos), log_w.new_full((), k_neg))
    lam = torch.where(nonneg, log_w.new_full((), lambda_pos), log_w.new_full((), lambda_neg))
    lam = lam.clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w))


@register_policy_loss("vespo")
def compute_policy_loss_vespo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    importance_sampling_ratio: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO loss (module docstring).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`,
    except ``importance_sampling_ratio``: optional ``(B, T)`` token-level
    ratios ``π_old/μ`` whose logs (valid tokens only, each clamped to
    ``[log 1e-8, 20]``) are added to ``log w``; they do not multiply the loss.
    The sequence weight uses the advantage of each token for its sign
    (outcome advantages are constant within a sequence). Extra metric
    ``vespo_phi_mean``: the mean of ``φ`` over sequences with a valid token.
    ``rollout_is_weights`` multiply the per-token loss, as in every loss.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    seq_log_w = torch.where(inp.valid, inp.clamped_log_ratio.detach(), 0).sum(-1, keepdim=True)
    if importance_sampling_ratio is not None:
        check_tensor("importance_sampling_ratio", importance_sampling_ratio, floating=True)
        check_same_shape(
            "importance_sampling_ratio", importance_sampling_ratio, "log_prob", log_prob
        )
        ratio = torch.where(inp.valid, importance_sampling_ratio.detach().to(seq_log_w.dtype), 1)
        log_is = torch.log(ratio).clamp(_LOG_W_MIN, _LOG_W_MAX)
        seq_log_w = seq_log_w + torch.where(inp.valid, log_is, 0).sum(-1, keepdim=True)
    phi = vespo_weight(
        seq_log_w, inp.advantages, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
        lambda_neg=lambda_neg,
    )  # fmt: skip
    loss_mat = -phi * inp.advantages * inp.log_prob
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    metrics = policy_metrics(inp)
    seq_valid = inp.valid.any(dim=-1)
    seq_phi = inp.mean(phi.expand_as(inp.advantages), axis=-1)
    seq_mean = torch.where(seq_valid, seq_phi, 0).sum() / seq_valid.sum().clamp_min(1)
    metrics["vespo_phi_mean"] = seq_mean.detach()
    return loss, metrics
