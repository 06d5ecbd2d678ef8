"""Exact ("full") per-token KL divergence between two categorical distributions over the vocabulary."""

from __future__ import annotations

import torch

from rlmath.engine import api
from rlmath.engine.config import VocabParallel

__all__ = ["kl_from_logits"]


def kl_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """``KL(π ‖ π_ref) = Σ_v π_v (log π_v - log π_ref,v)`` per row, over the whole vocabulary.

    ``π = softmax(logits / T)`` and ``π_ref = softmax(ref_logits / T)`` (the
    same temperature for both, as in verl). This is the exact KL that the
    sampled estimators k1/k2/k3 approximate (verl names it ``"full"`` but does
    not implement it). Chunked like :func:`log_probs_from_logits`: no
    ``(N, V)`` temporary, backward recomputes each chunk. The value is ≥ 0
    (rounding is clamped); vocabulary entries with ``π_v = 0`` (``-inf``
    logits) contribute 0, entries where only ``π_ref`` is 0 make the KL
    ``+inf``. Over a vocabulary split over processes (``vocab_parallel``) the
    shards' KLs and probability masses combine by the chain rule of the KL
    (``Σ_k π_k·KL_k + Σ_k π_k·log(π_k/ρ_k)``), so a small KL keeps its accuracy.

    Args:
        logits: ``(..., V)`` policy logits, any floating dtype and strides, or a
            DTensor (see :func:`log_probs_from_logits`).
        ref_logits: ``(..., V)`` reference logits, same shape (dtype may differ);
            a DTensor with the placements of ``logits``, or a plain tensor of
            the global values.
        temperature: float > 0 or tensor broadcastable to ``logits.shape[:-1]``.
        vocab_size, vocab_parallel: the real tokens of the whole vocabulary and
            this rank's shard of it, as in :func:`log_probs_from_logits`.
        chunk_size: rows per chunk (``None``: chosen from V).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check a tensor temperature is positive (a host sync; with
            ``vocab_parallel``, that every rank passes the same rows).

    Returns:
        ``logits.shape[:-1]``, fp32 (fp64 if either input is fp64);
        differentiable w.r.t. ``logits`` (``p·(log p - log q - KL)/T``) and,
        when it requires grad, ``ref_logits`` (``(q - p)/T``).
    """
    return api.kl(  # type: ignore[no-any-return]
        logits, ref_logits, temperature=temperature, chunk_size=chunk_size, backend=backend,
        validate=validate, vocab_size=vocab_size, vocab_parallel=vocab_parallel,
    )  # fmt: skip
