"""The forward pass over logits: per-row statistics, one chunk of rows at a time.

One read of each chunk: its max, one fused shift by the max (and division by
the temperature), ``exp``, and the sums of ``exp(y)`` and (for the entropy)
``exp(y)·y`` over each 128-column tile of the row (:mod:`rlmath.engine.tree`:
the engine adds the tiles in a fixed tree, so that a row's sums do not depend
on how the vocabulary is split over processes). ``-inf`` logits (a padded
vocabulary) give ``exp(y) = 0`` and ``y = -inf``; their ``0·(-inf)`` products
are dropped by a NaN-ignoring sum. A row whose logits are all ``-inf`` has no
mass: it gives ``m = -inf, s = t = 0`` (another vocabulary shard then decides
the row). A NaN logit makes its row's statistics NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size, fold_groups
from rlmath.engine.torch_backend.buffers import (
    Temperature,
    TemperatureColumn,
    Workspace,
    fold_tiles,
)
from rlmath.engine.torch_backend.reductions import scaled_max, scaled_shift, upcast, upcasts_first
from rlmath.engine.torch_backend.rows import RowSource
from rlmath.engine.tree import TileRun, padded_tiles, tile_count, tile_sums

if TYPE_CHECKING:
    from rlmath.engine.sampling import KeptSet

__all__ = [
    "chunk_stats",
    "drop_dead_rows",
    "kept_chunk_stats",
    "kept_thresholds",
    "label_logits",
    "logits_max",
    "logits_stats",
]

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
TileSlots = tuple[torch.Tensor, torch.Tensor | None] | None


def chunk_stats(
    src: torch.Tensor,
    ws: Workspace,
    *,
    temperature: torch.Tensor | None = None,
    entropy: bool = False,
    shift: torch.Tensor | None = None,
    out: TileSlots = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Unnormalized per-row statistics of one ``(c, V)`` chunk of raw logits.

    Returns ``(m, s, t)``: ``m = max z`` ``(c,)``, and per 128-column tile
    ``s = Σ exp(z - m)`` ``(c, n)`` and ``t = Σ exp(z - m)·(z - m)`` ``(c, n)``
    (only with ``entropy``), in the compute dtype of ``ws``. A row without a
    finite logit gives ``m = -inf`` and NaN sums (:func:`drop_dead_rows` turns
    them into zeros).

    Args:
        src: ``(c, V)`` raw logits, any floating dtype and strides (read only);
            column 0 is the first column of a tile.
        ws: scratch buffers (uses ``"y"`` and, for the entropy, ``"e"``).
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
        entropy: also compute ``t``.
        shift: ``(c, 1)``: the max to shift by (the row's max over every shard
            of the vocabulary) instead of this chunk's own.
        out: where to write ``s`` and ``t`` (:meth:`rlmath.engine.tree.TileRun.slot`).
    """
    c = src.shape[0]
    out_s, out_t = out or (None, None)
    y = ws.get("y", c)
    if shift is None and upcasts_first(src, ws.dtype):
        src = upcast(src, y)  # the max and the shift read the fp32 copy
    m = scaled_max(src, temperature, ws.dtype) if shift is None else shift
    y = scaled_shift(src, temperature, m, y)
    t: torch.Tensor | None = None
    if entropy:
        e = torch.exp(y, out=ws.get("e", c))
        s = tile_sums(e, out=out_s)
        t = tile_sums(e.mul_(y), nan=True, out=out_t)
    else:
        s = tile_sums(y.exp_(), out=out_s)
    return m.squeeze(-1), s, t


