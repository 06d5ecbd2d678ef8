"""``Σ_v π_v²`` statistics of logits, chunk by chunk (no gradient)."""

from __future__ import annotations

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size, fold_groups
from rlmath.engine.torch_backend.buffers import (
    Temperature,
    TemperatureColumn,
    Workspace,
)
from rlmath.engine.torch_backend.reductions import scaled_max, scaled_shift
from rlmath.engine.torch_backend.rows import RowBlocks, chunk_ranges, real_columns
from rlmath.engine.tree import TileRun, padded_tiles, tile_count, tile_sums

__all__ = ["pi_squared_stats"]


def pi_squared_stats(
    logits: torch.Tensor,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, s, u)``: ``m = max z``, ``s = Σ e^{z-m}``, ``u = Σ e^{2(z-m)}``, ``(N,)`` each.

    ``Σ π² = u / s²``; the sums are taken per 128-column tile and each row's
    tiles added in the fixed tree of :mod:`rlmath.engine.tree` (:func:`~rlmath.engine.policy.fold_groups`); a row without a
    finite logit gives ``m = -inf, s = u = 0``. ``shift``: ``(N,)`` the rows'
    max over the whole vocabulary, used instead of the max of the columns read
    here; ``s`` and ``u`` are then per tile, ``(N, n)``, for the engine to add
    across shards.
    """
    dev = logits.device
    N = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    per_tile = shift is not None
    width = (tile_count(real),) if per_tile else ()
    m = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    s = torch.zeros(N, *width, dtype=dtype, device=dev)
    u = torch.zeros(N, *width, dtype=dtype, device=dev)
    if N == 0 or real == 0:
        return m, s, u
    chunk = chunk or auto_chunk_size(real, N, device=dev)
    lay = RowBlocks(real_columns(logits, real))
    temp = TemperatureColumn(temperature, dtype, dev)
    n = tile_count(real)
    groups = fold_groups(list(chunk_ranges(N, chunk, lay)), padded_tiles(n), 2)

    def one_group(i: int, _: int, ws: Workspace) -> None:
        g0, g1 = groups[i][0][0], groups[i][-1][1]
        # Each row's tiles are added up once its run of chunks is done.
        run = None if per_tile else TileRun(g1 - g0, n, 2, dtype, dev)
        for a, b in groups[i]:
            src, t = lay.get(a, b), temp.rows(a, b)
            cm = scaled_max(src, t, dtype) if shift is None else shift[a:b].unsqueeze(-1)
            e = scaled_shift(src, t, torch.where(cm == float("-inf"), 0, cm), ws.get("y", b - a))
            e.exp_()
            m[a:b] = cm.squeeze(-1)
            if run is None:
                s[a:b] = tile_sums(e)
                u[a:b] = tile_sums(e.mul_(e))
            else:
                tile_sums(e, out=run.slot(0, a - g0, b - g0))
                tile_sums(e.mul_(e), out=run.slot(1, a - g0, b - g0))
        if run is not None:
            s[g0:g1], u[g0:g1] = run.fold()

    runs = [(i, i + 1) for i in range(len(groups))]
    run_chunks(runs, one_group, lambda: Workspace(min(chunk, N), real, dtype, dev), dev)
    return m, s, u
