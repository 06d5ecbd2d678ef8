"""The fused LM head's backward pass: gradients of hidden, weight and bias, block by block.

Each block of logits is recomputed and turned into its gradient ``g`` with
:func:`rlmath.engine.torch_backend.logits_backward.chunk_grad` (from the saved
log-sum-exp, so a tile needs nothing from the others), then fed to two
matmuls and a sum: ``grad_hidden[chunk] += g @ weight_tile``,
``grad_weight[tile] += g.T @ hidden_chunk`` and ``grad_bias[tile] += Σ g``.
On a CPU the first three steps run per row piece of the block and the
``grad_weight`` matmul per vocabulary-entry piece, each piece one worker task
(:class:`~rlmath.engine.torch_backend.head_blocks.HeadBlocks`).

For half-precision inputs on a CPU the weight tile and hidden chunk are upcast
for these matmuls; on an accelerator ``g`` is rounded to the inputs' dtype and
the matmuls run in half precision (tensor cores), each product added to fp32
accumulators (:func:`rlmath.engine.policy.half_matmuls_pay`). Either way
``grad_weight`` accumulates in one compute-dtype buffer of the weight's shape,
rounded once at the end, as ``grad_hidden`` is per chunk (or over all rows,
when the engine sums it over a vocabulary-parallel group first).
"""

from __future__ import annotations

import functools

import torch

from rlmath.engine import policy
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, TileWorkspace
from rlmath.engine.torch_backend.head_blocks import HeadBlocks
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
    cdt, dev, H = lse.dtype, hidden.device, hidden.shape[1]
    blocks = HeadBlocks(
        hidden, weight, bias, labels, owned, live, rows, tile, real, cdt, scale, softcap
    )
    ws = blocks.ws
    temp = TemperatureColumn(temperature, cdt, dev)
    lse_col = lse.unsqueeze(-1)
    half_h, half_w = hidden.dtype != cdt, weight.dtype != cdt
    lowp = (half_h or half_w) and policy.half_matmuls_pay(dev)
    full_h = grad_hidden_in_compute_dtype and half_h
    grad_h = None
    if need_h:
        grad_h = torch.empty(hidden.shape, dtype=cdt if full_h else hidden.dtype, device=dev)
        if not blocks.tile_spans:
            grad_h.zero_()
    # The first row chunk writes each weight-gradient tile, later ones accumulate:
    # no separate pass to zero V·H entries (padding rows and an empty input are zeroed).
    grad_w = None
    if need_w:
        grad_w = torch.empty(weight.shape, dtype=cdt, device=dev)
        if not blocks.row_spans:
            grad_w.zero_()
        elif real < weight.shape[0]:
            grad_w[real:].zero_()
    grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b else None
    for j, (r0, r1) in enumerate(blocks.row_spans):
        c = r1 - r0
        h = blocks.hidden_rows(r0, r1)
        h_c = ws.scratch("h32", (c, H), cdt).copy_(h) if half_h and need_w and not lowp else h
        acc = None
        if grad_h is not None:
            acc = ws.scratch("gh32", (c, H), cdt) if half_h and not full_h else grad_h[r0:r1]
        for k, (v0, v1) in enumerate(blocks.tile_spans):
            blocks.begin_tile(v0, v1)
            # In place over the logits block when it is already a compute-dtype buffer
            # of its own; a transformed block is still needed by the chain rule.
            in_place = h.dtype == cdt and not blocks.transform
            g = ws.get("z", c) if in_place else ws.get("g", c)
            w_tile = weight[v0:v1]
            if acc is not None and half_w and not lowp:
                w_tile = ws.scratch("w32", (v1 - v0, H), cdt).copy_(w_tile)
            one_piece = functools.partial(
                _piece_grad,
                blocks=blocks,
                h=h,
                r0=r0,
                tile=(v0, v1),
                g=g,
                coefficients=(lse_col, alpha, beta, w),
                temp=temp,
                # On an accelerator the half-precision matmuls follow on the whole block.
                grad_hidden=None if lowp or acc is None else (acc, w_tile, k == 0),
            )
            blocks.for_row_pieces(c, one_piece)
            if lowp:
                _lowp_matmuls(
                    g,
                    h,
                    weight[v0:v1],
                    ws,
                    acc,
                    grad_w[v0:v1] if grad_w is not None else None,
                    first_h=k == 0,
                    first_w=j == 0,
                )
            elif grad_w is not None:
                weight_piece = functools.partial(
                    _piece_grad_weight, g=g, h=h_c, out=grad_w[v0:v1], first=j == 0
                )
                blocks.for_entry_pieces(v1 - v0, weight_piece)
            if grad_b is not None:
                grad_b[v0:v1] += g.sum(0)
        if grad_h is not None and acc is not None and half_h and not full_h:
            grad_h[r0:r1].copy_(acc)
    if grad_w is not None and half_w:
        grad_w = grad_w.to(weight.dtype)
    if grad_b is not None and bias is not None and bias.dtype != cdt:
        grad_b = grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


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


def _piece_grad(
    a: int,
    b: int,
    ws: TileWorkspace,
    *,
    blocks: HeadBlocks,
    h: torch.Tensor,
    r0: int,
    tile: tuple[int, int],
    g: torch.Tensor,
    coefficients: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    temp: TemperatureColumn,
    grad_hidden: tuple[torch.Tensor, torch.Tensor, bool] | None,
) -> None:
    """Rows ``[a, b)`` of one block (block rows from ``r0``): logits, their gradient, ``grad_hidden``.

    The logits of those rows are recomputed, turned slice by slice into their
    gradient in rows ``[a, b)`` of ``g`` (:func:`chunk_grad`, then the chain
    rule of the transform), and, with ``grad_hidden = (acc, w_tile, first)``,
    ``acc[a:b] (+)= g[a:b] @ w_tile``. ``coefficients`` are the whole pass's
    ``(lse, alpha, beta, w)``.
    """
    v0, v1 = tile
    lse, alpha, beta, w = coefficients
    z = blocks.transformed(blocks.logits(h[a:b], v0, v1, a), a)
    idx, inside = blocks.tile_labels(r0 + a, r0 + b, v0, v1)
    w_in = torch.where(inside, w[r0 + a : r0 + b], 0.0) if w is not None else None
    gp = g[a:b]
    for s0, s1 in blocks.slices(b - a):
        r = slice(r0 + a + s0, r0 + a + s1)
        chunk_grad(
            z[s0:s1],
            ws,
            gp[s0:s1],
            lse=lse[r],
            alpha=alpha[r],
            beta=beta[r] if beta is not None else None,
            w=w_in[s0:s1] if w_in is not None else None,
            labels=idx[s0:s1],
            temperature=temp.rows(r.start, r.stop),
        )
        if blocks.transform:
            blocks.chain_rule(gp[s0:s1], z[s0:s1])
    if grad_hidden is not None:
        acc, w_tile, first = grad_hidden
        if first:
            torch.mm(gp, w_tile, out=acc[a:b])
        else:
            acc[a:b].addmm_(gp, w_tile)


def _piece_grad_weight(
    e0: int, e1: int, _: None, *, g: torch.Tensor, h: torch.Tensor, out: torch.Tensor, first: bool
) -> None:
    """Entries ``[e0, e1)`` of a tile's weight gradient: ``out[e0:e1] (+)= g[:, e0:e1].T @ h``."""
    if first:
        torch.mm(g[:, e0:e1].T, h, out=out[e0:e1])
    else:
        out[e0:e1].addmm_(g[:, e0:e1].T, h)
