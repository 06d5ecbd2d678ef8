"""Log-probs of the response tokens, from dense or packed (rmpad) next-token logits.

A causal LM's logits at position ``t`` predict the token at ``t + 1``. With
``input_ids = [prompt | response]`` of ``S`` columns and a response of
``R = response_length`` columns at the end (verl's layout), output column
``j`` is the log-prob of the token at column ``S - R + j``.

In packed ("rmpad") form, padding is removed and the valid tokens of all
sequences are concatenated: the logits of a token predict the *next valid token
of the same sequence*. The label is therefore taken within each sequence,
never across the boundary into the next one (verl rolls the packed ids
globally, so the last token of each sequence is scored against the first token
of the next sequence). Only the logit rows that predict a response token are
processed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import torch

from rlmath._validation import check_index_tensor, check_logits, check_tensor
from rlmath.engine import api
from rlmath.engine.config import VocabParallel
from rlmath.engine.truncation import SampledLogProbs

Sampler = Literal["vllm", "sglang", "hf"]
KeptSetArg = torch.Tensor | Sequence[Sequence[int]] | None


def _truncation(
    top_k: object, top_p: object, min_p: object, sampler: object, kept: object, kept_stats: object
) -> dict[str, Any] | None:
    """The truncation keywords for the engine (``None`` when every one is at its default)."""
    args = {
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "sampler": sampler,
        "kept": kept,
        "kept_stats": kept_stats,
    }
    if top_k is top_p is min_p is kept is None and kept_stats is False and sampler == "vllm":
        return None
    return args


__all__ = [
    "log_probs_from_logits_all_rmpad",
    "log_probs_from_logits_response",
    "log_probs_from_logits_response_rmpad",
]


@overload
def log_probs_from_logits_response(
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def log_probs_from_logits_response(
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[True],
) -> SampledLogProbs: ...


def log_probs_from_logits_response(
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    sampler: Sampler = "vllm",
    kept: KeptSetArg = None,
    kept_stats: bool = False,
) -> torch.Tensor | SampledLogProbs:
    """Log-probs of the last ``R = response_length`` tokens from dense logits.

    ``logits[:, t]`` predicts ``input_ids[:, t + 1]``: the result is
    ``log_probs_from_logits(logits[:, -R-1:-1], input_ids[:, -R:])``, computed
    on those rows of ``logits`` in place (no copy, and a backward that
    allocates only the gradient of ``logits``).

    Args:
        input_ids: ``(B, S)`` integer token ids.
        logits: ``(B, S, V)`` float logits of ``input_ids``.
        response_length: ``R``, in ``[1, S - 1]``.
        temperature: float or tensor broadcastable to ``(B, S)`` (the temperature
            of the predicting position).
        vocab_size, vocab_parallel: the real tokens of the whole vocabulary and
            this rank's shard of it (``logits`` then holds this rank's columns), as
            in :func:`~rlmath.log_probs.log_probs_from_logits`.
        chunk_size: rows per chunk (``None``: chosen from V).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check that every response token is a token id (with
            ``vocab_parallel``, also that every rank passes the same tokens) and
            that a tensor temperature is positive, with a ``ValueError`` (a host
            sync). Without it a token that is not an id gives NaN.
        top_k, top_p, min_p, sampler: restrict each response token's softmax to
            the kept set of the rollout's sampler, as in
            :func:`~rlmath.log_probs.log_probs_from_logits`; per-row tensors
            broadcast to ``(B, S)`` and are taken at the predicting position,
            like ``temperature``.
        kept: the rollout's kept set of each response token, replayed: a bool
            mask ``(B, R, V)``, token ids ``(B, R, K)`` padded with -1, or a list of
            ``B·R`` sequences of token ids (row-major).
        kept_stats: return a :class:`~rlmath.log_probs.SampledLogProbs`
            (``outside`` and ``kept_count`` of shape ``(B, R)``, ``entropy`` ``None``).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits). Columns whose token
        is padding hold the log-prob of the pad token; mask them with the
        response mask.
    """
    return api.dense_response_log_probs(
        input_ids, logits, response_length, temperature=temperature, chunk_size=chunk_size,
        backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel,
        truncation=_truncation(top_k, top_p, min_p, sampler, kept, kept_stats),
    )  # fmt: skip


def check_packed_logits(logits_rmpad: object, name: str = "logits_rmpad") -> torch.Tensor:
    """``(nnz, V)`` packed logits (a leading batch dim of 1 is dropped)."""
    x = check_logits(name, logits_rmpad)
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (nnz, V), got {tuple(x.shape)}")
    return x


def check_ids_and_mask(
    input_ids: object, attention_mask: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, S)`` integer ids and a mask of their shape."""
    ids = check_index_tensor("input_ids", input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, S), got {tuple(ids.shape)}")
    mask = check_tensor("attention_mask", attention_mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    if mask.device != ids.device:
        raise ValueError(f"attention_mask is on {mask.device} but input_ids is on {ids.device}")
    return ids, mask


@overload
def log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[True],
) -> SampledLogProbs: ...


