"""Kimi k1.5's policy-mirror-descent loss (Kimi Team 2025, https://arxiv.org/abs/2501.12599, eq. 3).

Kimi k1.5 regresses the reward on a τ-scaled log-ratio against the sampling
policy; its gradient for each sample ``y_j`` is

    ∇log π_θ(y_j)·(r_j − r̄) − (τ/2) ∇(log π_θ(y_j)/π_old(y_j))²

which is the gradient of the per-sample loss
``−(r − r̄)·log π_θ(y) + (τ/2)·(log π_θ(y) − log π_old(y))²``. The penalty
acts on the whole response's log-ratio, the sum ``S = Σ_t log r_t`` of its
tokens' (``penalty_level="sequence"``, the paper). ROLL's
``pg_variant="kimi15"`` (and verl's ``dro`` loss) square each token's
log-ratio instead, ``(τ/2)·Σ_t (log r_t)²`` (``penalty_level="token"``, the
default, the form the frameworks ship).

Per token, with ``A`` the advantage (``r − r̄``):

    token:     l_t = −A_t·log π_t + (τ/2)·(log r_t)²
    sequence:  l_t = −A_t·log π_t + (τ/2)·sg(S)·(2·log r_t − sg(log r_t))

The sequence form's tokens sum to ``(τ/2)·S²`` and their gradient to
``τ·S·∇S``, the paper's penalty and its gradient, so any aggregation that
sums a sequence's tokens (the default ``seq-mean-token-sum``, the paper's
``(1/k) Σ_j``) gives eq. 3 exactly. The log-ratios in the penalty are the raw
ones (unclamped, like ``dro``): the penalty's pull grows with the drift.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_choice, check_in_range
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["KIMI15_PENALTY_LEVELS", "compute_policy_loss_kimi15"]

#: Accepted values of ``penalty_level``.
KIMI15_PENALTY_LEVELS: tuple[str, ...] = ("token", "sequence")


@register_policy_loss("kimi15")
def compute_policy_loss_kimi15(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "seq-mean-token-sum",
    tau: float = 0.1,
    penalty_level: str = "token",
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Kimi k1.5's loss (module docstring).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``tau`` (τ > 0, ROLL's ``kimi15_tau`` default 0.1) weighs the squared
    log-ratio; ``penalty_level`` is ``"token"`` (ROLL, verl's ``dro`` with
    ``dro_beta = τ``) or ``"sequence"`` (the paper). Extra metric
    ``kimi15_penalty_mean``: the mean over valid tokens of the penalty term.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    tau = check_in_range("tau", tau, 0.0, None, low_inclusive=False)
    check_choice("penalty_level", penalty_level, KIMI15_PENALTY_LEVELS)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    lr = inp.log_ratio
    if penalty_level == "token":
        penalty = 0.5 * tau * lr.square()
    else:
        seq = (torch.where(inp.valid, lr, 0) * inp.weights).sum(-1, keepdim=True).detach()
        penalty = 0.5 * tau * seq * (2 * lr - lr.detach())
    loss_mat = -inp.advantages * inp.log_prob + penalty
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    metrics = policy_metrics(inp)
    metrics["kimi15_penalty_mean"] = inp.mean(penalty.detach()).detach()
    return loss, metrics
