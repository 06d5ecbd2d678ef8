"""prime-rl's ``ipo`` loss: a symmetric trust region on the probability difference.

prime-rl (``IPOLossConfig``) masks the policy-gradient term of every token
whose probability moved more than ``ipo_threshold`` in absolute terms since
it was sampled, whichever the direction, and regularises every token with the
squared log-ratio (the Kimi-K2.5 KL term it shares with its default loss):

    keep = |π_θ(y_t) − π_old(y_t)| ≤ ipo_threshold         (detached)
    l = −keep · adv_tau · A · r + kl_tau · (log r)²,          r = π_θ/π_old

The surrogate ``A·r`` keeps the gradient of the importance ratio
(``A·r·∇log π``), unlike DPPO's truncated weight. Probabilities come from
log-probs clamped at 0, the ratio from the log-ratio clamped to
``±log_ratio_clamp`` (prime-rl clamps neither); the penalty uses the raw
log-ratio. prime-rl normalises by the global count of trained tokens, the
default ``token-mean`` here.
"""

from __future__ import annotations

import torch

from rlmath._typing import Unpack
from rlmath._validation import check_in_range
from rlmath.losses._policy_inputs import check_loss_args, policy_metrics, prepare_policy_inputs
from rlmath.losses.aggregation import AggregationKwargs
from rlmath.losses.registry import register_policy_loss

__all__ = ["compute_policy_loss_ipo"]


@register_policy_loss("ipo")
def compute_policy_loss_ipo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    ipo_threshold: float = 0.1,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    rollout_is_weights: torch.Tensor | None = None,
    log_ratio_clamp: float = 20.0,
    **aggregation: Unpack[AggregationKwargs],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """prime-rl's IPO loss (module docstring).

    Arguments, shapes and returns as :func:`rlmath.compute_policy_loss_vanilla`;
    ``old_log_prob`` is the sampling policy's log-prob (prime-rl's inference
    log-probs). ``ipo_threshold`` (>= 0), ``adv_tau`` (>= 0) and ``kl_tau``
    (>= 0) have prime-rl's defaults. ``pg_clipfrac_high``/``_low`` are the
    fractions of A > 0 / A < 0 tokens outside the trust region (their policy
    gradient removed); ``ipo_masked_frac`` counts every masked token.
    """
    agg = check_loss_args(loss_agg_mode, aggregation)
    threshold = check_in_range("ipo_threshold", ipo_threshold, 0.0, None)
    adv_tau = check_in_range("adv_tau", adv_tau, 0.0, None)
    kl_tau = check_in_range("kl_tau", kl_tau, 0.0, None)
    inp = prepare_policy_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        log_ratio_clamp=log_ratio_clamp,
    )  # fmt: skip
    p = torch.exp(inp.log_prob.detach().clamp(max=0))
    p_old = torch.exp(inp.old_log_prob.clamp(max=0))
    # "Not outside" so that a NaN on a valid token keeps its (NaN) term visible.
    keep = ~((p - p_old).abs() > threshold)
    adv = inp.advantages
    policy = torch.where(keep, -adv_tau * adv * inp.ratio, 0)
    loss_mat = policy + kl_tau * inp.log_ratio.square()
    loss = inp.aggregate(loss_mat, loss_agg_mode, agg)
    metrics = policy_metrics(inp, clipped_high=~keep & (adv > 0), clipped_low=~keep & (adv < 0))
    metrics["ipo_masked_frac"] = inp.frac(~keep)
    return loss, metrics