def log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    sampler: Sampler = "vllm",
    kept: KeptSetArg = None,
    kept_stats: bool = False,
) -> torch.Tensor | SampledLogProbs:
    """Log-probs of the response tokens from packed logits, shifting within each sequence.

    ``logits_rmpad`` holds one row per valid token of ``input_ids`` in row-major
    order (what ``rlmath.padding.unpad_input`` / flash-attn's ``unpad_input``
    produce). The response token at column ``s`` of sequence ``b`` is scored by
    the logits of the previous valid token of the same sequence, which for left-
    or right-padded inputs is column ``s - 1``: the result equals
    :func:`log_probs_from_logits_response` on the dense logits at every response
    token whose predecessor is valid. Interior padding is skipped, as a packed
    model sees it. Only the ``B·R`` logit rows predicting response positions are
    read, and nothing is read on the host (no device synchronization).

    Args:
        input_ids: ``(B, S)`` integer token ids (padded).
        attention_mask: ``(B, S)`` bool or 0/1, 1 = valid token (any layout).
        logits_rmpad: ``(nnz, V)`` (or ``(1, nnz, V)``) packed logits, ``nnz`` the
            number of valid tokens.
        response_length: ``R``, the response occupies the last ``R`` columns; in ``[1, S]``.
        temperature: float or tensor broadcastable to ``(B, S)``, taken at the
            predicting position.
        vocab_size, vocab_parallel: the real tokens of the whole vocabulary and
            this rank's shard of it (``logits_rmpad`` then holds this rank's
            columns), as in :func:`~rlmath.log_probs.log_probs_from_logits`.
        chunk_size: rows per chunk (``None``: chosen from V).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check that ``logits_rmpad`` has one row per valid token and
            that every response token is a token id (with ``vocab_parallel``, also
            that every rank passes the same tokens), with a ``ValueError`` (a host
            sync). Without it a row-count mismatch makes every result NaN, found
            without reading anything on the host.
        top_k, top_p, min_p, sampler: restrict each response token's softmax to
            the kept set of the rollout's sampler, as in
            :func:`~rlmath.log_probs.log_probs_from_logits`; per-row tensors
            broadcast to ``(B, S)`` and are taken at the predicting position,
            like ``temperature``.
        kept: the rollout's kept set of each response token, replayed: a bool
            mask ``(B, R, V)``, token ids ``(B, R, K)`` padded with -1, or a list of
            ``B·R`` sequences of token ids (row-major).
        kept_stats: return a :class:`~rlmath.log_probs.SampledLogProbs`
            (``outside`` and ``kept_count`` of shape ``(B, R)``, ``entropy`` ``None``).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits); 0 where the token is
        padding or has no earlier valid token in its sequence. Differentiable
        w.r.t. ``logits_rmpad``.
    """
    ids, mask = check_ids_and_mask(input_ids, attention_mask)
    R = api.check_response_length(response_length, ids.shape[1], allow_full=True)
    x = check_packed_logits(logits_rmpad)
    return api.packed_response_log_probs(
        ids, api.packed_rows_from_mask(mask), x, R, temperature=temperature,
        chunk_size=chunk_size, backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel,
        truncation=_truncation(top_k, top_p, min_p, sampler, kept, kept_stats),
    )  # fmt: skip


