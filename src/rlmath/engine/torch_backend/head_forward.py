"""The fused LM head's forward pass: per-row statistics of ``hidden @ weight.T + bias``.

For each chunk of rows and each vocabulary tile, one block of logits is
computed and reduced piece by piece (:class:`HeadBlocks`, then
:func:`rlmath.engine.torch_backend.logits_forward.chunk_stats`); the tiles'
statistics are merged per row
(:func:`rlmath.engine.stats.merge_tile_stats`), so only three numbers per row
(and the label logits) outlive a block.
"""

from __future__ import annotations

import functools

import torch

from rlmath.engine.stats import merge_tile_stats
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, TileWorkspace
from rlmath.engine.torch_backend.head_blocks import HeadBlocks
from rlmath.engine.torch_backend.logits_forward import chunk_stats

__all__ = ["head_stats"]


def head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    owned: torch.Tensor,
    live: torch.Tensor | None,
    temperature: Temperature,
    want_entropy: bool,
    *,
    real: int,
    rows: int,
    tile: int,
    dtype: torch.dtype,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(m, s, t, z_labels)`` of every row of the head's logits (see :class:`HeadBlocks`).

    The logits are ``softcap·tanh(scale·(hidden @ weight.T + bias) / softcap) / T``.
    ``z_labels`` ``(N, K)`` are the logits of the owned labels (0 elsewhere).
    A row without a finite logit gives ``m = -inf, s = t = 0``.
    """
    dev, N = hidden.device, hidden.shape[0]
    blocks = HeadBlocks(
        hidden, weight, bias, labels, owned, live, rows, tile, real, dtype, scale, softcap
    )
    temp = TemperatureColumn(temperature, dtype, dev)
    big = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    total_s = torch.zeros(N, dtype=dtype, device=dev)
    total_t = torch.zeros(N, dtype=dtype, device=dev) if want_entropy else None
    z_label = torch.zeros(labels.shape, dtype=dtype, device=dev)
    for r0, r1 in blocks.row_spans:
        h = blocks.hidden_rows(r0, r1)
        c = r1 - r0
        zero = torch.zeros(c, dtype=dtype, device=dev)
        stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] = (
            torch.full((c,), float("-inf"), dtype=dtype, device=dev),
            zero,
            zero if want_entropy else None,
        )
        tm, ts = torch.empty_like(zero), torch.empty_like(zero)
        tt = torch.empty_like(zero) if want_entropy else None
        for v0, v1 in blocks.tile_spans:
            blocks.begin_tile(v0, v1)
            one_piece = functools.partial(
                _piece_stats,
                blocks=blocks,
                h=h,
                r0=r0,
                tile=(v0, v1),
                temp=temp,
                entropy=want_entropy,
                out=(tm, ts, tt),
                z_label=z_label,
            )
            blocks.for_row_pieces(c, one_piece)
            stats = merge_tile_stats(stats, (tm, ts, tt))
        big[r0:r1], total_s[r0:r1] = stats[0], stats[1]
        if total_t is not None and stats[2] is not None:
            total_t[r0:r1] = stats[2]
    if temp.col is not None:
        # Upcast, then divide by T: the rounding of the shifted block buffer.
        z_label = z_label / temp.col
    return big, total_s, total_t, z_label


def _piece_stats(
    a: int,
    b: int,
    ws: TileWorkspace,
    *,
    blocks: HeadBlocks,
    h: torch.Tensor,
    r0: int,
    tile: tuple[int, int],
    temp: TemperatureColumn,
    entropy: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    z_label: torch.Tensor,
) -> None:
    """Rows ``[a, b)`` of one block (block rows from ``r0``): logits, label logits, statistics.

    The logits of those rows for the tile are computed into the block buffer and
    reduced slice by slice (:func:`chunk_stats`) into rows ``[a, b)`` of ``out``.
    """
    v0, v1 = tile
    z = blocks.transformed(blocks.logits(h[a:b], v0, v1, a), a)
    idx, inside = blocks.tile_labels(r0 + a, r0 + b, v0, v1)
    rows = slice(r0 + a, r0 + b)
    z_label[rows] = torch.where(inside, z.gather(1, idx), z_label[rows])
    tm, ts, tt = out
    for s0, s1 in blocks.slices(b - a):
        first = r0 + a + s0
        cm, cs, ct = chunk_stats(
            z[s0:s1], ws, temperature=temp.rows(first, first + s1 - s0), entropy=entropy
        )
        tm[a + s0 : a + s1], ts[a + s0 : a + s1] = cm, cs
        if tt is not None and ct is not None:
            tt[a + s0 : a + s1] = ct
