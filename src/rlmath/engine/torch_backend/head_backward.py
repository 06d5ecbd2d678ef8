"""The fused LM head's backward pass: gradients of hidden, weight and bias, block by block.

Each block of logits (:class:`~rlmath.engine.torch_backend.head_blocks.HeadBlocks`)
is recomputed and turned into its gradient ``g`` with
:func:`rlmath.engine.torch_backend.logits_backward.chunk_grad` (from the saved
log-sum-exp, so a tile needs nothing from the others), then fed to two
matmuls and a sum: ``grad_hidden[rows] += g @ weight_tile``,
``grad_weight[tile] += g.T @ hidden_rows`` and ``grad_bias[tile] += Σ g``.
The blocks of a row add into its ``grad_hidden`` in tile order, those of a
tile into its ``grad_weight`` in row order, whoever runs which block
(:func:`rlmath.engine.execution.run_blocks`), so the sums are added in one order.

On a CPU the fp32 matmuls run in oneDNN on x86 CPUs that are not Intel's,
else in torch's BLAS (:mod:`~rlmath.engine.torch_backend.cpu_matmul`). For
half-precision inputs on a CPU the weight tile and hidden chunk are upcast
for these matmuls; on an accelerator ``g`` is rounded to the inputs' dtype and
the matmuls run in half precision (tensor cores), each product added to fp32
accumulators (:func:`rlmath.engine.policy.half_matmuls_pay`). Either way
``grad_weight`` accumulates in one compute-dtype buffer of the weight's shape,
rounded once at the end, as ``grad_hidden`` is per row (in a compute-dtype
buffer of the chunk on an accelerator; on a CPU, where the blocks of a row do
not run one after another, of a band of rows of at most :data:`BAND_BYTES`,
the bands one after another; over all rows when the engine sums it over a
vocabulary-parallel group first).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from rlmath.engine import policy
from rlmath.engine.torch_backend import cpu_matmul
from rlmath.engine.torch_backend.buffers import (
    Temperature,
    TemperatureColumn,
    TileWorkspace,
    return_free_memory,
)
from rlmath.engine.torch_backend.head_blocks import BlockScratch, HeadBlocks
from rlmath.engine.torch_backend.logits_backward import chunk_grad

__all__ = ["head_grad"]


def head_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    owned: torch.Tensor,
    live: torch.Tensor | None,
    *,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    w: torch.Tensor | None,
    temperature: Temperature,
    need: tuple[bool, bool, bool],
    grad_hidden_in_compute_dtype: bool,
    real: int,
    rows: int,
    tile: int,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden, grad_weight, grad_bias)``, each ``None`` unless ``need`` asks for it.

    ``grad_hidden`` is in the compute dtype when ``grad_hidden_in_compute_dtype``
    (for a sum over ranks before rounding), else in ``hidden``'s dtype. Weight
    rows past ``real`` (padding) get zero gradients.

    Args:
        hidden, weight, bias, labels, owned, live: as in :class:`HeadBlocks`.
        lse: ``(N,)`` saved log-sum-exp; alpha ``(N, 1)``, beta ``(N, 1)`` or
            ``None``, w ``(N, K)`` or ``None``: the gradient coefficients (zero on
            dead rows).
        temperature: ``None``, a float or an ``(N,)`` compute-dtype tensor.
        need: gradients wanted for ``(hidden, weight, bias)``.
        real, rows, tile: real weight rows, rows per chunk, entries per tile.
        scale, softcap: the logit transform (see :meth:`HeadBlocks.transformed`).
    """
    need_h, need_w, need_b = need
    cdt, dev = lse.dtype, hidden.device
    blocks = HeadBlocks(
        hidden, weight, bias, labels, owned, live, rows, tile, real, cdt, scale, softcap
    )
    half_h, half_w = hidden.dtype != cdt, weight.dtype != cdt
    lowp = (half_h or half_w) and policy.half_matmuls_pay(dev)
    full_h = grad_hidden_in_compute_dtype and half_h
    grad_h = acc_h = None
    if need_h:
        grad_h = torch.empty(hidden.shape, dtype=cdt if full_h else hidden.dtype, device=dev)
        if not blocks.tile_spans:
            grad_h.zero_()
        if grad_h.dtype == cdt:
            acc_h = grad_h
    # The first block row writes each weight-gradient tile, later ones accumulate:
    # no separate pass to zero V·H entries (padding rows and an empty input are zeroed).
    grad_w = None
    if need_w:
        grad_w = torch.empty(weight.shape, dtype=cdt, device=dev)
        if not blocks.block_rows:
            grad_w.zero_()
        elif real < weight.shape[0]:
            grad_w[real:].zero_()
    grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b else None
    one_block = functools.partial(
        _block_grad,
        blocks=blocks,
        coefficients=(lse.unsqueeze(-1), alpha, beta, w),
        temp=TemperatureColumn(temperature, cdt, dev),
        lowp=lowp,
    )
    along_rows, along_columns = need_h, need_w or need_b
    if grad_h is None or acc_h is not None or blocks.row_major:
        blocks.run(
            functools.partial(one_block, out=_Gradients(grad_h, acc_h, grad_w, grad_b)),
            along_rows=along_rows,
            along_columns=along_columns,
        )
    else:
        # A CPU with a half-precision grad_hidden: the blocks of a row do not
        # run one after another, so each row sums in a compute-dtype buffer,
        # rounded into grad_hidden by the row's last block (an accelerator
        # sums a row span at a time). Bands of rows run one after another,
        # each with a buffer of its own rows only: the blocks still add in
        # the same order (a tile's blocks in row order, a row's in tile
        # order), so the results are those of one band of every row.
        H = hidden.shape[1]
        for i0, i1 in _bands(blocks.block_rows, H * torch.finfo(cdt).bits // 8):
            r0, r1 = blocks.block_rows[i0][0], blocks.block_rows[i1 - 1][1]
            acc = torch.empty((r1 - r0, H), dtype=cdt, device=dev)
            out = _Gradients(grad_h, acc, grad_w, grad_b, acc_row0=r0)
            blocks.run(
                functools.partial(one_block, out=out),
                band=(i0, i1),
                along_rows=along_rows,
                along_columns=along_columns,
            )
            del acc, out  # before the next band's, and before grad_weight is rounded
    if grad_w is not None and half_w:
        # Rounding grad_weight is the pass's peak (the compute-dtype sum and its
        # rounded copy at once): the workers' freed blocks go back to the OS first.
        return_free_memory(dev)
        grad_w = grad_w.to(weight.dtype)
    if grad_b is not None and bias is not None and bias.dtype != cdt:
        grad_b = grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


class _Gradients(NamedTuple):
    """The outputs a block adds into.

    ``acc_h`` is ``grad_h`` itself, or its compute-dtype sum (rounded into
    ``grad_h`` by a row's last block), or ``None`` where each row span sums in
    a block buffer (an accelerator).
    """

    grad_h: torch.Tensor | None
    acc_h: torch.Tensor | None
    grad_w: torch.Tensor | None
    grad_b: torch.Tensor | None
    acc_row0: int = 0  # the row of grad_h that acc_h's first row sums


#: The most bytes of the compute-dtype ``grad_hidden`` rows summed at once on a CPU.
BAND_BYTES = 8 << 20


def _bands(block_rows: list[tuple[int, int]], row_bytes: int) -> list[tuple[int, int]]:
    """Runs ``(i0, i1)`` of consecutive block rows, each of at most :data:`BAND_BYTES`
    of accumulator (at least one block row)."""
    bands: list[tuple[int, int]] = []
    i0 = 0
    for i, (_, r1) in enumerate(block_rows):
        if i > i0 and (r1 - block_rows[i0][0]) * row_bytes > BAND_BYTES:
            bands.append((i0, i))
            i0 = i
    if block_rows:
        bands.append((i0, len(block_rows)))
    return bands


def _block_grad(
    i: int,
    j: int,
    scratch: BlockScratch,
    *,
    blocks: HeadBlocks,
    coefficients: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    temp: TemperatureColumn,
    out: _Gradients,
    lowp: bool,
) -> None:
    """Block ``(i, j)``: its logits recomputed, their gradient, its share of every gradient.

    The logits of rows ``block_rows[i]`` for tile ``tile_spans[j]`` are turned
    slice by slice into their gradient ``g`` (:func:`chunk_grad`, then the chain
    rule of the transform); then ``grad_hidden[rows] (+)= g @ weight_tile``
    (the first tile writes), ``grad_weight[tile] (+)= g.T @ hidden_rows`` (the
    first block row writes) and ``grad_bias[tile] += Σ g``. ``coefficients``
    are the whole pass's ``(lse, alpha, beta, w)``.
    """
    (r0, r1), (v0, v1) = blocks.block_rows[i], blocks.tile_spans[j]
    c, H, cdt = r1 - r0, blocks.hidden.shape[1], blocks.dtype
    weight = blocks.weight
    scratch.begin_tile(v0, v1)
    ws = scratch.ws
    h = blocks.hidden_rows(r0, r1, scratch)
    z = blocks.transformed(scratch, blocks.logits(scratch, h, v0, v1))
    # In place over the logits block when it is already a compute-dtype buffer
    # of its own; a transformed block is still needed by the chain rule.
    g = z if h.dtype == cdt and not blocks.transform else ws.get("g", c)
    lse, alpha, beta, w = coefficients
    idx, inside = blocks.tile_labels(r0, r1, v0, v1)
    w_in = torch.where(inside, w[r0:r1], 0.0) if w is not None else None
    for s0, s1 in blocks.slices(c):
        r = slice(r0 + s0, r0 + s1)
        chunk_grad(
            z[s0:s1],
            scratch.small,
            g[s0:s1],
            lse=lse[r],
            alpha=alpha[r],
            beta=beta[r] if beta is not None else None,
            w=w_in[s0:s1] if w_in is not None else None,
            labels=idx[s0:s1],
            temperature=temp.rows(r.start, r.stop),
        )
        if blocks.transform:
            blocks.chain_rule(g[s0:s1], z[s0:s1])
    last = j == len(blocks.tile_spans) - 1
    acc = None
    if out.grad_h is not None:
        a0 = out.acc_row0
        acc = (
            out.acc_h[r0 - a0 : r1 - a0]
            if out.acc_h is not None
            else ws.scratch("gh32", (c, H), cdt)
        )
    if lowp:
        _lowp_matmuls(
            g,
            h,
            weight[v0:v1],
            ws,
            acc,
            out.grad_w[v0:v1] if out.grad_w is not None else None,
            first_h=j == 0,
            first_w=i == 0,
        )
    else:
        if acc is not None:
            w_tile = weight[v0:v1]
            if w_tile.dtype != cdt:
                w_tile = ws.scratch("w32", (v1 - v0, H), cdt)
                if scratch.weight_tile != j:
                    w_tile.copy_(weight[v0:v1])
                    scratch.weight_tile = j
            cpu_matmul.add_mm_(acc, g, w_tile, first=j == 0, onednn=blocks.onednn)
        if out.grad_w is not None:
            h_c = ws.scratch("h32", (c, H), cdt).copy_(h) if h.dtype != cdt else h
            cpu_matmul.add_mm_(out.grad_w[v0:v1], g.T, h_c, first=i == 0, onednn=blocks.onednn)
    if out.grad_b is not None:
        out.grad_b[v0:v1] += g.sum(0)
    if last and acc is not None and out.grad_h is not None and out.acc_h is not out.grad_h:
        out.grad_h[r0:r1].copy_(acc)


def _lowp_matmuls(
    g: torch.Tensor,
    h: torch.Tensor,
    w_tile: torch.Tensor,
    ws: TileWorkspace,
    acc_h: torch.Tensor | None,
    acc_w: torch.Tensor | None,
    *,
    first_h: bool,
    first_w: bool,
) -> None:
    """``acc_h (+)= g @ w_tile`` and ``acc_w += g.T @ h`` as half-precision matmuls.

    ``g`` ``(c, tile)`` is the block gradient in the compute dtype; it is rounded
    to the dtype of ``h`` ``(c, H)`` and ``w_tile`` ``(tile, H)`` once, each
    product is formed by a half-precision matmul (fp32 accumulation inside the
    GEMM) and added to the fp32 accumulators ``acc_h`` ``(c, H)`` and
    ``acc_w`` ``(tile, H)``; ``first_h`` / ``first_w`` overwrite them instead.
    """
    c, tile, H = g.shape[0], g.shape[1], h.shape[1]
    g_half = ws.get("g_half", c, dtype=h.dtype).copy_(g)
    if acc_h is not None:
        part = torch.mm(g_half, w_tile, out=ws.scratch("gh_part", (c, H), h.dtype))
        if first_h:
            acc_h.copy_(part)
        else:
            acc_h.add_(part)
    if acc_w is not None:
        part = torch.mm(g_half.T, h, out=ws.scratch("gw_part", (tile, H), h.dtype))
        if first_w:
            acc_w.copy_(part)
        else:
            acc_w.add_(part)
