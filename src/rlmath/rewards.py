"""Token-level rewards with an in-reward KL penalty (the PPO-RLHF recipe)."""

from __future__ import annotations

import torch

from rlmath._validation import (
    check_finite_scalar,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.kl import kl_penalty

__all__ = ["compute_rewards"]


def compute_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kl_coef: float | torch.Tensor,
    *,
    estimator: str = "k1",
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``token_level_scores − kl_coef · KL`` per token, with KL from :func:`kl_penalty`.

    ``old_log_prob`` are the rollout policy's log-probs of the sampled tokens
    and ``ref_log_prob`` the reference model's; with the default ``"k1"`` the
    penalty is ``old_log_prob − ref_log_prob`` as in verl's
    ``compute_rewards``. Masked positions are exactly 0 in the result (verl
    leaves the raw score there), and a NaN or inf at a masked position of any
    input changes neither the result nor any gradient.

    Args:
        token_level_scores: reward-model scores per token. Shape ``(B, T)``, float.
        old_log_prob: Shape ``(B, T)``, float.
        ref_log_prob: Shape ``(B, T)``, float.
        kl_coef: β, a finite number ``>= 0`` (Python or numpy; e.g. a KL
            controller's ``.value``) or a float tensor broadcastable to
            ``(B, T)``, a 0-d one included, which stays on the device (no sync).
        estimator: any name of :data:`rlmath.KL_ESTIMATORS` (default ``"k1"``).
        response_mask: None (every position valid) or ``(B, T)`` bool/0-1,
            nonzero = valid.

    Returns:
        Shape ``(B, T)``; fp32, or fp64 if any input is fp64.
    """
    check_tensor("token_level_scores", token_level_scores, floating=True)
    check_tensor("old_log_prob", old_log_prob, floating=True)
    check_tensor("ref_log_prob", ref_log_prob, floating=True)
    check_same_shape("old_log_prob", old_log_prob, "token_level_scores", token_level_scores)
    check_same_shape("ref_log_prob", ref_log_prob, "token_level_scores", token_level_scores)
    if isinstance(kl_coef, torch.Tensor):
        check_tensor("kl_coef", kl_coef, floating=True)
        try:
            torch.broadcast_shapes(kl_coef.shape, token_level_scores.shape)
        except RuntimeError:
            raise ValueError(
                f"kl_coef of shape {tuple(kl_coef.shape)} does not broadcast to "
                f"token_level_scores' shape {tuple(token_level_scores.shape)}"
            ) from None
    else:
        kl_coef = check_finite_scalar("kl_coef", kl_coef)
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef:g}")

    coef_tensors = [kl_coef] if isinstance(kl_coef, torch.Tensor) else []
    dtype = result_dtype(token_level_scores, old_log_prob, ref_log_prob, *coef_tensors)
    scores = token_level_scores.to(dtype)
    old = old_log_prob.to(dtype)
    ref = ref_log_prob.to(dtype)
    valid = None
    if response_mask is not None:
        check_mask("response_mask", response_mask, "token_level_scores", token_level_scores)
        valid = valid_mask(response_mask)
        # Select before any arithmetic so masked NaN/inf cannot reach values or gradients.
        scores = torch.where(valid, scores, 0)

    kl = kl_penalty(old, ref, estimator, response_mask=valid)
    rewards = scores - kl_coef * kl
    if valid is not None:
        rewards = torch.where(valid, rewards, 0)
    return rewards.to(dtype)