def kept_chunk_stats(
    z: torch.Tensor,
    keep: torch.Tensor,
    ws: Workspace,
    *,
    entropy: bool = False,
    e: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    row_max: torch.Tensor | None = None,
    out: TileSlots = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_stats` of the softmax restricted to ``keep`` (a sampler's kept set).

    ``z``: ``(c, V)`` scaled logits in the compute dtype; ``keep``: ``(c, V)``
    1 in the kept set (which holds each row's largest logit), 0 outside. The sums are those of ``z`` with
    ``-inf`` outside ``keep``, term for term: ``exp`` is taken of the whole row
    and the terms outside are zeroed (``exp(-inf)`` is slow on CPUs).
    ``e``: ``exp(z - max z)`` already computed (with ``z - max z`` in
    ``ws["ky"]``; :meth:`~rlmath.engine.sampling.KeptSet.chunk`), overwritten.
    ``shift``: ``(c, 1)`` the rows' max over every vocabulary shard, to shift by
    instead of the max of these columns (then ``e`` is not given). ``row_max``:
    ``(c, 1)`` the max of ``z``'s rows when the search found it (with ``e``).
    ``out``: where to write the tile sums, as in :func:`chunk_stats`.
    """
    c = z.shape[0]
    out_s, out_t = out or (None, None)
    if shift is not None:
        m = shift
    else:
        m = row_max if row_max is not None else z.amax(-1, keepdim=True)
    if e is not None:
        y = ws.get("ky", c)
    else:
        y = torch.sub(z, m, out=ws.get("y", c))
        e = torch.exp(y, out=ws.get("e", c))
    e.mul_(keep)
    s = tile_sums(e, out=out_s)
    t = tile_sums(e.mul_(y), nan=True, out=out_t) if entropy else None
    return m.squeeze(-1), s, t


def drop_dead_rows(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``s = t = 0`` for rows with ``m = -inf`` (no finite logit: no mass), for all rows at once.

    ``s`` and ``t`` are ``(M,)`` or, per tile, ``(M, n)``.
    """
    dead = m == float("-inf")
    if s.dim() == 2:
        dead = dead.unsqueeze(-1)
    return m, s.masked_fill(dead, 0.0), t.masked_fill(dead, 0.0) if t is not None else None


def label_logits(
    src: RowSource, labels: torch.Tensor, temperature: TemperatureColumn, dtype: torch.dtype
) -> torch.Tensor:
    """The scaled logits ``z[labels]`` ``(M, K)`` of the selected rows, in one gather.

    Upcast, then divided by ``T``: the rounding of the shifted chunk buffer, so
    ``z - m`` equals the shifted value at the label.
    """
    if src.index is not None:
        z = src.logits[src.index.unsqueeze(-1), labels]
    else:
        assert src.layout is not None
        blocks = src.layout.blocks
        if len(blocks) == 1:
            z = blocks[0].gather(1, labels)
        else:
            z = torch.cat(
                [
                    b.gather(1, labels[o : o + b.shape[0]])
                    for b, o in zip(blocks, src.layout.starts, strict=True)
                ]
            )
    if z.dtype != dtype:
        z = z.to(dtype)
    col = temperature.col
    return z if col is None else z / col


def logits_stats(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    labels: torch.Tensor | None,
    temperature: Temperature,
    want_entropy: bool,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    shift: torch.Tensor | None = None,
    restrict: KeptSet | None = None,
) -> Stats:
    """:func:`chunk_stats` of every selected row of ``logits``, chunk by chunk.

    Args:
        logits: ``(..., V)`` raw logits; only the first ``real`` columns are read.
        row_index, narrow: which rows (see :class:`RowSource`).
        labels: ``(M, K)`` int64 column indices, or ``None``.
        temperature: ``None``, a float or an ``(M,)`` tensor in ``dtype``.
        want_entropy: also return ``t``.
        real: columns of ``logits`` that are real tokens.
        chunk: rows per chunk (``None``: :func:`rlmath.engine.policy.auto_chunk_size`).
        dtype: the compute dtype.
        shift: ``(M,)`` the max of each row over the whole vocabulary, to shift
            by instead of the max of the columns read here (:func:`logits_max`
            of every shard, combined).
        restrict: the kept set of a truncating sampler
            (:class:`~rlmath.engine.sampling.KeptSet`): each chunk's logits
            outside it count as ``-inf``. With ``shift``, its thresholds are
            given (found over every shard).

    Returns:
        ``(m, s, t, z_labels)`` for the ``M`` selected rows: ``m`` ``(M,)``; ``s``
        and ``t`` ``(M,)``, each row's tiles added in the fixed tree once its run
        of chunks is done (:func:`~rlmath.engine.policy.fold_groups`), or with
        ``shift`` per tile, ``(M, ceil(real / 128))``, for the engine to add
        across shards.
    """
    dev = logits.device
    src = RowSource(logits, real, row_index, narrow)
    M = src.num_rows
    per_tile = shift is not None
    if M and real and not per_tile and restrict is None:
        chunk = chunk or auto_chunk_size(real, M, device=dev)
        if chunk >= M and (src.layout is None or len(src.layout.blocks) == 1):
            # Every row in one chunk (rows in several memory blocks are several chunks).
            return _one_chunk_stats(src, labels, temperature, want_entropy, real, dtype)
    width = (tile_count(real),) if per_tile else ()
    m = torch.full((M,), float("-inf"), dtype=dtype, device=dev)
    s = torch.zeros(M, *width, dtype=dtype, device=dev)
    t = torch.zeros(M, *width, dtype=dtype, device=dev) if want_entropy else None
    z = torch.zeros(labels.shape, dtype=dtype, device=dev) if labels is not None else None
    if M == 0 or real == 0:
        return m, s, t, z
    chunk = chunk or auto_chunk_size(real, M, device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)
    k = 2 if want_entropy else 1
    groups = fold_groups(list(src.ranges(chunk)), padded_tiles(tile_count(real)), k)

    def one_group(i: int, _: int, ws: Workspace) -> None:
        g0, g1 = groups[i][0][0], groups[i][-1][1]
        # Each row's tiles are added up once its run of chunks is done: no
        # per-tile arrays of all rows, and the tree's ops once per run.
        run = None if per_tile else TileRun(g1 - g0, tile_count(real), k, dtype, dev)
        for a, b in groups[i]:
            out: TileSlots = None
            if run is not None:
                out = (run.slot(0, a - g0, b - g0), run.slot(1, a - g0, b - g0) if k == 2 else None)
            if restrict is not None:
                z, keep, e, row_max = restrict.chunk(a, b, src.rows(a, b, ws), temp.rows(a, b), ws)
                cm, cs, ct = kept_chunk_stats(
                    z, keep, ws, entropy=want_entropy, e=e, row_max=row_max,
                    shift=shift[a:b].unsqueeze(-1) if shift is not None else None, out=out,
                )  # fmt: skip
            else:
                cm, cs, ct = chunk_stats(
                    src.rows(a, b, ws),
                    ws,
                    temperature=temp.rows(a, b),
                    entropy=want_entropy,
                    shift=shift[a:b].unsqueeze(-1) if shift is not None else None,
                    out=out,
                )
            m[a:b] = cm
            if per_tile:
                s[a:b] = cs
                if t is not None and ct is not None:
                    t[a:b] = ct
        if run is not None:
            sums = run.fold()
            s[g0:g1] = sums[0]
            if t is not None:
                t[g0:g1] = sums[1]

    runs = [(i, i + 1) for i in range(len(groups))]
    run_chunks(runs, one_group, lambda: Workspace(min(chunk, M), real, dtype, dev), dev)
    if labels is not None:
        z = label_logits(src, labels, temp, dtype)
    m, s, t = drop_dead_rows(m, s, t)
    return m, s, t, z


def _one_chunk_stats(
    src: RowSource,
    labels: torch.Tensor | None,
    temperature: Temperature,
    want_entropy: bool,
    real: int,
    dtype: torch.dtype,
) -> Stats:
    """:func:`logits_stats` of rows that fit in one chunk: the same operations on the same
    rows, without the per-run buffers (a small call's time is its number of operations).

    The chunk runs on the calling thread, as one chunk does in :func:`run_chunks`,
    and its tiles go to the same tree, so every row has the bits it has in a larger call.
    """
    M, dev = src.num_rows, src.logits.device
    temp = TemperatureColumn(temperature, dtype, dev)
    ws = Workspace(M, real, dtype, dev)
    try:
        m, cs, ct = chunk_stats(
            src.rows(0, M, ws), ws, temperature=temp.rows(0, M), entropy=want_entropy
        )
        sums = fold_tiles(cs.unsqueeze(-1) if ct is None else torch.stack((cs, ct), -1))
    finally:
        ws.release()
    z = label_logits(src, labels, temp, dtype) if labels is not None else None
    m, s, t = drop_dead_rows(m, sums[:, 0], sums[:, 1] if ct is not None else None)
    return m, s, t, z


def logits_max(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The max of each selected row's scaled logits ``(M,)`` (``-inf`` without a column).

    ``max(x) / T`` rounds to the max of ``x / T`` (division by ``T > 0`` and
    rounding are monotonic), so the max over shards of each shard's value is
    the whole row's. Arguments as in :func:`logits_stats`.
    """
    dev = logits.device
    src = RowSource(logits, real, row_index, narrow)
    M = src.num_rows
    m = torch.full((M,), float("-inf"), dtype=dtype, device=dev)
    if M == 0 or real == 0:
        return m
    chunk = chunk or auto_chunk_size(real, M, device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)
    ranges = list(src.ranges(chunk))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        m[a:b] = scaled_max(src.rows(a, b, ws), temp.rows(a, b), dtype).squeeze(-1)

    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, M), real, dtype, dev), dev)
    return m


def kept_thresholds(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    restrict: KeptSet,
) -> None:
    """Fill ``restrict.tau`` (its search, when it has one to run) and ``restrict.count``.

    The threshold search of :meth:`~rlmath.engine.sampling.KeptSet.chunk`,
    chunk by chunk, without the statistics: for a backend whose kernels take
    the thresholds as given. Arguments as in :func:`logits_stats`.
    """
    dev = logits.device
    src = RowSource(logits, real, row_index, narrow)
    M = src.num_rows
    if M == 0 or real == 0:
        return
    chunk = chunk or auto_chunk_size(real, M, device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        restrict.chunk(a, b, src.rows(a, b, ws), temp.rows(a, b), ws)

    ranges = list(src.ranges(chunk))
    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, M), real, dtype, dev), dev)