@overload
def log_probs_from_logits_all_rmpad(
    input_ids_rmpad: torch.Tensor,
    logits_rmpad: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seqlen: int,
    response_length: int,
    *,
    temperature: float | torch.Tensor = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def log_probs_from_logits_all_rmpad(
    input_ids_rmpad: torch.Tensor,
    logits_rmpad: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seqlen: int,
    response_length: int,
    *,
    temperature: float | torch.Tensor = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[True],
) -> SampledLogProbs: ...


def log_probs_from_logits_all_rmpad(
    input_ids_rmpad: torch.Tensor,
    logits_rmpad: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seqlen: int,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    sampler: Sampler = "vllm",
    kept: KeptSetArg = None,
    kept_stats: bool = False,
) -> torch.Tensor | SampledLogProbs:
    """Response log-probs from packed ids and logits, shifting within each sequence.

    Same result as :func:`log_probs_from_logits_response_rmpad`, for callers
    that already hold the packed ids and the ``indices`` returned by
    ``unpad_input`` (flat positions ``b·seqlen + s`` of the valid tokens). No
    host read.

    Args:
        input_ids_rmpad: ``(1, nnz)`` or ``(nnz,)`` packed token ids.
        logits_rmpad: ``(nnz, V)`` packed logits.
        indices: ``(nnz,)`` int64 flat positions in ``[0, batch_size·seqlen)``.
        batch_size: ``B``.
        seqlen: ``S``.
        response_length: ``R`` in ``[1, S]``.
        temperature: float or tensor broadcastable to ``(B, S)``.
        vocab_size, vocab_parallel: as in :func:`log_probs_from_logits_response_rmpad`.
        chunk_size: rows per chunk (``None``: chosen from V).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: as in :func:`log_probs_from_logits_response_rmpad`.
        top_k, top_p, min_p, sampler: restrict each response token's softmax to
            the kept set of the rollout's sampler, as in
            :func:`~rlmath.log_probs.log_probs_from_logits`; per-row tensors
            broadcast to ``(B, S)`` and are taken at the predicting position,
            like ``temperature``.
        kept: the rollout's kept set of each response token, replayed: a bool
            mask ``(B, R, V)``, token ids ``(B, R, K)`` padded with -1, or a list of
            ``B·R`` sequences of token ids (row-major).
        kept_stats: return a :class:`~rlmath.log_probs.SampledLogProbs`
            (``outside`` and ``kept_count`` of shape ``(B, R)``, ``entropy`` ``None``).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits), 0 where the token is
        padding or first in its sequence.
    """
    ids_p = check_index_tensor("input_ids_rmpad", input_ids_rmpad).reshape(-1)
    idx = check_index_tensor("indices", indices).reshape(-1)
    for name, v in (("batch_size", batch_size), ("seqlen", seqlen)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if idx.numel() != ids_p.numel():
        raise ValueError(
            f"indices must have one entry per packed token ({ids_p.numel()}), got {idx.numel()}"
        )
    R = api.check_response_length(response_length, seqlen, allow_full=True)
    x = check_packed_logits(logits_rmpad)
    if x.shape[0] != ids_p.numel():
        raise ValueError(
            f"logits_rmpad must have shape (nnz, V) with nnz = {ids_p.numel()} packed tokens, "
            f"got {tuple(x.shape)}"
        )
    ids, row_of = api.packed_rows_from_indices(idx, ids_p, batch_size, seqlen)
    return api.packed_response_log_probs(
        ids, row_of, x, R, temperature=temperature, chunk_size=chunk_size, backend=backend,
        validate=validate, vocab_size=vocab_size, vocab_parallel=vocab_parallel,
        truncation=_truncation(top_k, top_p, min_p, sampler, kept, kept_stats),
    )  # fmt: skip
