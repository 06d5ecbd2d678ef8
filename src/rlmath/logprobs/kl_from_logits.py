"""Exact ("full") per-token KL divergence between two categorical distributions over the vocabulary."""

from __future__ import annotations

import math
from typing import cast

import torch

from rlmath._validation import check_same_shape
from rlmath.logprobs._inputs import check_logits, compute_dtype, normalize_temperature
from rlmath.logprobs.chunking import resolve_chunk_size
from rlmath.logprobs.dispatch import get_kernel

__all__ = ["kl_from_logits"]


def kl_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
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
    ``+inf``.

    Args:
        logits: ``(..., V)`` policy logits, any floating dtype and strides.
        ref_logits: ``(..., V)`` reference logits, same shape (dtype may differ).
        temperature: float > 0 or tensor broadcastable to ``logits.shape[:-1]``.
        chunk_size: rows per chunk (``None``: chosen from V).
        validate: check a tensor temperature is positive (a host sync).

    Returns:
        ``logits.shape[:-1]``, fp32 (fp64 if either input is fp64);
        differentiable w.r.t. ``logits`` (``p·(log p - log q - KL)/T``) and,
        when it requires grad, ``ref_logits`` (``(q - p)/T``).
    """
    logits = check_logits("logits", logits)
    ref_logits = check_logits("ref_logits", ref_logits)
    check_same_shape("ref_logits", ref_logits, "logits", logits)
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits is on {ref_logits.device} but logits is on {logits.device}")
    batch = tuple(logits.shape[:-1])
    temp = normalize_temperature(
        temperature, batch, compute_dtype(logits, ref_logits), logits.device, validate=validate
    )
    chunk = resolve_chunk_size(
        chunk_size, logits.shape[-1], math.prod(logits.shape[:-1]), device=logits.device
    )
    kernel = get_kernel("kl", logits)
    kl = cast(torch.Tensor, kernel(logits, ref_logits, temp, chunk))
    return kl.view(batch)
