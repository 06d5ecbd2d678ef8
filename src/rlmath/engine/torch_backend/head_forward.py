"""The fused LM head's forward pass: per-row statistics of ``hidden @ weight.T + bias``.

For each block of rows × vocabulary tile (:class:`HeadBlocks`) the logits
are computed and reduced slice by slice
(:func:`rlmath.engine.torch_backend.logits_forward.chunk_stats`); the tiles'
statistics are merged into the rows' running ones
(:func:`rlmath.engine.stats.merge_tile_stats`) in tile order (the blocks of a
row run one after another, those of different rows in parallel on a CPU), so
only three numbers per row (and the label logits) outlive a block.
"""

from __future__ import annotations

import functools

import torch

from rlmath.engine.stats import merge_tile_stats
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, fold_tiles
from rlmath.engine.torch_backend.head_blocks import BlockScratch, HeadBlocks
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
    one_block = functools.partial(
        _block_stats,
        blocks=blocks,
        temp=temp,
        entropy=want_entropy,
        out=(big, total_s, total_t),
        z_label=z_label,
    )
    blocks.run(one_block, along_rows=True, along_columns=False)
    if temp.col is not None:
        # Upcast, then divide by T: the rounding of the shifted block buffer.
        z_label = z_label / temp.col
    return big, total_s, total_t, z_label


def _block_stats(
    i: int,
    j: int,
    scratch: BlockScratch,
    *,
    blocks: HeadBlocks,
    temp: TemperatureColumn,
    entropy: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    z_label: torch.Tensor,
) -> None:
    """Block ``(i, j)``: its logits, label logits, statistics merged into the rows' in ``out``.

    The logits of rows ``block_rows[i]`` for tile ``tile_spans[j]`` are
    computed into the block buffer, reduced slice by slice (:func:`chunk_stats`)
    and merged into rows ``[r0, r1)`` of the running ``out = (m, s, t)``.
    """
    (r0, r1), (v0, v1) = blocks.block_rows[i], blocks.tile_spans[j]
    scratch.begin_tile(v0, v1)
    h = blocks.hidden_rows(r0, r1, scratch)
    z = blocks.transformed(scratch, blocks.logits(scratch, h, v0, v1))
    idx, inside = blocks.tile_labels(r0, r1, v0, v1)
    z_label[r0:r1] = torch.where(inside, z.gather(1, idx), z_label[r0:r1])
    c = r1 - r0
    tm = torch.empty(c, dtype=z_label.dtype, device=z.device)
    ts = torch.empty_like(tm)
    tt = torch.empty_like(tm) if entropy else None
    for s0, s1 in blocks.slices(c):
        cm, cs, ct = chunk_stats(
            z[s0:s1], scratch.small, temperature=temp.rows(r0 + s0, r0 + s1), entropy=entropy
        )
        tm[s0:s1], ts[s0:s1] = cm, fold_tiles(cs.unsqueeze(-1))[:, 0]
        if tt is not None and ct is not None:
            tt[s0:s1] = fold_tiles(ct.unsqueeze(-1))[:, 0]
    big, total_s, total_t = out
    old = (big[r0:r1], total_s[r0:r1], total_t[r0:r1] if total_t is not None else None)
    m, s, t = merge_tile_stats(old, (tm, ts, tt))
    big[r0:r1], total_s[r0:r1] = m, s
    if total_t is not None and t is not None:
        total_t[r0:r1] = t
