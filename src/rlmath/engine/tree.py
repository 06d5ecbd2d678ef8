"""One fixed order of summation over the vocabulary: 128-column tiles, then a fixed binary tree.

A row's sums over the vocabulary (``Σ exp(z - M)``, the entropy's
``Σ exp(z - M)·(z - M)``, ``Σ π²``'s ``Σ exp(2(z - M))``, all shifted by the
row's *global* max ``M``) are taken in one order that depends on nothing but
the vocabulary size:

1. the columns are cut into tiles of :data:`TILE` global columns (the last
   one may be shorter), and each tile is summed on its own;
2. the tile sums are added in a binary tree over the global tile index: at
   level ``L`` node ``i`` is the sum of nodes ``2i`` and ``2i + 1`` of level
   ``L - 1``, a node past the end counting as ``+0.0`` (so the tree is that
   of the tile count padded with zeros to a power of two).

A process that holds an aligned run of tiles (a vocabulary shard whose first
column is a multiple of :data:`TILE`) computes exactly the nodes of that tree
that lie inside its run (:func:`local_nodes`); :func:`evaluate` finishes the
tree from the nodes of every shard. The result is then bitwise the one a
single process computes over the whole vocabulary, whatever the number of
shards, because every addition has the same two operands in the same order.
Each tile's own sum is a reduction of a fixed length over contiguous
columns, which gives the same bits for the same values whatever the batch,
the chunk or the thread count.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import NamedTuple

import torch

from rlmath import _device

__all__ = [
    "ADD",
    "TILE",
    "TileRun",
    "TreeOp",
    "evaluate",
    "fold",
    "level_counts",
    "local_nodes",
    "node_plan",
    "padded_tiles",
    "tile_sums",
]

TILE = 128
"""Width of a vocabulary tile in columns (a multiple of every SIMD width)."""


class TreeOp(NamedTuple):
    """How two nodes of the tree combine: ``combine(left, right)``, and the value of a
    node past the end (``identity(like)``: a tensor shaped as ``like``), which
    ``combine`` must return its other operand for, bit for bit.

    Sums use :data:`ADD`; the fused head merges per-tile ``(max, sum, entropy
    term)`` triples (:data:`rlmath.engine.stats.STATS_TREE`).
    """

    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    identity: Callable[[torch.Tensor], torch.Tensor]


ADD = TreeOp(operator.add, torch.zeros_like)
"""The tree of sums: ``left + right``, ``+0.0`` past the end."""

Node = tuple[int, int]
"""``(level, index)`` of a tree node: the sum of tiles ``[index·2^level, (index+1)·2^level)``."""


def tile_count(columns: int) -> int:
    """Tiles covering ``columns`` columns."""
    return -(-columns // TILE)


def tile_sums(
    x: torch.Tensor, *, nan: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-tile row sums of ``x``, whose column 0 is the first column of a tile.

    Shape: ``(c, R)`` → ``(c, ceil(R / TILE))``, dtype of ``x``. ``nan``: skip
    NaN entries (the ``0·(-inf)`` products of a masked vocabulary). ``out``:
    where to write them (a ``(c, ceil(R / TILE))`` view whose last dim is
    contiguous, e.g. :meth:`TileRun.slot`); the sums are the same bits.

    ATen's NaN-skipping sum runs the same cascade as its plain sum (the same
    bits wherever there is no NaN) but slower over 128-column tiles (79
    against 59 µs for a 16 × 32000 chunk). Where reading the result is free
    (:func:`rlmath._device.reads_host`), the plain sum runs first and the
    NaN-skipping one only for a chunk whose sums hold a NaN.
    """
    if nan and _device.reads_host(x.device):
        sums = _tile_sums(x, nan=False, out=out)
        # One reduction and one read: a NaN among the sums makes their total NaN (so does
        # +inf beside -inf, where the NaN-skipping sum gives the same bits anyway).
        if not math.isnan(float(sums.sum())):
            return sums
    return _tile_sums(x, nan=nan, out=out)


