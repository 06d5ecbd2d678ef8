"""How the fused head tiles the ``(N, V)`` logits it never materializes.

The head works on one ``(rows, vocab_tile)`` block of logits at a time. Speed
asks for large blocks, memory for small ones:

* Matmul efficiency. Every block costs three matmuls with inner dimension
  ``H`` (the logits, and in backward ``grad_hidden`` and ``grad_weight``), and
  the ``grad_weight`` update ``g.T @ hidden_chunk`` has inner dimension
  ``rows``: with few rows it rereads and rewrites the ``(vocab_tile, H)``
  slice of the weight gradient for little arithmetic and becomes memory bound.
  The weight is also read once per row chunk. So ``rows`` must be in the
  hundreds: measured on 2 cores (fp32, H = 2048), ``(rows, tile)`` blocks of
  (1024, 4096) ran the three matmuls at 330–360 GFLOP/s, (2048, 4096) and
  (4096, 2048) at 373–392; the fused head spends about 90 % of its time in
  matmuls, so the CPU default is 2048 rows and 8 M-entry blocks.
* Memory. The block's logits (and, for half-precision inputs, its fp32
  gradient and fp32 copies of the matmul operands) live at once: 8 M entries
  (32 MiB in fp32), capped at 1/64 of the ``N·V`` logits, keeps them at a
  few percent of the logits' size. The elementwise passes over a block run
  in L2-sized row slices (:func:`elementwise_rows`), so their scratch is
  small whatever the block.

On an accelerator every op is a kernel launch, and the pure-torch head issues
about fifteen per block: 4 M-entry blocks made the launches, not the math, the
cost (bf16 [8192, 4096, 151936] on an H200: 5.9x the unfused path). There the
block is :data:`ACCELERATOR_BLOCK_ELEMENTS` (32 M entries, 128 MiB in fp32),
capped at 1/48 of the logits so that three or four such buffers stay under
10 % of them, with :data:`ACCELERATOR_ROWS` rows.

Tiling over the vocabulary as well as the rows makes the scratch size
independent of ``V``: a 152k vocabulary costs no more scratch than a 32k one.
The chunk sizes change speed and memory only; results agree to rounding
(the per-row statistics of the vocabulary tiles are combined exactly, and
the matmul of a block may round differently from that of a different block).
"""

from __future__ import annotations

import math

import torch

from rlmath.logprobs.chunking import auto_chunk_size, is_cpu

__all__ = [
    "ACCELERATOR_BLOCK_ELEMENTS",
    "ACCELERATOR_ROWS",
    "DEFAULT_BLOCK_ELEMENTS",
    "DEFAULT_ROWS",
    "auto_tile_sizes",
    "elementwise_rows",
]

DEFAULT_ROWS = 2048
"""Rows (tokens) per chunk when the caller does not choose."""

DEFAULT_BLOCK_ELEMENTS = 8 * 1024 * 1024
"""Target entries of one ``(rows, vocab_tile)`` block (32 MiB in fp32)."""

ACCELERATOR_ROWS = 4096
"""Rows per chunk on an accelerator (CUDA) when the caller does not choose."""

ACCELERATOR_BLOCK_ELEMENTS = 32 * 1024 * 1024
"""Target entries of one block on an accelerator (128 MiB in fp32)."""

_ACCELERATOR_MAX_FRACTION = 48

# Scratch stays below 1/_MAX_FRACTION of the logits per buffer for small inputs;
# a block of at least _MIN_BLOCK entries keeps tiny inputs from tiling absurdly.
_MAX_FRACTION = 64
_MIN_BLOCK = 64 * 1024


def auto_tile_sizes(
    num_rows: int,
    vocab_size: int,
    *,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[int, int]:
    """``(rows, vocab_tile)`` per block, each given value kept as is.

    A block holds :data:`DEFAULT_BLOCK_ELEMENTS` entries, or 1/64 of the
    ``N·V`` logits when that is smaller (but never below 64k entries).
    ``rows`` defaults to :data:`DEFAULT_ROWS`, fewer for short inputs or small
    blocks (about the square root of the block, at least 64), rounded to a
    multiple of the intra-op thread count; ``vocab_tile`` fills the block.

    Args:
        num_rows: ``N``, the number of tokens.
        vocab_size: ``V``.
        chunk_size: rows per chunk chosen by the caller, or ``None``.
        vocab_chunk_size: vocabulary entries per tile chosen by the caller, or ``None``.
        device: where the inputs live (``None``: CPU); an accelerator takes
            :data:`ACCELERATOR_BLOCK_ELEMENTS` blocks (at most 1/48 of the logits)
            of :data:`ACCELERATOR_ROWS` rows instead.

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
        threads = max(1, torch.get_num_threads())
        if rows > threads:
            rows -= rows % threads
    else:
        rows = chunk_size
    if vocab_chunk_size is None:
        tile = min(v, max(1, block // min(rows, n)))
    else:
        tile = vocab_chunk_size
    return rows, tile


def elementwise_rows(rows: int, width: int, device: torch.device | str | None = None) -> int:
    """Rows per slice for the elementwise passes over a ``(rows, width)`` block of logits.

    The matmuls want large blocks; the half-dozen elementwise passes over a
    block (max, shift, exp, sums; in backward the gradient) are fast only
    while their data stays in the L2 cache. So on a CPU each block is reduced
    in the slices the log-probs engine uses for logits of width ``width``
    (:func:`rlmath.logprobs.chunking.auto_chunk_size`: about 1 MiB of fp32, at
    least two rows per intra-op thread). On an accelerator the whole block is
    one slice (every op is a kernel launch).

    Returns:
        A positive int, at most ``max(rows, 1)``.
    """
    if not is_cpu(device):
        return max(1, rows)
    return auto_chunk_size(width, rows)
