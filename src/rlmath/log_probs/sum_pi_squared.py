"""``Σ_v π_v²`` of the policy's distribution at each token, from logits."""

from __future__ import annotations

import torch

from rlmath.engine import api
from rlmath.engine.config import VocabParallel

__all__ = ["sum_pi_squared_from_logits"]


def sum_pi_squared_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """``Σ_v π_v²`` of ``π = softmax(logits / temperature)`` per row.

    The path-variance proxy of the optimal-token-baseline estimator (the
    ``sum_pi_squared`` input of
    :func:`rlmath.advantages.compute_optimal_token_baseline_advantage`),
    computed chunk by chunk as ``Σ e^{2(z-m)} / (Σ e^{z-m})²`` without a
    softmax of the logits' size. A statistic, not differentiable (no autograd
    graph); the input is never modified.

    Args:
        logits: ``(..., V)`` float tensor, any floating dtype and strides.
        temperature: float > 0 or a tensor broadcastable to ``logits.shape[:-1]``.
        vocab_size, vocab_parallel: the real tokens of the whole vocabulary and
            this rank's shard of it, as in
            :func:`~rlmath.log_probs.log_probs_from_logits`.
        chunk_size: rows per chunk (``None``: chosen from V).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check a tensor temperature is positive (a host sync).

    Returns:
        ``logits.shape[:-1]``, fp32 (fp64 for fp64 logits), in ``(0, 1]``.
    """
    return api.sum_pi_squared(
        logits, temperature=temperature, chunk_size=chunk_size, backend=backend, validate=validate,
        vocab_size=vocab_size, vocab_parallel=vocab_parallel,
    )  # fmt: skip
