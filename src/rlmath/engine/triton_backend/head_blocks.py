"""Blocks of the fused LM head for the Triton backend: sizes, the logits block, the matmuls.

The head works on ``(rows, tile)`` blocks of logits, ``hidden[r0:r1] @
weight[v0:v1].T (+ bias)``, computed by cuBLAS into one reused workspace
in the inputs' dtype; Triton kernels turn each block into per-row
statistics (forward) or into its gradient in place (backward). The
vocabulary tile is :data:`HEAD_TILE` columns whatever the number of rows,
so the statistics of a row are merged over the same tiles in the same order
at any batch size; the rows per block fill :data:`HEAD_BLOCK_ENTRIES`.

Every tile but the last is a multiple of :data:`~.launch.ALIGN` (16)
columns wide (:func:`tile_spans`), and a block's rows lie
:func:`block_stride` elements apart, a multiple of 16: so each row of a
block starts on a 16-byte boundary, the Triton kernels read and write it
128 bits at a time, and cuBLAS gets a leading dimension that is a multiple
of 16 bytes (evenly balanced tiles of 3998 or 3999 columns, as
:func:`rlmath.engine.policy.spans` cuts 151936 by 4096, gave neither).
"""

from __future__ import annotations

import torch

from rlmath.engine.policy import spans
from rlmath.engine.triton_backend.launch import ALIGN

__all__ = [
    "HEAD_BLOCK_ENTRIES",
    "HEAD_TILE",
    "block_stride",
    "head_tiles",
    "logits_block",
    "masked_hidden",
    "matmul_into",
    "spans",
    "tile_spans",
]

HEAD_TILE = 4096
"""Vocabulary entries per fused-head tile (independent of the number of rows)."""

HEAD_BLOCK_ENTRIES = 64 * 1024 * 1024
"""Most entries of one ``(rows, tile)`` block: 128 MiB in bf16, 256 MiB in fp32."""


def head_tiles(
    num_rows: int,
    vocab_size: int,
    *,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[int, int]:
    """``(rows, vocab_tile)`` per block; a size the caller gives is kept as is.

    The tile is :data:`HEAD_TILE` (never a function of ``num_rows``); the rows
    fill :data:`HEAD_BLOCK_ENTRIES` (all rows when they fit: then each weight
    tile's gradient is a single matmul over every row).
    """
    tile = vocab_chunk_size if vocab_chunk_size is not None else HEAD_TILE
    if chunk_size is not None:
        return chunk_size, tile
    return max(1, min(num_rows, HEAD_BLOCK_ENTRIES // max(1, min(tile, vocab_size)))), tile


def tile_spans(total: int, tile: int) -> list[tuple[int, int]]:
    """The vocabulary tiles ``[(v0, v1), ...]`` covering ``range(total)``, at most ``tile`` wide.

    As few tiles as :func:`spans` cuts and about as even, each width rounded
    up to a multiple of :data:`~.launch.ALIGN` (151936 by 4096: 37 tiles of
    4000 and one of 3936), the last one taking what is left. A ``tile`` below
    16 columns is used as is. Depends on ``total`` and ``tile`` only, never on
    the number of rows.
    """
    if total <= 0:
        return []
    if tile < ALIGN:
        return spans(total, tile)
    step = tile - tile % ALIGN
    count = -(-total // step)
    even = -(-total // count)  # the widths spans() would cut, rounded up
    width = -(-even // ALIGN) * ALIGN  # <= step: both are multiples of 16
    return [(lo, min(lo + width, total)) for lo in range(0, total, width)]


def block_stride(width: int) -> int:
    """Elements between the rows of a ``(rows, width)`` logits block: ``width`` rounded up to 16."""
    return -(-width // ALIGN) * ALIGN


def masked_hidden(hidden: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``hidden`` with the rows of dead (all-ignored) positions replaced by zeros.

    NaN or inf there can then reach neither the statistics nor, through the
    weight-gradient matmul, any other row's gradient.
    """
    return hidden if live is None else torch.where(live[:, None], hidden, 0.0)


def logits_block(
    ws: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    v0: int,
    v1: int,
) -> torch.Tensor:
    """The ``(rows, v1 - v0)`` block ``h @ weight[v0:v1].T (+ bias)`` in ``ws``.

    Its rows lie :func:`block_stride` elements apart (contiguous when the
    width is a multiple of 16; the columns between are never read as logits).
    """
    ld = block_stride(v1 - v0)
    out = ws[: h.shape[0] * ld].view(h.shape[0], ld)[:, : v1 - v0]
    w = weight[v0:v1].T
    if bias is None:
        return torch.mm(h, w, out=out)
    return torch.addmm(bias[v0:v1], h, w, out=out)


_MIXED_ADDMM = [True]  # whether this torch accumulates half products into fp32 in place


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``out = a @ b`` or ``out += a @ b``, with ``out`` in fp32 when ``a``, ``b`` are half.

    Half inputs use the GEMM's fp32 output (tensor cores, fp32 accumulation,
    no rounding of the product to half); fp32 inputs stay fp32 (IEEE unless
    TF32 is enabled in torch).
    """
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if out.device.type != "cuda":
        prod = a.to(out.dtype) @ b.to(out.dtype)  # no mixed-dtype GEMM on a CPU
    elif not accumulate:
        torch.ops.aten.mm.dtype_out(a, b, out.dtype, out=out)
        return
    else:
        if _MIXED_ADDMM[0]:
            try:
                torch.ops.aten.addmm.dtype_out(out, a, b, out.dtype, out=out)
                return
            except RuntimeError:  # an older torch wants `self` in the inputs' dtype
                _MIXED_ADDMM[0] = False
        prod = torch.ops.aten.mm.dtype(a, b, out.dtype)
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)