def _tile_sums(x: torch.Tensor, *, nan: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    c, r = x.shape
    full = r // TILE
    if out is None:
        out = x.new_empty(c, tile_count(r))
    if full:
        whole = x if full * TILE == r else x.narrow(-1, 0, full * TILE)
        tiles = (
            whole.view(c, full, TILE)
            if whole.is_contiguous()
            else whole.unflatten(-1, (full, TILE))
        )
        dst = out if full == out.shape[1] else out.narrow(-1, 0, full)
        if nan:
            torch.nansum(tiles, -1, out=dst)
        else:
            torch.sum(tiles, -1, out=dst)
    if r % TILE:
        tail = x.narrow(-1, full * TILE, r - full * TILE)
        dst = out.narrow(-1, full, 1)
        if nan:
            torch.nansum(tail, -1, keepdim=True, out=dst)
        else:
            torch.sum(tail, -1, keepdim=True, out=dst)
    return out


class TileRun:
    """The per-tile sums of a run of rows, kept until each row's tiles are added in the tree.

    Laid out ``(k, rows, width)``, ``k`` sums per tile, ``width`` the tile count
    padded with ``+0.0`` to a power of two (the padding of :func:`fold`). A
    chunk of the run writes its tile sums in place (:meth:`slot`, the ``out=``
    of :func:`tile_sums`: no copy), and :meth:`fold` adds every row's tiles
    level by level for all ``k · rows`` rows at once: the additions of
    :func:`fold`, on rows whose pairs lie next to each other in memory.
    """

    def __init__(self, rows: int, tiles: int, k: int, dtype: torch.dtype, device: torch.device):
        self.tiles = tiles
        width = padded_tiles(tiles)
        self.buf = torch.zeros(k, rows, width, dtype=dtype, device=device)

    def slot(self, s: int, start: int, end: int) -> torch.Tensor:
        """Where rows ``[start, end)`` of the run write their tile sums of sum ``s``: ``(c, tiles)``."""
        return self.buf[s, start:end, : self.tiles]

    def fold(self) -> torch.Tensor:
        """The root of every row's tree: ``(k, rows)``."""
        k, rows, width = self.buf.shape
        x = self.buf.view(k * rows, width)
        while width > 1:
            width //= 2
            left, right = x.view(k * rows, width, 2).unbind(2)
            x = left + right
        return x.view(k, rows)


def padded_tiles(tiles: int) -> int:
    """``tiles`` padded to a power of two: the leaves of the tree (at least 1)."""
    return 1 << (tiles - 1).bit_length() if tiles > 1 else 1


def level_counts(total: int) -> list[int]:
    """Nodes per level of the tree over ``total`` tiles: ``total, ceil(total/2), ..., 1``."""
    counts = [total]
    while counts[-1] > 1:
        counts.append((counts[-1] + 1) // 2)
    return counts


def node_plan(first: int, count: int, total: int) -> list[Node]:
    """The nodes that tiles ``[first, first + count)`` of ``total`` hand on, in the order of
    :func:`local_nodes`.

    These are the largest nodes whose tiles all lie in the run: the parent of
    each would need a tile of another run. A run of every tile hands on the
    root alone. Pure arithmetic, so that each process knows every other's plan.
    """
    plan: list[Node] = []
    lo, hi, n, level = first, first + count, total, 0
    while lo < hi:
        if n == 1:
            plan.append((level, 0))
            break
        if lo % 2:
            plan.append((level, lo))
            lo += 1
        if hi % 2 and hi < n and lo < hi:
            plan.append((level, hi - 1))
            hi -= 1
        lo, hi, n, level = lo // 2, (hi + 1) // 2, (n + 1) // 2, level + 1
    return plan


def local_nodes(x: torch.Tensor, first: int, total: int, op: TreeOp = ADD) -> list[torch.Tensor]:
    """The values of :func:`node_plan`'s nodes from the tile sums of one run.

    Args:
        x: ``(c, count, k)`` tile sums of tiles ``[first, first + count)`` (``k``
            sums per tile, added independently).
        first: global index of the run's first tile.
        total: tiles of the whole vocabulary.
        op: how nodes combine (:data:`ADD`: sums).

    Returns:
        One ``(c, k)`` tensor per node of ``node_plan(first, count, total)``, in its order.
    """
    out: list[torch.Tensor] = []
    lo, hi, n = first, first + x.shape[1], total
    while lo < hi:
        if n == 1:
            out.append(x[:, 0])
            break
        if lo % 2:
            out.append(x[:, 0])
            x, lo = x[:, 1:], lo + 1
        if hi % 2 and hi < n and lo < hi:
            out.append(x[:, -1])
            x, hi = x[:, :-1], hi - 1
        if (hi - lo) % 2:  # the last node of the level has no right sibling: the identity
            x = torch.cat([x, op.identity(x[:, -1:])], 1)
        x = op.combine(x[:, 0::2], x[:, 1::2])
        lo, hi, n = lo // 2, (hi + 1) // 2, (n + 1) // 2
    return out


def evaluate(
    nodes: dict[Node, torch.Tensor], total: int, op: TreeOp = ADD, node: Node | None = None
) -> torch.Tensor:
    """The root of the tree over ``total`` tiles from nodes that cover every tile once
    (or ``node``, from nodes that cover its tiles once).

    ``nodes`` maps ``(level, index)`` to its ``(c, k)`` value (the union of the
    runs' :func:`local_nodes`); every other node is computed from its
    children with ``op``, exactly as :func:`local_nodes` would.
    """
    counts = level_counts(total)

    def value(level: int, index: int) -> torch.Tensor:
        found = nodes.get((level, index))
        if found is not None:
            return found
        left = value(level - 1, 2 * index)
        if 2 * index + 1 < counts[level - 1]:
            return op.combine(left, value(level - 1, 2 * index + 1))
        return op.combine(left, op.identity(left))

    return value(*node) if node is not None else value(len(counts) - 1, 0)


def fold(x: torch.Tensor, op: TreeOp = ADD) -> torch.Tensor:
    """The root of the tree over all tiles held here: ``(c, n, k)`` → ``(c, k)``.

    ``n = 0`` gives the identity (zeros for sums). The tiles padded with
    ``op``'s identity to a power of two, then combined level by level:
    the additions of :func:`local_nodes` for a run of every tile, in fewer ops
    (each level one ``unbind`` of the pairs and one addition). The pure-torch
    backend's passes add small trees on a CPU into a kept buffer instead
    (:func:`rlmath.engine.torch_backend.buffers.fold_tiles`), the same additions.
    """
    c, n, k = x.shape
    if n == 0:
        return op.identity(x.new_empty(c, k))
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.cat([x, op.identity(x.new_empty(c, width - n, k))], 1)
    while width > 1:
        width //= 2
        left, right = x.reshape(c, width, 2, k).unbind(2)
        x = op.combine(left, right)
    return x[:, 0]
