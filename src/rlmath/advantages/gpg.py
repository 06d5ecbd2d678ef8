"""GPG: group policy gradient (Chu et al., 2025, arXiv:2504.02546)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_finite_scalar, check_in_range
from rlmath.advantages._common import outcome_inputs
from rlmath.advantages.groups import group_moments
from rlmath.advantages.registry import register_advantage_estimator

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["compute_gpg_outcome_advantage"]


@register_advantage_estimator("gpg")
@torch.no_grad()
@threads_per_call
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float | None = None,
    *,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``α · (s − mean_g) / F_norm``, with ``α = B / #{i : s_i ≠ 0}`` by default.

    The default ``α`` rescales the gradient by the fraction of samples that
    carry a non-zero score, as verl computes it (verl ignores its ``alpha``
    argument and always uses this value; here ``alpha=None`` means that, and a
    number is used as given). Singleton and all-equal groups give exactly 0.

    Args:
        token_level_rewards: Shape ``(B, T)``, floating; score = sum over valid tokens.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Group id per sample (tensor, numpy array or list of hashable ids).
        epsilon: Unused; kept for verl's signature.
        f_norm: ``F_norm``, a non-zero finite number.
        alpha: ``α``; None = ``B / max(1, #{s_i ≠ 0})`` (a 0-d tensor, no host sync).
        group: ``torch.distributed`` process group over which the batch is
            split (data parallel, each group of responses on one rank): the
            default ``α`` counts ``B`` and the non-zero scores over all its
            ranks, and every rank must call. ``None`` (default): this
            process's batch only. A given ``alpha`` needs no communication.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 for fp64 rewards), 0 at masked positions.
    """
    epsilon = check_in_range("epsilon", epsilon, 0.0, None)
    norm = check_finite_scalar("f_norm", f_norm)
    if norm == 0:
        raise ValueError("f_norm must be non-zero, got 0")
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    s = x.scores
    if alpha is None:
        counts = torch.stack([s.new_tensor(s.shape[0]), torch.count_nonzero(s).to(s.dtype)])
        if group is not None:
            # Imported here: single-process callers never load torch.distributed code.
            import torch.distributed as dist

            dist.all_reduce(counts, group=group)  # counts is a fresh tensor: no input changes
        scale: torch.Tensor | float = counts[0] / counts[1].clamp(min=1)
    else:
        scale = check_finite_scalar("alpha", alpha)
    scalar = scale * group_moments(s, x.ids).centered / norm
    advantages = x.to_tokens(scalar)
    return advantages, advantages
