"""Per-token log-probabilities of labels (and entropies) from logits, in bounded memory."""

from __future__ import annotations

import torch

from rlmath.engine import api
from rlmath.engine.config import VocabParallel

__all__ = ["VocabParallel", "log_probs_and_entropy_from_logits", "log_probs_from_logits"]


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int | None = -100,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
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
        logits: ``(..., V)`` float tensor (fp32, bf16, fp16 or fp64; any strides),
            or a DTensor: sharded over the vocabulary (``Shard(-1)``) it runs
            vocabulary-parallel over that mesh dimension's group; replicated or
            sharded over batch dims it runs on each rank's block. The result is
            then a DTensor (see ``docs/logprobs.md``).
        labels: ``(...)`` integer tensor with one label per row, or ``(..., K)``
            for K candidate labels per row; values in ``[0, V)`` or ``ignore_index``
            (any other value gives a NaN log-prob; ``validate=True`` raises).
        temperature: float > 0, or a tensor broadcastable to ``logits.shape[:-1]``
            (e.g. one temperature per sequence). The result equals the call on
            ``logits / temperature`` with temperature 1 (the division is done in
            fp32). A tensor temperature receives no gradient.
        ignore_index: label value of positions to skip (-100, as in HF and
            ``torch.nn.functional.cross_entropy``): they get log-prob 0 and no
            gradient; a row whose labels are all ignored is never read (NaN
            logits or a zero temperature there are harmless). ``None``: no label
            is skipped.
        vocab_size: the number of real tokens of the whole vocabulary: columns
            from it on are padding (a vocabulary padded to a multiple of 128,
            say), left out of the softmax without a copy and given a zero
            gradient. ``None``: every column is a token.
        vocab_parallel: ``logits`` holds this rank's columns of a vocabulary
            split over a process group (:class:`VocabParallel`: the group, this
            rank's first token id); the result is over the whole vocabulary,
            the same on every rank, and the gradient is this rank's columns of
            the whole gradient. ``None``: ``logits`` holds the whole vocabulary.
        chunk_size: rows per chunk; ``None`` picks one from ``V``, the number of rows
            and the device (:func:`rlmath.engine.policy.auto_chunk_size`). Changes
            speed and memory only, never the result.
        backend: ``"auto"`` (the best available for the input), ``"torch"`` (pure
            PyTorch, every device) or ``"triton"`` (CUDA kernels, when installed).
        validate: check that every label lies in ``[0, V)`` or is ``ignore_index``
            (and that a tensor temperature is positive; with ``vocab_parallel``,
            that every rank passes the same rows and labels) with a clear
            ``ValueError``; off by default because it reads tensor data (a host
            sync).

    Returns:
        Log-probabilities of shape ``labels.shape``, fp32 (fp64 for fp64 logits).
        Differentiable w.r.t. ``logits`` (first order).
    """
    logp, _ = api.log_probs_entropy(
        logits, labels, temperature=temperature, want_entropy=False, ignore_index=ignore_index,
        chunk_size=chunk_size, backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel,
    )  # fmt: skip
    return logp


def log_probs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int | None = -100,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Label log-probabilities and the entropy of each row, in one pass over the logits.

    Same as ``(log_probs_from_logits(...), entropy_from_logits(...))`` with the
    same arguments, at the cost of one chunked pass in forward and one in
    backward; both outputs are differentiable and their gradients are summed
    in a single backward pass. A row whose labels are all ``ignore_index`` has
    entropy 0 as well (it is not computed at all).

    Args:
        logits: ``(..., V)`` float tensor (any floating dtype and strides) or a
            DTensor (as in :func:`log_probs_from_logits`).
        labels: ``(...)`` or ``(..., K)`` integer tensor, values in ``[0, V)``
            or ``ignore_index``.
        temperature, ignore_index, vocab_size, vocab_parallel, chunk_size, backend, validate:
            as in :func:`log_probs_from_logits`.

    Returns:
        ``(log_probs, entropy)``: ``labels.shape`` and ``logits.shape[:-1]``,
        fp32 (fp64 for fp64 logits).
    """
    return api.log_probs_entropy(  # type: ignore[no-any-return]
        logits, labels, temperature=temperature, want_entropy=True, ignore_index=ignore_index,
        chunk_size=chunk_size, backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel,
    )  # fmt: skip
