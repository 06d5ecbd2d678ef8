"""How the vocabulary engine cuts its work into chunks and blocks.

Every choice here changes speed and memory only, never a result beyond
rounding: a row is reduced the same way whichever chunk holds it, and the
statistics of vocabulary tiles are merged exactly. The rules are evaluated
inside the engine's operators (they read the intra-op thread count, which a
compiler must not see), for single-process and vocabulary-parallel calls
alike (a vocabulary shard is sized like a vocabulary of its width).

Logits (:func:`auto_chunk_size`). Each chunk of rows costs a handful of
full-chunk torch operations, each a pass over the chunk's scratch buffers
with a fork/join of the intra-op threads.

* CPU: the passes are fast only while the chunk's buffers stay in the
  caches, and every chunk costs a dozen op dispatches, so the default is a
  small chunk: about :data:`CPU_CHUNK_BYTES` (2 MiB) of fp32 per buffer, but
  at least two rows per intra-op thread. Measured on 2 quiet cores, fp32
  ``[8192, 32000]``, forward of log-probs + entropy: on an Intel Xeon (2 MiB
  L2 per core, every op on OpenMP threads) 8 rows per chunk 150 ms, 32 rows
  205 ms, 256 rows 217 ms; on an AMD EPYC (1 MiB L2, chunks shared out over
  worker threads, :mod:`rlmath.engine.execution`; median of 9)
  8 rows 216 ms, 16 rows 198 ms, 24 rows 198 ms (forward+backward 729, 694,
  717 ms); for V = 151936 4 to 8 rows are fastest.
* Other devices (CUDA): every op is a kernel launch (a few microseconds of
  overhead each, a dozen per chunk), so chunks are large: the rows split into
  about :data:`TARGET_CHUNKS` chunks, each fp32 buffer at least
  :data:`MIN_CHUNK_BYTES` (64 MiB: one op over it is some 14 µs of HBM
  traffic at 4.8 TB/s, several launches' worth) and at most
  :data:`MAX_CHUNK_BYTES` or 1/:data:`ACCELERATOR_MEMORY_FRACTION` of the
  device's memory. A pass holds a few such buffers, so its scratch stays a
  fraction of the naive path's full fp32 ``log_softmax``. Not measured on a
  GPU with these sizes (the earlier ones, 2 to 64 MiB in 32 chunks, made the
  pure-torch forward 1.3–3.7× the naive one on an H200).

Fused LM head (:func:`auto_tile_sizes`). The head works on one
``(rows, vocab_tile)`` block of logits at a time. Every block costs three
matmuls with inner dimension ``H`` (the logits, and in backward
``grad_hidden`` and ``grad_weight``), and ``g.T @ hidden_chunk`` has inner
dimension ``rows``: with few rows it rereads the ``(vocab_tile, H)`` slice of
the weight gradient for little arithmetic. Measured on 2 cores (fp32,
H = 2048), blocks of (1024, 4096) ran the three matmuls at 330–360 GFLOP/s,
(2048, 4096) and (4096, 2048) at 373–392; the head spends about 90 % of its
time in matmuls, so the CPU default is :data:`DEFAULT_ROWS` rows and
:data:`DEFAULT_BLOCK_ELEMENTS`-entry blocks, capped at 1/64 of the ``N·V``
logits. The tile is sized for the rows a chunk really has after
:func:`spans` evens the chunks out (512 tokens at V = 32000 are two chunks
of 256 rows, so 896-wide tiles rather than 384): measured on 2 quiet AMD EPYC
cores, fp32, H = 1024, V = 32000, forward+backward against the unfused path,
every matmul in MKL,
sizing the tile for the evened chunks took N = 512 from 1.85× to 1.49×,
N = 1024 from 1.47× to 1.40×, N = 2048 from 1.46× to 1.38×, N = 8192 from
1.44× to 1.36× (alternating runs, median of 9). On an accelerator the
pure-torch head issues about fifteen kernel launches per block, and 4 M-entry blocks made the launches the cost (bf16
[8192, 4096, 151936] on an H200: 5.9x the unfused path), so there blocks are
:data:`ACCELERATOR_BLOCK_ELEMENTS` entries of :data:`ACCELERATOR_ROWS` rows,
capped at 1/48 of the logits. On a CPU each chunk is cut into pieces of
rows (:func:`matmul_piece`), every piece × tile one block task for a worker
thread, and the elementwise passes over a block run in L2-sized row slices
(:func:`elementwise_rows`).
"""

from __future__ import annotations

import math

import torch

from rlmath.engine.execution import row_multiple

