"""How many rows (tokens) each chunk holds.

Each chunk costs a handful of full-chunk torch operations, and each of those
costs one pass over the chunk plus a fork/join of the intra-op threads. On a
quiet CPU the chunk size hardly matters between 2 and 32 MiB of fp32 (measured
on 2 cores: within 10%, the smaller a little faster as it stays in L2). On a
busy CPU every join can wait a whole scheduler time slice for a descheduled
thread, so the number of chunks is what costs. The default therefore splits
the rows into about 32 chunks (``N / 32`` rows each, so each fp32 scratch
buffer is about 3% of the logits' fp32 size), but never below 2 MiB (per-op
overhead) nor above 64 MiB per buffer. The chunk size only changes speed and
memory, never a result: every row is reduced the same way whichever chunk it
lands in.
"""

from __future__ import annotations

import torch

__all__ = [
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "TARGET_CHUNKS",
    "auto_chunk_size",
    "resolve_chunk_size",
]

MIN_CHUNK_BYTES = 2 * 1024 * 1024
"""Smallest fp32 ``(chunk, V)`` scratch buffer the default picks, in bytes."""

MAX_CHUNK_BYTES = 64 * 1024 * 1024
"""Largest fp32 ``(chunk, V)`` scratch buffer the default picks, in bytes."""

TARGET_CHUNKS = 32
"""Number of chunks the default aims at between those bounds."""


def auto_chunk_size(vocab_size: int, num_rows: int | None = None) -> int:
    """Rows per chunk for ``num_rows`` rows of ``vocab_size`` entries.

    ``num_rows / 32``, kept between the row counts of a 2 MiB and a 64 MiB fp32
    buffer (for V = 32000: 16 to 524 rows; for V = 151936: 3 to 110), then
    rounded down to a multiple of the intra-op thread count when that leaves
    at least one row per thread, so every thread reduces as many rows. Without
    ``num_rows``, the 2 MiB size. At least one row.

    Args:
        vocab_size: ``V``, the length of the last dim of the logits.
        num_rows: number of rows (tokens) to process, or ``None``.

    Returns:
        Positive int.
    """
    row_bytes = 4 * max(1, vocab_size)
    lo = max(1, MIN_CHUNK_BYTES // row_bytes)
    hi = max(1, MAX_CHUNK_BYTES // row_bytes)
    rows = lo if num_rows is None else min(max(num_rows // TARGET_CHUNKS, lo), hi)
    threads = max(1, torch.get_num_threads())
    if rows >= threads:
        rows -= rows % threads
    return rows


def resolve_chunk_size(chunk_size: int | None, vocab_size: int, num_rows: int | None = None) -> int:
    """``chunk_size`` if given (a positive int), else :func:`auto_chunk_size`."""
    if chunk_size is None:
        return auto_chunk_size(vocab_size, num_rows)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(
            f"chunk_size must be a positive int or None, got {type(chunk_size).__name__}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    return chunk_size
