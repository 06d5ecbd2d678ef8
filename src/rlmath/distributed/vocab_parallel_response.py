"""Vocabulary-parallel versions of two more verl helpers: packed response log-probs and Σπ².

Both are re-exported by :mod:`rlmath.distributed.vocab_parallel`.
"""

from __future__ import annotations

import math

import torch

from rlmath._validation import check_tensor
from rlmath.distributed._collectives import ProcessGroup, all_reduce
from rlmath.distributed.vocab_parallel_layout import shard_spec, validate_layout
from rlmath.distributed.vocab_parallel_logits import compute_dtype, real_columns
from rlmath.logprobs._blocks import TemperatureColumn
from rlmath.logprobs._functions import RowBlocks, chunk_ranges
from rlmath.logprobs._inputs import check_logits, normalize_temperature
from rlmath.logprobs._kernels import Workspace, row_sum, scaled_max, scaled_shift
from rlmath.logprobs.chunking import resolve_chunk_size

__all__ = [
    "vocab_parallel_log_probs_from_logits_response_rmpad",
    "vocab_parallel_sum_pi_squared",
]

_NO_LABEL = -1  # internal ignore_index: never a token id


def _check_ids(name: str, ids: object) -> torch.Tensor:
    t = check_tensor(name, ids)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t


