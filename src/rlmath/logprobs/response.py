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

from typing import cast

import torch

from rlmath._validation import check_tensor
from rlmath.logprobs._inputs import check_logits, compute_dtype, normalize_temperature
from rlmath.logprobs.chunking import resolve_chunk_size
from rlmath.logprobs.dispatch import get_kernel

__all__ = [
    "log_probs_from_logits_all_rmpad",
    "log_probs_from_logits_response",
    "log_probs_from_logits_response_rmpad",
]


def _check_ids(name: str, ids: object) -> torch.Tensor:
    x = check_tensor(name, ids)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def _check_response_length(response_length: object, seqlen: int, *, allow_full: bool) -> int:
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(f"response_length must be an int, got {type(response_length).__name__}")
    hi = seqlen if allow_full else seqlen - 1
    if not 1 <= response_length <= hi:
        raise ValueError(
            f"response_length must be in [1, {hi}] for sequences of {seqlen} columns, "
            f"got {response_length}"
        )
    return response_length


def log_probs_from_logits_response(
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probs of the last ``response_length`` tokens from dense logits.

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
        chunk_size: rows per chunk (``None``: chosen from V).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits). Columns whose token
        is padding hold the log-prob of the pad token; mask them with the
        response mask.
    """
    ids = _check_ids("input_ids", input_ids)
    logits = check_logits("logits", logits)
    if ids.dim() != 2 or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
        raise ValueError(
            "logits must have shape (B, S, V) with (B, S) = input_ids.shape; got input_ids "
            f"{tuple(ids.shape)} and logits {tuple(logits.shape)}"
        )
    R = _check_response_length(response_length, ids.shape[1], allow_full=False)
    B, S = ids.shape
    cdt = compute_dtype(logits)
    temp = normalize_temperature(temperature, (B, S), cdt, logits.device, validate=False)
    if isinstance(temp, torch.Tensor):
        temp = temp.view(B, S)[:, -R - 1 : -1].reshape(-1)
    labels = ids[:, -R:].reshape(-1, 1).long()
    chunk = resolve_chunk_size(chunk_size, logits.shape[-1], B * R, device=logits.device)
    kernel = get_kernel("log_probs_entropy", logits)
    # The kernel reads the response rows of the full logits in place: slicing them here
    # would make autograd allocate a second full-size gradient in backward.
    logp, _ = cast(
        tuple[torch.Tensor, torch.Tensor],
        kernel(logits, labels, temp, False, chunk, (1, S - R - 1, R)),
    )
    return logp.view(B, R)


def _packed_response_log_probs(
    ids: torch.Tensor,
    row_of: torch.Tensor,
    logits_rmpad: torch.Tensor,
    R: int,
    temperature: float | torch.Tensor,
    chunk_size: int | None,
) -> torch.Tensor:
    """Core of the rmpad functions.

    ``ids``: ``(B, S)`` token ids on the dense grid; ``row_of``: ``(B, S)``
    int64, the row of ``logits_rmpad`` holding each valid position, ``-1`` for
    padding.
    """
    B, S = ids.shape
    valid = row_of >= 0
    col = torch.arange(S, device=ids.device).expand(B, S)
    # Last valid column strictly before each column, within the same row (-1 if none).
    last_valid = torch.where(valid, col, -1).cummax(dim=1).values
    prev = torch.cat([last_valid.new_full((B, 1), -1), last_valid[:, :-1]], dim=1)[:, -R:]
    select = valid[:, -R:] & (prev >= 0)
    prev_c = prev.clamp_min(0)
    rows = row_of.gather(1, prev_c)[select]
    labels = ids[:, -R:][select]
    cdt = compute_dtype(logits_rmpad)
    temp = normalize_temperature(
        temperature,
        (B, S),
        cdt,
        logits_rmpad.device,
        validate=False,
        shape_name="input_ids.shape",
        device_of="logits_rmpad",
    )
    if isinstance(temp, torch.Tensor):
        temp = temp.view(B, S).gather(1, prev_c)[select]
    chunk = resolve_chunk_size(
        chunk_size, logits_rmpad.shape[-1], int(rows.numel()), device=logits_rmpad.device
    )
    kernel = get_kernel("log_probs_entropy", logits_rmpad)
    logp, _ = cast(
        tuple[torch.Tensor, torch.Tensor],
        kernel(logits_rmpad, labels.long().unsqueeze(-1), temp, False, chunk, rows),
    )
    return logp.new_zeros(B, R).masked_scatter(select, logp.squeeze(-1))


def _check_packed_logits(logits_rmpad: object, nnz: int) -> torch.Tensor:
    x = check_logits("logits_rmpad", logits_rmpad)
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2 or x.shape[0] != nnz:
        raise ValueError(
            f"logits_rmpad must have shape (nnz, V) with nnz = {nnz} valid tokens, "
            f"got {tuple(x.shape)}"
        )
    return x


def log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probs of the response tokens from packed logits, shifting within each sequence.

    ``logits_rmpad`` holds one row per valid token of ``input_ids`` in row-major
    order (what ``rlmath.padding.unpad_input`` / flash-attn's ``unpad_input``
    produce). The response token at column ``s`` of sequence ``b`` is scored by
    the logits of the previous valid token of the same sequence, which for left-
    or right-padded inputs is column ``s - 1``: the result equals
    :func:`log_probs_from_logits_response` on the dense logits at every response
    token whose predecessor is valid. Interior padding is skipped, as a packed
    model sees it. Only the logit rows predicting a response token are read.

    Args:
        input_ids: ``(B, S)`` integer token ids (padded).
        attention_mask: ``(B, S)`` bool or 0/1, 1 = valid token (any layout).
        logits_rmpad: ``(nnz, V)`` (or ``(1, nnz, V)``) packed logits, ``nnz`` the
            number of valid tokens.
        response_length: ``R``, the response occupies the last ``R`` columns; in ``[1, S]``.
        temperature: float or tensor broadcastable to ``(B, S)``, taken at the
            predicting position.
        chunk_size: rows per chunk (``None``: chosen from V).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits); 0 where the token is
        padding or has no earlier valid token in its sequence. Differentiable
        w.r.t. ``logits_rmpad``.
    """
    ids = _check_ids("input_ids", input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, S), got {tuple(ids.shape)}")
    mask = check_tensor("attention_mask", attention_mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    R = _check_response_length(response_length, ids.shape[1], allow_full=True)
    valid = mask.bool()
    row_of = valid.reshape(-1).long().cumsum(0).sub_(1).view(valid.shape)
    row_of = torch.where(valid, row_of, -1)
    nnz = int(row_of.max()) + 1 if row_of.numel() else 0
    logits_rmpad = _check_packed_logits(logits_rmpad, nnz)
    return _packed_response_log_probs(ids, row_of, logits_rmpad, R, temperature, chunk_size)


def log_probs_from_logits_all_rmpad(
    input_ids_rmpad: torch.Tensor,
    logits_rmpad: torch.Tensor,
    indices: torch.Tensor,
    batch_size: int,
    seqlen: int,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Response log-probs from packed ids and logits, shifting within each sequence.

    Same result as :func:`log_probs_from_logits_response_rmpad`, for callers
    that already hold the packed ids and the ``indices`` returned by
    ``unpad_input`` (flat positions ``b·seqlen + s`` of the valid tokens).

    Args:
        input_ids_rmpad: ``(1, nnz)`` or ``(nnz,)`` packed token ids.
        logits_rmpad: ``(nnz, V)`` packed logits.
        indices: ``(nnz,)`` int64 flat positions in ``[0, batch_size·seqlen)``.
        batch_size: ``B``.
        seqlen: ``S``.
        response_length: ``R`` in ``[1, S]``.
        temperature: float or tensor broadcastable to ``(B, S)``.
        chunk_size: rows per chunk (``None``: chosen from V).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits), 0 where the token is
        padding or first in its sequence.
    """
    ids_p = _check_ids("input_ids_rmpad", input_ids_rmpad).reshape(-1)
    idx = _check_ids("indices", indices).reshape(-1).long()
    for name, v in (("batch_size", batch_size), ("seqlen", seqlen)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if idx.numel() != ids_p.numel():
        raise ValueError(
            f"indices must have one entry per packed token ({ids_p.numel()}), got {idx.numel()}"
        )
    R = _check_response_length(response_length, seqlen, allow_full=True)
    logits_rmpad = _check_packed_logits(logits_rmpad, ids_p.numel())
    n = batch_size * seqlen
    row_of = torch.full((n,), -1, dtype=torch.long, device=idx.device)
    row_of[idx] = torch.arange(idx.numel(), device=idx.device)
    ids = torch.zeros(n, dtype=ids_p.dtype, device=idx.device)
    ids[idx] = ids_p
    return _packed_response_log_probs(
        ids.view(batch_size, seqlen),
        row_of.view(batch_size, seqlen),
        logits_rmpad,
        R,
        temperature,
        chunk_size,
    )
