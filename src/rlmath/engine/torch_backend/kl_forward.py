"""The forward pass of the exact KL between two sets of logits, chunk by chunk.

``KL = Σ_j p_j·(ls^z_j - ls^r_j)`` per row, a weighted sum of per-entry
differences (not ``Σ p·z - lse_z - (Σ p·r - lse_r)``) so that the small KL of
two close distributions is not lost to cancellation. Every sum over the
vocabulary is taken per 128-column tile and the tiles added in the fixed tree
of :mod:`rlmath.engine.tree`. A vocabulary shard on the tile grid runs the
same sums in two phases (:func:`kl_stats` with ``shift`` and ``log_sums``),
between which the engine adds every shard's tiles in that tree, so that the
result is bitwise one process's; other shards normalize locally and the
engine combines them by the chain rule of the KL
(:func:`rlmath.engine.stats.combine_kl`).
"""

from __future__ import annotations

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size
from rlmath.engine.stats import finish_kl
from rlmath.engine.torch_backend.buffers import (
    Temperature,
    TemperatureColumn,
    Workspace,
    _Tree,
    fold_tiles,
    tree_for,
)
from rlmath.engine.torch_backend.reductions import scaled_max, scaled_shift
from rlmath.engine.torch_backend.rows import RowBlocks, chunk_ranges, real_columns
from rlmath.engine.tree import tile_count, tile_sums

__all__ = ["chunk_kl", "kl_stats"]

NEG_INF = float("-inf")


def chunk_kl(
    src_z: torch.Tensor,
    src_r: torch.Tensor,
    ws: Workspace,
    temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw per-row KL statistics of one ``(c, V)`` chunk: ``(kl, m_z, log s_z, m_r, log s_r)``.

    Each row is shifted by its max (by 0 where the max is ``-inf``: a row with
    no mass). :func:`finish_kl` turns them into ``(KL, lse_z, lse_r)``.

    Args:
        src_z, src_r: ``(c, V)`` raw policy and reference logits, any floating
            dtypes and strides.
        ws: scratch buffers (uses ``"y"``, ``"e"`` and ``"yr"``).
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
    """
    c = src_z.shape[0]
    e = ws.get("e", c)
    mz = scaled_max(src_z, temperature, ws.dtype)
    mr = scaled_max(src_r, temperature, ws.dtype)
    yr = scaled_shift(src_r, temperature, torch.where(mr == NEG_INF, 0, mr), ws.get("yr", c))
    # Both sums of exponentials go to one tree of 2c rows (the same bits as two).
    pair = _kept_tree(e, 2 * c)
    if pair is None:
        log_sr = _tree_sum(torch.exp(yr, out=e)).log()
    else:
        tile_sums(torch.exp(yr, out=e), out=pair.leaves[c:, :, 0])
    yz = scaled_shift(src_z, temperature, torch.where(mz == NEG_INF, 0, mz), ws.get("y", c))
    if pair is None:
        sz = _tree_sum(torch.exp(yz, out=e))
    else:
        tile_sums(torch.exp(yz, out=e), out=pair.leaves[:c, :, 0])
        sums = pair.fold_leaves()[:, 0]
        sz, log_sr = sums[:c], sums[c:].log()
    log_sz = sz.log()
    kl = _tree_sum(_weighted_difference(e, yz, yr, log_sz, log_sr), nan=True).div_(sz)
    return kl, mz.squeeze(-1), log_sz, mr.squeeze(-1), log_sr


def _kept_tree(x: torch.Tensor, rows: int) -> _Tree | None:
    """This thread's kept tree for ``rows`` rows of ``x``'s tiles, when one is kept."""
    if type(x) is not torch.Tensor:
        return None
    return tree_for(rows, tile_count(x.shape[1]), 1, x.dtype, x.device)


def _tree_sum(x: torch.Tensor, nan: bool = False) -> torch.Tensor:
    """Row sums of a ``(c, V)`` chunk in the fixed order: tiles, then the tree.

    The tile sums are written straight into the leaves of a kept tree where there is one.
    """
    tree = _kept_tree(x, x.shape[0])
    if tree is None:
        return fold_tiles(tile_sums(x, nan=nan).unsqueeze(-1))[:, 0]
    tile_sums(x, nan=nan, out=tree.leaves[:, :, 0])
    return tree.fold_leaves()[:, 0]


def _weighted_difference(
    e: torch.Tensor, yz: torch.Tensor, yr: torch.Tensor, log_sz: torch.Tensor, log_sr: torch.Tensor
) -> torch.Tensor:
    """``e·(ls^z - ls^r)`` in place of ``e`` (``yz`` is overwritten); NaN where both logits are
    ``-inf`` (then ``e = 0``: the NaN-skipping sum drops it)."""
    d = yz.sub_(yr).sub_((log_sz - log_sr).unsqueeze(-1))
    return e.mul_(d)


def kl_stats(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    *,
    shift: tuple[torch.Tensor, torch.Tensor] | None = None,
    log_sums: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(KL, lse_z, lse_r)`` of every row (only the first ``real`` columns), ``(N,)`` each.

    The two phases of a vocabulary shard on the tile grid, each shifted by the
    rows' global maxima ``shift = (max z, max r)`` ``(N,)``: without
    ``log_sums``, the per-tile sums ``(Σ e^{z - max z}, Σ e^{r - max r})``
    ``(N, n)``; with the global
    ``log_sums = (log Σ e^{z - max z}, log Σ e^{r - max r})``, the per-tile sums
    of ``e^{z - max z}·(ls^z - ls^r)`` ``(N, n)`` (one tensor).
    """
    dev = logits.device
    lay_z = RowBlocks(real_columns(logits, real))
    lay_r = RowBlocks(real_columns(ref_logits, real))
    N = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    if shift is not None:
        return _shard_phase(lay_z, lay_r, N, temperature, real, chunk, dtype, shift, log_sums)
    stats = [torch.zeros(N, dtype=dtype, device=dev) for _ in range(5)]
    if N == 0 or real == 0:
        stats[1].fill_(NEG_INF)
        stats[3].fill_(NEG_INF)
        return finish_kl(*stats)
    chunk = chunk or auto_chunk_size(real, N, device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)
    ranges = list(chunk_ranges(N, chunk, lay_z, lay_r))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        for out, x in zip(stats, chunk_kl(lay_z.get(a, b), lay_r.get(a, b), ws, temp.rows(a, b))):
            out[a:b] = x

    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, N), real, dtype, dev), dev)
    return finish_kl(*stats)


