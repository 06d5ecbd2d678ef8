"""How many rows (tokens) each chunk holds.

Each chunk costs a handful of full-chunk torch operations: passes over the
chunk's scratch buffers, each with a fork/join of the intra-op threads.

* CPU: the passes are fast only while the chunk's buffers stay in the cores'
  L2 caches, so the default is a small chunk: about :data:`CPU_CHUNK_BYTES`
  (1 MiB) of fp32 per buffer, but at least two rows per intra-op thread so
  that every thread has whole rows to reduce. Measured on 2 cores (quiet
  machine, fp32 ``[8192, 32000]``, forward of log-probs + entropy): 8 rows
  per chunk 150 ms, 32 rows 205 ms, 256 rows 217 ms; for V = 151936 4 to 8
  rows are fastest. Python overhead per chunk (tens of microseconds) stays
  well below the pass time of a 1 MiB chunk.
* Other devices (CUDA): every op is a kernel launch, so fewer, larger chunks
  win. The default splits the rows into about :data:`TARGET_CHUNKS` chunks
  (each fp32 scratch buffer about 3% of the logits' fp32 size), never below
  :data:`MIN_CHUNK_BYTES` nor above :data:`MAX_CHUNK_BYTES` per buffer.

The chunk size only changes speed and memory, never a result: every row is
reduced the same way whichever chunk it lands in.
"""

from __future__ import annotations

import torch

__all__ = [
    "CPU_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "TARGET_CHUNKS",
    "auto_chunk_size",
    "is_cpu",
    "resolve_chunk_size",
]

CPU_CHUNK_BYTES = 1024 * 1024
"""fp32 ``(chunk, V)`` scratch buffer the CPU default aims at, in bytes (L2-resident)."""

MIN_CHUNK_BYTES = 2 * 1024 * 1024
"""Smallest fp32 ``(chunk, V)`` scratch buffer the non-CPU default picks, in bytes."""

MAX_CHUNK_BYTES = 64 * 1024 * 1024
"""Largest fp32 ``(chunk, V)`` scratch buffer the non-CPU default picks, in bytes."""

TARGET_CHUNKS = 32
"""Number of chunks the non-CPU default aims at between those bounds."""


def is_cpu(device: torch.device | str | None) -> bool:
    """Whether ``device`` (``None`` meaning the default) is a CPU: the chunk-size rules differ."""
    return device is None or torch.device(device).type == "cpu"


def auto_chunk_size(
    vocab_size: int, num_rows: int | None = None, *, device: torch.device | str | None = None
) -> int:
    """Rows per chunk for ``num_rows`` rows of ``vocab_size`` entries on ``device``.

    CPU (``device`` ``None`` or a CPU device): the rows of a 1 MiB fp32 buffer
    (8 for V = 32000, 1 for V = 151936), raised to two rows per intra-op
    thread. Elsewhere: ``num_rows / 32``, kept between the row counts of a
    2 MiB and a 64 MiB fp32 buffer (for V = 32000: 16 to 524 rows; for
    V = 151936: 3 to 110). Either way never more than ``num_rows`` (when
    given), then rounded down to a multiple of the intra-op thread count when
    that leaves at least one row per thread, so every thread reduces as many
    rows. At least one row.

    Args:
        vocab_size: ``V``, the length of the last dim of the logits.
        num_rows: number of rows (tokens) to process, or ``None``.
        device: where the logits live (``None``: CPU).

    Returns:
        Positive int.
    """
    row_bytes = 4 * max(1, vocab_size)
    threads = max(1, torch.get_num_threads())
    if is_cpu(device):
        rows = max(CPU_CHUNK_BYTES // row_bytes, 2 * threads)
    else:
        lo = max(1, MIN_CHUNK_BYTES // row_bytes)
        hi = max(1, MAX_CHUNK_BYTES // row_bytes)
        rows = lo if num_rows is None else min(max(num_rows // TARGET_CHUNKS, lo), hi)
    if num_rows is not None:
        rows = min(rows, max(1, num_rows))
    if rows >= threads:
        rows -= rows % threads
    return rows


def resolve_chunk_size(
    chunk_size: int | None,
    vocab_size: int,
    num_rows: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> int:
    """``chunk_size`` if given (a positive int), else :func:`auto_chunk_size`."""
    if chunk_size is None:
        return auto_chunk_size(vocab_size, num_rows, device=device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(
            f"chunk_size must be a positive int or None, got {type(chunk_size).__name__}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size}")
    return chunk_size
