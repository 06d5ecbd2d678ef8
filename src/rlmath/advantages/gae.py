"""Generalized Advantage Estimation (Schulman et al., 2016, arXiv:1506.02438).

Multi-turn semantics (as verl's): tokens with ``response_mask = 0`` (tool
outputs, observations, padding) are skipped. The recursion runs over the
subsequence of valid tokens, one ``γλ`` step per valid transition, each TD
error bootstraps from the value of the *next valid* token (0 after the last
one), and rewards and values at masked positions are never read.

The vectorized version packs each row's valid tokens to the left (one scatter)
and solves ``A[k] = δ[k] + γλ · A[k+1]`` with the tree scan of
:mod:`rlmath.advantages.scan`: ``O(B·T)`` work, ``O(log T)`` sequential depth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlmath._threads import threads_per_call
from rlmath.advantages._common import (
    as_unit_scalar,
    check_token_inputs,
    check_token_tensor,
    whiten_batch,
)
from rlmath.advantages.gae_scan import gae_scan
from rlmath.advantages.registry import register_advantage_estimator

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["compute_gae_advantage_return"]


@register_advantage_estimator("gae")
@torch.no_grad()
@threads_per_call
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets over the valid tokens of each response.

    ``δ[k] = r[k] + γ·V[k+1] − V[k]`` and ``A[k] = δ[k] + γλ·A[k+1]`` where
    ``k`` runs over the valid tokens of a row in order (``V`` past the last
    valid token is 0). Returns are ``A + V`` before whitening; advantages are
    then whitened over all valid tokens of the batch (masked mean, unbiased
    variance, eps 1e-8) when ``whiten`` is True.

    Unlike verl, advantages and returns are exactly 0 at masked positions
    (verl leaves the carried advantage and ``A + V`` there).

    Args:
        token_level_rewards: Shape ``(B, T)``, floating.
        values: Shape ``(B, T)``, floating; critic values ``V(s_t)``.
        response_mask: Shape ``(B, T)``, bool or 0/1; 1 = valid token.
        gamma: Discount ``γ`` in ``[0, 1]``: a Python or numpy number, or a one-element
            tensor (read once: a host sync on an accelerator).
        lam: GAE ``λ`` in ``[0, 1]``, the same kinds as ``gamma``.
        whiten: Whiten the advantages over the batch (verl always does).
        group: ``torch.distributed`` process group over which the batch is
            split (data parallel): whitening uses the mean and variance of the
            whole batch across its ranks, and every rank must call. ``None``
            (default): this process's batch only.

    Returns:
        ``(advantages, returns)``, each shape ``(B, T)``, fp32 (fp64 when an
        input is fp64), 0 at masked positions. No autograd graph.
    """
    rewards, valid = check_token_inputs(token_level_rewards, response_mask)
    values = check_token_tensor("values", values, rewards)
    g = as_unit_scalar("gamma", gamma)
    gl = g * as_unit_scalar("lam", lam)
    advantages, returns = gae_scan(rewards, values, valid, g, gl)
    if whiten:
        advantages = whiten_batch(advantages, valid, group=group)
    return advantages, returns