def vocab_parallel_log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Response log-probs from packed, vocabulary-sharded logits, shifting within each sequence.

    Equals :func:`rlmath.logprobs.log_probs_from_logits_response_rmpad` on the
    packed logits concatenated over the ranks. The response token at column
    ``s`` of sequence ``b`` is scored by the logits of the previous valid token
    *of the same sequence* (verl's version rolls the packed ids globally, so the
    last token of one sequence is scored against the first of the next). No
    data-dependent shapes and no host sync: the labels of the packed rows are
    scattered into place, rows that predict no response token are skipped via
    ``ignore_index`` (their gradient is 0).

    Args:
        input_ids: ``(B, S)`` integer token ids (padded), the same on every rank.
        attention_mask: ``(B, S)`` bool or 0/1, 1 = valid token (any layout).
        logits_rmpad: ``(nnz, V/tp)`` (or ``(1, nnz, V/tp)``) this rank's columns
            of the packed logits, one row per valid token in row-major order.
        response_length: ``R``: the response is the last ``R`` columns, ``1 ≤ R ≤ S``.
        temperature: float > 0 or a tensor broadcastable to ``(B, S)``, taken at
            the predicting position.
        vocab_start_index, vocab_size, group, chunk_size: as in
            :func:`rlmath.distributed.vocab_parallel.vocab_parallel_log_probs_from_logits`.
        validate: also check that ``nnz`` equals the number of valid tokens and
            the shard layout across ranks (host syncs and a collective).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits), 0 where the token is
        padding or has no earlier valid token in its sequence; differentiable
        w.r.t. ``logits_rmpad``.
    """
    # Imported here: vocab_parallel re-exports this module.
    from rlmath.distributed.vocab_parallel import vocab_parallel_log_probs_from_logits

    ids = _check_ids("input_ids", input_ids)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (B, S), got {tuple(ids.shape)}")
    mask = check_tensor("attention_mask", attention_mask)
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    B, S = ids.shape
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(f"response_length must be an int, got {type(response_length).__name__}")
    if not 1 <= response_length <= S:
        raise ValueError(f"response_length must be in [1, {S}] (S), got {response_length}")
    x = check_logits("logits_rmpad", logits_rmpad)
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 2:
        raise ValueError(f"logits_rmpad must have shape (nnz, V/tp), got {tuple(x.shape)}")
    nnz, R, dev = x.shape[0], response_length, x.device
    valid = mask != 0
    if validate and int(valid.sum()) != nnz:
        raise ValueError(
            f"logits_rmpad must have one row per valid token ({int(valid.sum())}), got {nnz}"
        )
    row_of = torch.where(valid, valid.reshape(-1).cumsum(0).view(B, S) - 1, -1)
    col = torch.arange(S, device=dev).expand(B, S)
    # Last valid column strictly before each column, in the same sequence (-1 if none).
    last = torch.where(valid, col, -1).cummax(dim=1).values
    prev = torch.cat([last.new_full((B, 1), -1), last[:, :-1]], dim=1)[:, -R:]
    select = valid[:, -R:] & (prev >= 0)
    # The packed row predicting each response token; a spare row nnz collects the rest.
    row = torch.where(select, row_of.gather(1, prev.clamp_min(0)), nnz)
    labels = torch.full((nnz + 1,), _NO_LABEL, dtype=torch.long, device=dev)
    labels.scatter_(0, row.reshape(-1), torch.where(select, ids[:, -R:].long(), _NO_LABEL).view(-1))
    temp: float | torch.Tensor = temperature
    if isinstance(temperature, torch.Tensor):
        t = normalize_temperature(temperature, (B, S), compute_dtype(x), dev, validate=validate)
        assert isinstance(t, torch.Tensor)
        # Each packed row's own (predicting) position; the spare row gets 1.
        per_row = torch.ones(nnz + 1, dtype=t.dtype, device=dev)
        temp = per_row.scatter_(0, torch.where(valid, row_of, nnz).view(-1), t)[:nnz]
    logp = vocab_parallel_log_probs_from_logits(
        x,
        labels[:nnz],
        temperature=temp,
        ignore_index=_NO_LABEL,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        group=group,
        chunk_size=chunk_size,
        validate=validate,
    )
    padded = torch.cat([logp, logp.new_zeros(1)])
    return torch.where(select, padded[row], 0)


def vocab_parallel_sum_pi_squared(
    logits_shard: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """``Σ_v π_v²`` of ``π = softmax(logits / T)`` over the full sharded vocabulary, per row.

    The path-variance proxy of the optimal-token-baseline estimator
    (``sum_pi_squared`` of :mod:`rlmath.advantages.optimal_token_baseline`).
    Chunked like the other functions; each rank sums ``exp(2(z - m_k))`` over
    its columns and two collectives combine the shards. Not differentiable (a
    statistic for advantages, like verl's); the input is never modified.

    Args:
        logits_shard: ``(..., V/tp)`` this rank's columns, any floating dtype.
        temperature, vocab_start_index, vocab_size, group, chunk_size, validate:
            as in :func:`rlmath.distributed.vocab_parallel.vocab_parallel_entropy`.

    Returns:
        ``logits_shard.shape[:-1]``, fp32 (fp64 for fp64 logits), in ``(0, 1]``,
        identical on every rank.
    """
    logits = check_logits("logits_shard", logits_shard)
    batch = tuple(logits.shape[:-1])
    width, rows = logits.shape[-1], math.prod(batch)
    shard = shard_spec(
        width,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        ignore_index=None,
        group=group,
    )
    cdt, dev = compute_dtype(logits), logits.device
    temp = TemperatureColumn(
        normalize_temperature(temperature, batch, cdt, dev, validate=validate), cdt, dev
    )
    if validate:
        validate_layout(shard, width, rows, None, dev, group)
    chunk = resolve_chunk_size(chunk_size, width, rows, device=logits.device)
    with torch.no_grad():
        m = torch.full((rows,), float("-inf"), dtype=cdt, device=dev)
        s = torch.zeros(rows, dtype=cdt, device=dev)
        u = torch.zeros(rows, dtype=cdt, device=dev)
        if shard.real > 0 and rows > 0:
            lay = RowBlocks(real_columns(logits, shard.real))
            ws = Workspace(min(chunk, rows), shard.real, cdt, dev)
            for a, b in chunk_ranges(rows, chunk, lay):
                src, t = lay.get(a, b), temp.rows(a, b)
                cm = scaled_max(src, t, cdt)
                dead = cm == float("-inf")
                e = scaled_shift(src, t, torch.where(dead, 0, cm), ws.get("y", b - a)).exp_()
                m[a:b], s[a:b] = cm.squeeze(-1), row_sum(e)
                u[a:b] = row_sum(e.mul_(e))
        big = all_reduce(m, "max", group)
        dead_rows = m == float("-inf")
        scale = torch.where(dead_rows, 0, torch.exp(m - big))
        total = all_reduce(torch.stack([s * scale, u * scale * scale], -1), "sum", group)
        return (total[:, 1] / total[:, 0].square()).view(batch)
