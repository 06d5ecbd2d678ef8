"""VAPO's GAE: separate λ for actor and critic, length-adaptive for the actor.

VAPO (Yue et al. 2025, arXiv:2504.05118, §3.2–3.3) keeps GAE but decouples
the two uses of ``λ``:

* the **critic's targets** use ``λ_critic`` (VAPO: 1.0, unbiased Monte-Carlo
  returns for long chains of thought): ``returns = A(λ_critic) + V``;
* the **actor's advantages** use ``λ_actor``, by default length-adaptive per
  response (eq. 7): ``λ_actor = 1 − 1/(α·l)`` with ``l`` the response's number
  of valid tokens and ``α = 0.05``, so that the sum of the GAE weights,
  ``1/(1 − λ)``, grows with the length instead of vanishing for long answers.

As NeMo-RL ships it, ``α·l`` is clamped at 1 from below (a response shorter
than ``1/α`` tokens gets ``λ_actor = 0``, where the formula would go
negative). Both recursions have the multi-turn semantics of
:func:`rlmath.compute_gae_advantage_return` (masked tokens skipped, TD errors
bootstrap from the next valid value), and the advantages are whitened over
the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range, result_dtype, valid_mask
from rlmath.advantages._common import (
    ValidTokens,
    as_unit_scalar,
    check_token_inputs,
    check_token_tensor,
    valid_counts,
    whiten_batch,
)
from rlmath.advantages.gae_scan import gae_scan
from rlmath.advantages.linear_scan import reverse_linear_scan
from rlmath.advantages.registry import register_advantage_estimator

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["compute_vapo_gae_advantage_return", "length_adaptive_lambda"]


def length_adaptive_lambda(
    response_mask: torch.Tensor, *, length_adaptive_alpha: float = 0.05
) -> torch.Tensor:
    """VAPO's ``λ_actor = 1 − 1/max(α·l, 1)`` per response (eq. 7), ``l`` = valid tokens.

    Shape: ``response_mask`` ``(B, T)``; result ``(B,)`` fp64 in ``[0, 1)``.
    ``length_adaptive_alpha`` (α) must be > 0.
    """
    alpha = check_in_range(
        "length_adaptive_alpha", length_adaptive_alpha, 0.0, None, low_inclusive=False
    )
    valid = valid_mask(response_mask)
    return _adaptive(valid_counts(valid), alpha)


def _adaptive(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    scaled = lengths.to(torch.float64) * alpha
    return 1.0 - 1.0 / scaled.clamp(min=1.0)


@register_advantage_estimator("vapo_gae")
@torch.no_grad()
@threads_per_call
def compute_vapo_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float = 1.0,
    *,
    lam_actor: float | None = None,
    length_adaptive_alpha: float | None = 0.05,
    whiten: bool = True,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with ``λ_critic`` for the value targets and ``λ_actor`` for the advantages.

    Args:
        token_level_rewards: Shape ``(B, T)``, floating.
        values: Shape ``(B, T)``, floating; critic values ``V(s_t)``.
        response_mask: Shape ``(B, T)``, bool or 0/1; 1 = valid token.
        gamma: Discount ``γ`` in ``[0, 1]``.
        lam: ``λ_critic`` in ``[0, 1]`` for the returns (VAPO: 1.0).
        lam_actor: a fixed ``λ_actor`` in ``[0, 1]`` (decoupled GAE without
            length adaptation); needs ``length_adaptive_alpha=None``.
        length_adaptive_alpha: ``α > 0`` of ``λ_actor = 1 − 1/max(α·l, 1)``,
            or None to use ``lam_actor`` (or ``lam`` when that is None too,
            which is plain GAE).
        whiten: Whiten the advantages over all valid tokens of the batch.
        group: ``torch.distributed`` process group over which the batch is
            split: the whitening statistics are those of the whole batch.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, fp32 (fp64 when an input
        is fp64), 0 at masked positions (NeMo-RL leaves ``A + V`` there).
        ``returns = A(λ_critic) + V`` before whitening; ``advantages`` are
        ``A(λ_actor)``, whitened when ``whiten``.
    """
    rewards, valid = check_token_inputs(token_level_rewards, response_mask)
    values = check_token_tensor("values", values, rewards)
    g = as_unit_scalar("gamma", gamma)
    lam_critic = as_unit_scalar("lam", lam)
    if lam_actor is not None:
        lam_actor = as_unit_scalar("lam_actor", lam_actor)
        if length_adaptive_alpha is not None:
            raise ValueError(
                "lam_actor and length_adaptive_alpha are exclusive: pass "
                "length_adaptive_alpha=None to use a fixed lam_actor"
            )
    alpha = None
    if length_adaptive_alpha is not None:
        alpha = check_in_range(
            "length_adaptive_alpha", length_adaptive_alpha, 0.0, None, low_inclusive=False
        )
    _, returns = gae_scan(rewards, values, valid, g, g * lam_critic)
    if alpha is None:
        fixed = lam_critic if lam_actor is None else lam_actor
        advantages, _ = gae_scan(rewards, values, valid, g, g * fixed)
    else:
        advantages = _per_row_gae(rewards, values, valid, g, _adaptive(valid_counts(valid), alpha))
    if whiten:
        advantages = whiten_batch(advantages, valid, group=group)
    return advantages, returns


def _per_row_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    gamma: float,
    lam_rows: torch.Tensor,
) -> torch.Tensor:
    """Unwhitened GAE advantages with one ``λ`` per row (``lam_rows``, shape ``(B,)``)."""
    dtype = result_dtype(rewards, values)
    tokens = ValidTokens(valid)
    r_packed, v_packed = tokens.pack(rewards, dtype), tokens.pack(values, dtype)
    length = tokens.length
    # δ[k] = r[k] + γ·V[k+1] − V[k] over the packed valid tokens (column T is 0).
    delta = r_packed.clone()
    delta[:, :length] += gamma * v_packed[:, 1:] - v_packed[:, :length]
    coef = (gamma * lam_rows).to(dtype).unsqueeze(-1)
    return tokens.unpack(reverse_linear_scan(delta, coef))