def _shard_phase(
    lay_z: RowBlocks,
    lay_r: RowBlocks,
    N: int,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    shift: tuple[torch.Tensor, torch.Tensor],
    log_sums: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, ...]:
    """One phase of :func:`kl_stats` on a shard: the operations of :func:`chunk_kl`."""
    dev = shift[0].device
    n = tile_count(real)
    outs = [torch.zeros(N, n, dtype=dtype, device=dev) for _ in range(1 if log_sums else 2)]
    if N == 0 or real == 0:
        return tuple(outs)
    chunk = chunk or auto_chunk_size(real, N, device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)
    mz_all, mr_all = (torch.where(m == NEG_INF, 0, m).unsqueeze(-1) for m in shift)
    ranges = list(chunk_ranges(N, chunk, lay_z, lay_r))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        c, t = b - a, temp.rows(a, b)
        e = ws.get("e", c)
        yr = scaled_shift(lay_r.get(a, b), t, mr_all[a:b], ws.get("yr", c))
        yz = scaled_shift(lay_z.get(a, b), t, mz_all[a:b], ws.get("y", c))
        if log_sums is None:
            outs[1][a:b] = tile_sums(torch.exp(yr, out=e))
            outs[0][a:b] = tile_sums(torch.exp(yz, out=e))
        else:
            torch.exp(yz, out=e)
            wd = _weighted_difference(e, yz, yr, log_sums[0][a:b], log_sums[1][a:b])
            outs[0][a:b] = tile_sums(wd, nan=True)

    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, N), real, dtype, dev), dev)
    return tuple(outs)
