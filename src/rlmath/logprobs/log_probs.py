"""Per-token log-probabilities of labels (and entropies) from logits, in bounded memory."""

from __future__ import annotations

import math
from typing import cast

import torch

from rlmath.logprobs._inputs import (
    check_logits,
    compute_dtype,
    flatten_labels,
    normalize_temperature,
)
from rlmath.logprobs.chunking import resolve_chunk_size
from rlmath.logprobs.dispatch import get_kernel

__all__ = [
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
    "logprobs_from_logits",
]


def _log_probs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    temperature: float | torch.Tensor,
    chunk_size: int | None,
    validate: bool,
    want_entropy: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    logits = check_logits("logits", logits)
    batch = tuple(logits.shape[:-1])
    lab2d, out_shape = (
        flatten_labels(labels, logits, validate=validate) if labels is not None else (None, ())
    )
    temp = normalize_temperature(
        temperature, batch, compute_dtype(logits), logits.device, validate=validate
    )
    chunk = resolve_chunk_size(
        chunk_size, logits.shape[-1], math.prod(logits.shape[:-1]), device=logits.device
    )
    kernel = get_kernel("log_probs_entropy", logits)
    logp, ent = cast(
        tuple[torch.Tensor, torch.Tensor], kernel(logits, lab2d, temp, want_entropy, chunk, None)
    )
    return (
        logp.view(out_shape) if lab2d is not None else None,
        ent.view(batch) if want_entropy else None,
    )


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    ``logits[..., i, :]`` scores ``labels[..., i]``: there is no shift inside
    (see :func:`log_probs_from_logits_response` for next-token alignment).
    Equivalent to ``log_softmax(logits.float() / temperature, -1).gather(-1, labels)``
    but never materializes an fp32 copy of the logits: rows are processed in
    chunks (upcast to fp32 chunk by chunk), only an fp32 log-sum-exp per row is
    saved, and backward recomputes each chunk and writes its gradient straight
    into the gradient buffer. Nothing is modified in place.

    Args:
        logits: ``(..., V)`` float tensor (fp32, bf16, fp16 or fp64; any strides).
        labels: ``(...)`` integer tensor with one label per row, or ``(..., K)``
            for K candidate labels per row; values in ``[0, V)``.
        temperature: float > 0, or a tensor broadcastable to ``logits.shape[:-1]``
            (e.g. one temperature per sequence). The result equals the call on
            ``logits / temperature`` with temperature 1 (the division is done in
            fp32). A tensor temperature receives no gradient.
        chunk_size: rows per chunk; ``None`` picks one from ``V`` and the number of rows
            (:func:`rlmath.logprobs.chunking.auto_chunk_size`). Changes speed and
            memory only, never the result.
        validate: check that every label lies in ``[0, V)`` (and that a tensor
            temperature is positive) with a clear ``ValueError``; off by default
            because it reads tensor data (a host sync).

    Returns:
        Log-probabilities of shape ``labels.shape``, fp32 (fp64 for fp64 logits).
        Differentiable w.r.t. ``logits``.
    """
    logp, _ = _log_probs_entropy(
        logits,
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        validate=validate,
        want_entropy=False,
    )
    assert logp is not None
    return logp


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    inplace_backward: bool = True,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """verl's spelling of :func:`log_probs_from_logits`, for migration.

    ``inplace_backward`` is accepted for signature compatibility with verl and
    ignored: the backward here always writes the gradient chunk by chunk into
    a single buffer.

    Args:
        logits: ``(..., V)`` float tensor.
        labels: ``(...)`` or ``(..., K)`` integer tensor.
        inplace_backward: ignored.
        temperature, chunk_size, validate: as in :func:`log_probs_from_logits`.

    Returns:
        fp32 (fp64 for fp64 logits) log-probabilities of shape ``labels.shape``.
    """
    del inplace_backward
    return log_probs_from_logits(
        logits, labels, temperature=temperature, chunk_size=chunk_size, validate=validate
    )


def log_probs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Label log-probabilities and the entropy of each row, in one pass over the logits.

    Same as ``(log_probs_from_logits(...), entropy_from_logits(...))`` with the
    same arguments, at the cost of one chunked pass in forward and one in
    backward; both outputs are differentiable and their gradients are summed
    in a single backward pass.

    Args:
        logits: ``(..., V)`` float tensor (any floating dtype and strides).
        labels: ``(...)`` or ``(..., K)`` integer tensor, values in ``[0, V)``.
        temperature, chunk_size, validate: as in :func:`log_probs_from_logits`.

    Returns:
        ``(log_probs, entropy)``: ``labels.shape`` and ``logits.shape[:-1]``,
        fp32 (fp64 for fp64 logits).
    """
    logp, ent = _log_probs_entropy(
        logits,
        labels,
        temperature=temperature,
        chunk_size=chunk_size,
        validate=validate,
        want_entropy=True,
    )
    assert logp is not None and ent is not None
    return logp, ent