__all__ = [
    "ACCELERATOR_BLOCK_ELEMENTS",
    "ACCELERATOR_MEMORY_FRACTION",
    "ACCELERATOR_ROWS",
    "CPU_CHUNK_BYTES",
    "DEFAULT_BLOCK_ELEMENTS",
    "DEFAULT_ROWS",
    "FOLD_BYTES",
    "HEAD_TILE",
    "MATMUL_PIECE_ROWS",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "MIN_FOLD_GROUPS",
    "TARGET_CHUNKS",
    "TILE_ALIGN",
    "auto_chunk_size",
    "auto_tile_sizes",
    "elementwise_rows",
    "fold_groups",
    "half_matmuls_pay",
    "is_cpu",
    "matmul_piece",
    "spans",
    "tile_spans",
]

CPU_CHUNK_BYTES = 2 * 1024 * 1024
"""fp32 ``(chunk, V)`` scratch buffer the CPU default aims at, in bytes (cache-resident)."""

MIN_CHUNK_BYTES = 64 * 1024 * 1024
"""Smallest fp32 ``(chunk, V)`` scratch buffer the non-CPU default picks, in bytes (unless the
rows are fewer)."""

MAX_CHUNK_BYTES = 1024 * 1024 * 1024
"""Largest fp32 ``(chunk, V)`` scratch buffer the non-CPU default picks, in bytes."""

ACCELERATOR_MEMORY_FRACTION = 64
"""A non-CPU chunk's fp32 buffer takes at most 1/64 of the device's memory (CUDA)."""

TARGET_CHUNKS = 16
"""Number of chunks the non-CPU default aims at between those bounds."""

DEFAULT_ROWS = 2048
"""Rows (tokens) per fused-head chunk on a CPU when the caller does not choose."""

DEFAULT_BLOCK_ELEMENTS = 8 * 1024 * 1024
"""Target entries of one fused-head ``(rows, vocab_tile)`` block on a CPU (32 MiB in fp32)."""

ACCELERATOR_ROWS = 4096
"""Rows per fused-head chunk on an accelerator (CUDA) when the caller does not choose."""

ACCELERATOR_BLOCK_ELEMENTS = 32 * 1024 * 1024
"""Target entries of one fused-head block on an accelerator (128 MiB in fp32)."""

FOLD_BYTES = 512 * 1024
"""Most bytes of per-tile sums a worker holds before adding each row's tiles up (see :func:`fold_groups`)."""

MIN_FOLD_GROUPS = 16
"""Fewest runs of chunks :func:`fold_groups` cuts a pass into, where it has that many chunks."""

TILE_ALIGN = 128
"""A CPU vocabulary tile is a multiple of this many entries (when it is not the whole vocabulary)."""

MATMUL_PIECE_ROWS = 512
"""Most rows of one piece of a fused-head chunk on a CPU (see :func:`matmul_piece`)."""

_ACCELERATOR_MAX_FRACTION = 48
# Scratch stays below 1/_MAX_FRACTION of the logits per buffer for small inputs;
# a block of at least _MIN_BLOCK entries keeps tiny inputs from tiling absurdly.
HEAD_TILE = 2048
"""Vocabulary columns per fused-head block on a CPU when the caller does not choose.

The same for every number of rows (a multiple of :data:`TILE_ALIGN`), so that
a row's blocks, and the order in which their statistics are merged, do not
depend on the batch: with a matmul that computes each row alike whatever the
block's row count, the head's values are bitwise those of the row alone."""

_MAX_FRACTION = 64
_MIN_BLOCK = 64 * 1024


def is_cpu(device: torch.device | str | None) -> bool:
    """Whether ``device`` (``None`` meaning the default) is a CPU: the size rules differ."""
    return device is None or torch.device(device).type == "cpu"


def half_matmuls_pay(device: torch.device) -> bool:
    """Whether half-precision matmuls beat fp32 ones on ``device`` (every accelerator, not a CPU).

    On an accelerator a half-precision matmul runs on tensor cores, an order of
    magnitude faster than fp32 (measured on an H200: fp32 backward matmuls made
    the bf16 head 8x slower than the unfused path). On a CPU fp32 matmuls are
    as fast and keep the gradient unrounded.
    """
    return device.type != "cpu"


_DEVICE_MEMORY: dict[int, int] = {}


