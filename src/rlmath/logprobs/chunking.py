"""How many rows (tokens) each chunk holds.

Each chunk costs a handful of full-chunk torch operations, and each of those
costs one pass over the chunk plus a thread fork/join. Small chunks keep the
pass in the L2 cache; large chunks mean fewer fork/joins, which is what
dominates on a busy machine where a thread can be descheduled at every join.
Measured on a 2-core CPU, a chunk of 2 to 16 MiB of fp32 runs at the same
speed when the machine is quiet, so the default takes the large end:
about 8 MiB per fp32 scratch buffer, but never more than 1/32 of the rows,
so the extra memory stays a few percent of the logits' size even for short
inputs. The chunk size only changes speed and memory, never a result: every
row is reduced the same way whichever chunk it lands in.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "auto_chunk_size", "resolve_chunk_size"]

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
"""Target size of one fp32 ``(chunk, V)`` scratch buffer, in bytes."""

_MAX_ROW_FRACTION = 32


def auto_chunk_size(
    vocab_size: int, num_rows: int | None = None, *, target_bytes: int = DEFAULT_CHUNK_BYTES
) -> int:
    """Rows per chunk for a vocabulary of ``vocab_size`` entries.

    About ``target_bytes / (4·V)`` rows (64 for V = 32000, 12 for
    V = 151936), at most ``num_rows / 32`` when ``num_rows`` is given, and
    rounded down to a multiple of the intra-op thread count when that leaves
    at least one row per thread, so that every thread reduces as many rows.

    Args:
        vocab_size: ``V``, the length of the last dim of the logits.
        num_rows: number of rows (tokens) to process, or ``None``.
        target_bytes: wanted size of one fp32 chunk buffer.

    Returns:
        Positive int.
    """
    rows = max(1, target_bytes // (4 * max(1, vocab_size)))
    threads = max(1, torch.get_num_threads())
    if num_rows is not None:
        rows = min(rows, max(threads, num_rows // _MAX_ROW_FRACTION))
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