def _device_memory(device: torch.device) -> int | None:
    """Total memory of a CUDA device in bytes (read once per device), ``None`` elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_MEMORY:
        _DEVICE_MEMORY[index] = torch.cuda.get_device_properties(index).total_memory
    return _DEVICE_MEMORY[index]


def auto_chunk_size(
    vocab_size: int, num_rows: int | None = None, *, device: torch.device | str | None = None
) -> int:
    """Rows per chunk for ``num_rows`` rows of ``vocab_size`` logits on ``device``.

    CPU (``device`` ``None`` or a CPU device): the rows of a 2 MiB fp32 buffer
    (16 for V = 32000, 3 for V = 151936), raised to two rows per intra-op
    thread. Elsewhere: ``num_rows / 16``, kept between the row counts of a
    64 MiB and a 1 GiB fp32 buffer (the upper bound lowered to 1/64 of a CUDA
    device's memory; for V = 32000: 524 to 8388 rows; for V = 151936: 110 to
    1766). Either way never more than ``num_rows`` (when given), then rounded
    down to a multiple of the intra-op thread count when that leaves at least
    one row per thread. At least one row.

    Args:
        vocab_size: ``V``, the length of the last dim of the logits (of the shard).
        num_rows: number of rows (tokens) to process, or ``None``.
        device: where the logits live (``None``: CPU).

    Returns:
        Positive int.
    """
    row_bytes = 4 * max(1, vocab_size)
    multiple = row_multiple()
    if is_cpu(device):
        rows = max(CPU_CHUNK_BYTES // row_bytes, 2 * multiple)
    else:
        cap = MAX_CHUNK_BYTES
        total = _device_memory(torch.device(device))  # type: ignore[arg-type]
        if total is not None:
            cap = max(MIN_CHUNK_BYTES, min(cap, total // ACCELERATOR_MEMORY_FRACTION))
        lo = max(1, MIN_CHUNK_BYTES // row_bytes)
        hi = max(1, cap // row_bytes)
        rows = lo if num_rows is None else min(max(num_rows // TARGET_CHUNKS, lo), hi)
    if num_rows is not None:
        rows = min(rows, max(1, num_rows))
    if rows >= multiple:
        rows -= rows % multiple
    return rows


def auto_tile_sizes(
    num_rows: int,
    vocab_size: int,
    *,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[int, int]:
    """``(rows, vocab_tile)`` per fused-head block, each value given by the caller kept as is.

    A block holds :data:`DEFAULT_BLOCK_ELEMENTS` entries on a CPU
    (:data:`ACCELERATOR_BLOCK_ELEMENTS` elsewhere), or 1/64 (1/48) of the
    ``N·V`` logits when that is smaller, never below 64k entries. ``rows``
    defaults to :data:`DEFAULT_ROWS` (:data:`ACCELERATOR_ROWS`), fewer for
    short inputs or small blocks (about the square root of the block, at
    least 64); on an accelerator ``vocab_tile`` fills the block. On a CPU
    ``vocab_tile`` is :data:`HEAD_TILE` (or ``V`` when narrower) for every
    ``N``, and ``rows`` fill the block (fewer when the block allows fewer),
    so a row's blocks do not depend on the batch. Neither depends on the
    thread count, so neither do the results.

    Args:
        num_rows: ``N``, the number of tokens.
        vocab_size: ``V`` (the local vocabulary of a shard).
        chunk_size: rows per chunk chosen by the caller, or ``None``.
        vocab_chunk_size: vocabulary entries per tile chosen by the caller, or ``None``.
        device: where the inputs live (``None``: CPU).

    Returns:
        Two positive ints.
    """
    n, v = max(1, num_rows), max(1, vocab_size)
    cpu = is_cpu(device)
    target, fraction = (
        (DEFAULT_BLOCK_ELEMENTS, _MAX_FRACTION)
        if cpu
        else (ACCELERATOR_BLOCK_ELEMENTS, _ACCELERATOR_MAX_FRACTION)
    )
    block = max(_MIN_BLOCK, min(target, n * v // fraction))
    if chunk_size is None:
        # A small block is split about evenly between rows and vocabulary, so
        # that neither matmul of the backward gets a short inner dimension.
        rows = min(DEFAULT_ROWS if cpu else ACCELERATOR_ROWS, n, max(64, math.isqrt(block)))
        # The chunks are cut evenly (spans): size the tile for the rows a chunk
        # really has (512 rows by 506 are two chunks of 256, not of 506).
        rows = -(-n // -(-n // rows))
    else:
        rows = chunk_size
    if vocab_chunk_size is not None:
        return rows, vocab_chunk_size
    if cpu:
        # One tile width whatever the number of rows: a row's logits and its
        # statistics are then computed in the same blocks and merged in the
        # same order in any batch (see HEAD_TILE); the rows fill the block.
        tile = min(v, HEAD_TILE)
        if chunk_size is None:
            rows = min(rows, max(1, block // tile))
            rows = -(-n // -(-n // rows))
        return rows, tile
    tile = min(v, max(1, block // min(rows, n)))
    return rows, tile


def elementwise_rows(rows: int, width: int, device: torch.device | str | None = None) -> int:
    """Rows per slice for the elementwise passes over a ``(rows, width)`` block of logits.

    The matmuls want large blocks; the half-dozen elementwise passes over a
    block (max, shift, exp, sums; in backward the gradient) are fast only
    while their data stays in the L2 cache. So on a CPU each block is reduced
    in the slices :func:`auto_chunk_size` picks for logits of width ``width``.
    On an accelerator the whole block is one slice (every op is a kernel launch).

    Returns:
        A positive int, at most ``max(rows, 1)``.
    """
    if not is_cpu(device):
        return max(1, rows)
    return auto_chunk_size(width, rows)


def matmul_piece(length: int, device: torch.device | str | None = None) -> int:
    """Rows of the pieces a fused-head chunk of ``length`` rows is cut into, one block each.

    On a CPU the chunk is cut evenly into pieces of at most
    :data:`MATMUL_PIECE_ROWS` rows, and every piece × vocabulary tile is one
    block: one task for a worker thread, whose matmuls run on that thread
    (:func:`rlmath.engine.execution.run_blocks`), so that a
    core taken by another process slows one worker instead of holding every
    thread of an OpenMP matmul at its barrier. The rows of a piece are the
    inner dimension of its ``grad_weight`` matmul: measured on 2 quiet AMD
    EPYC cores (fp32, 4096×1024×32000, forward+backward against the unfused
    path, every matmul in MKL, interleaved runs, median of 6), pieces of 171, 342, 455 (at most
    512) and 683 rows of the 1366-row chunks took 1.34×, 1.29×, 1.27× and
    1.31×. The length never depends on the thread count, so neither do the
    results. On an accelerator a block is the whole chunk (one kernel per matmul).

    Returns:
        A positive int (``length`` itself, at least 1, on an accelerator).
    """
    length = max(1, length)
    if not is_cpu(device):
        return length
    return -(-length // -(-length // MATMUL_PIECE_ROWS))


def tile_spans(
    total: int, tile: int, device: torch.device | str | None = None
) -> list[tuple[int, int]]:
    """The vocabulary tiles of the fused head: ``[(v0, v1), ...]`` covering ``range(total)``.

    On a CPU every tile but the last is exactly ``tile`` wide: the tiles'
    buffers are contiguous ``(rows, width)`` matrices, and a width that is a
    multiple of :data:`TILE_ALIGN` keeps the matmuls that write or read them
    fast (measured on a 2-core AMD EPYC, fp32, 1366 rows, H = 1024, in MKL:
    the logits matmul took 3.6 s per ``N·V·H`` with 1392-wide tiles, 2.8 s
    with 1408-wide ones). Elsewhere the tiles are :func:`spans` of whole
    128-column tiles (even widths: on an accelerator a short last tile would
    cost as many kernel launches as a full one). Either way every tile starts
    on the 128-column grid of :mod:`rlmath.engine.tree` (``tile`` is rounded
    up to a multiple of 128), whose tiles the head's statistics are merged over.
    """
    grid = TILE_ALIGN  # = rlmath.engine.tree.TILE
    width = -(-max(1, tile) // grid) * grid
    if not is_cpu(device):
        n = -(-max(0, total) // grid)
        return [(a * grid, min(b * grid, total)) for a, b in spans(n, width // grid)]
    return [(lo, min(lo + width, total)) for lo in range(0, max(0, total), width)]


def spans(total: int, step: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(total)`` in the fewest pieces of at most ``step``.

    The pieces differ in length by at most one (151936 by 4096 gives 38 pieces
    of 3998 or 3999, not 37 of 4096 and a last one of 384, which would cost as
    many passes as a full one for a tenth of the work).
    """
    if total <= 0:
        return []
    count = -(-total // step)
    size, extra = divmod(total, count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + size + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def fold_groups(
    ranges: list[tuple[int, int]], tiles: int, sums: int
) -> list[list[tuple[int, int]]]:
    """Runs of consecutive chunk ranges whose rows add their tiles up together.

    A pass keeps each row's ``sums`` sums per tile (``tiles`` of them) until the
    row's tiles are added in the fixed tree (:func:`rlmath.engine.tree.fold`),
    a dozen small ops whatever the number of rows: once per run of chunks of
    at most :data:`FOLD_BYTES` of such sums rather than once per chunk. There
    are at least :data:`MIN_FOLD_GROUPS` runs where the chunks allow, so the
    worker pool still has work to share; the runs do not depend on the thread
    count, nor does a row's result depend on the runs (the tree adds each row
    on its own).

    Args:
        ranges: the ``(start, end)`` row ranges of the chunks, consecutive and in order.
        tiles: tiles per row; sums: sums per tile.

    Returns:
        The ranges, cut into runs (at least one range each).
    """
    if not ranges:
        return []
    total = ranges[-1][1] - ranges[0][0]
    cap = max(1, FOLD_BYTES // max(1, 4 * tiles * sums))
    cap = min(cap, max(1, total // MIN_FOLD_GROUPS))
    groups: list[list[tuple[int, int]]] = []
    for a, b in ranges:
        if groups and b - groups[-1][0][0] <= cap:
            groups[-1].append((a, b))
        else:
            groups.append([(a, b)])
    return groups
