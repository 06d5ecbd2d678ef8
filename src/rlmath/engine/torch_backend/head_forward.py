"""The fused LM head's forward pass: per-row statistics of ``hidden @ weight.T + bias``.

For each block of rows × vocabulary tile (:class:`HeadBlocks`) the logits are
computed and reduced slice by slice into the statistics of each 128-column
tile of the fixed tree (:mod:`rlmath.engine.tree`): ``(m, s, t)``, the tile's
max, ``Σ exp(z - m)`` and ``Σ exp(z - m)·(z - m)``, each tile shifted by its
own max, since one pass over the head cannot know the row's max before its
last block. The tiles of a row's consecutive blocks (:data:`GROUP_COLUMNS`)
are merged into the tree's nodes that lie inside them
(:data:`rlmath.engine.stats.STATS_TREE`) when the group's last block is done,
and those nodes into the root when every block is: the same merges, in the
same order, whatever the number of rows or threads, and whatever split of
the vocabulary between processes on the tile grid (:func:`head_tile_nodes`).
Only a few numbers per row and group (and the label logits) outlive a block.
"""

from __future__ import annotations

import functools

import torch

from rlmath.engine import tree
from rlmath.engine.stats import STATS_TREE
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, Workspace
from rlmath.engine.torch_backend.head_blocks import BlockScratch, HeadBlocks
from rlmath.engine.torch_backend.reductions import scaled_shift, upcast, upcasts_first

__all__ = ["head_stats", "head_tile_nodes", "tile_stats"]

NodeTable = dict[tree.Node, torch.Tensor]

GROUP_COLUMNS = 8192
"""Columns of a row's consecutive blocks whose tiles are merged together (a CPU's
2048-column blocks four at a time): each merge is a dozen small ops whatever its
width, so fewer, wider merges cost less, for ``3 · GROUP_COLUMNS / 128`` floats per
row held until the group's last block."""


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
    total = tree.tile_count(real)
    # The whole vocabulary is here: its one node is the root.
    nodes, z_label = head_tile_nodes(
        hidden, weight, bias, labels, owned, live, temperature, want_entropy,
        real=real, rows=rows, tile=tile, dtype=dtype, first=0, total=total, scale=scale,
        softcap=softcap,
    )  # fmt: skip
    if nodes:
        (root,) = nodes
    else:  # no column: no mass
        k = 3 if want_entropy else 2
        root = STATS_TREE.identity(hidden.new_empty(hidden.shape[0], k, dtype=dtype))
    return root[:, 0], root[:, 1], root[:, 2] if want_entropy else None, z_label


def head_tile_nodes(
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
    first: int,
    total: int,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The nodes of the fixed tree inside this shard's tiles, for the engine to finish.

    This weight's columns are tiles ``[first, first + ceil(real / 128))`` of
    the ``total`` tiles of the whole vocabulary. Returns ``(nodes, z_labels)``:
    one ``(N, k)`` tensor of ``(m, s[, t])`` per node of
    :func:`rlmath.engine.tree.node_plan`, in its order, and the label logits as
    in :func:`head_stats`.
    """
    blocks = HeadBlocks(
        hidden, weight, bias, labels, owned, live, rows, tile, real, dtype, scale, softcap
    )
    count = tree.tile_count(real)
    table, z_label = _head_nodes(blocks, temperature, want_entropy, labels.shape, first, total)
    plan = tree.node_plan(first, count, total)
    return [tree.evaluate(table, total, STATS_TREE, node) for node in plan], z_label


class _Groups:
    """Consecutive vocabulary blocks merged together, and the tree's nodes inside each group."""

    def __init__(self, spans: list[tuple[int, int]], first: int, total: int):
        width = max((b - a for a, b in spans), default=1)
        per = max(1, GROUP_COLUMNS // width)
        self.of_block = [j // per for j in range(len(spans))]
        self.bounds: list[tuple[int, int]] = []  # each group's first and last block
        for j0 in range(0, len(spans), per):
            self.bounds.append((j0, min(j0 + per, len(spans)) - 1))
        self.plans = [
            tree.node_plan(
                first + spans[j0][0] // tree.TILE,
                tree.tile_count(spans[j1][1] - spans[j0][0]),
                total,
            )
            for j0, j1 in self.bounds
        ]


def _head_nodes(
    blocks: HeadBlocks,
    temperature: Temperature,
    entropy: bool,
    label_shape: torch.Size,
    first: int,
    total: int,
) -> tuple[NodeTable, torch.Tensor]:
    """The nodes of the tree inside each group of blocks (:class:`_Groups`; tiles globally
    numbered from ``first``), ``(N, k)`` each, and the label logits."""
    hidden, dtype = blocks.hidden, blocks.dtype
    dev, N = hidden.device, hidden.shape[0]
    k = 3 if entropy else 2
    temp = TemperatureColumn(temperature, dtype, dev)
    groups = _Groups(blocks.tile_spans, first, total)
    table: NodeTable = {
        node: torch.empty(N, k, dtype=dtype, device=dev) for plan in groups.plans for node in plan
    }
    z_label = torch.zeros(label_shape, dtype=dtype, device=dev)
    one_block = functools.partial(
        _block_stats,
        blocks=blocks,
        temp=temp,
        entropy=entropy,
        groups=groups,
        pending={},
        table=table,
        first=first,
        total=total,
        z_label=z_label,
    )
    # The blocks of a row in order: they update the row's label logits in turn, and
    # a group's last block merges the tiles its earlier blocks left.
    blocks.run(one_block, along_rows=True, along_columns=False)
    if temp.col is not None:
        # Upcast, then divide by T: the rounding of the shifted block buffer.
        z_label = z_label / temp.col
    return table, z_label


def _block_stats(
    i: int,
    j: int,
    scratch: BlockScratch,
    *,
    blocks: HeadBlocks,
    temp: TemperatureColumn,
    entropy: bool,
    groups: _Groups,
    pending: dict[int, torch.Tensor],
    table: NodeTable,
    first: int,
    total: int,
    z_label: torch.Tensor,
) -> None:
    """Block ``(i, j)``: its logits, label logits, and its tiles' statistics; the last block
    of a group merges the group's tiles into the tree's nodes inside the group, written
    to rows ``[r0, r1)`` of ``table``'s nodes.

    ``pending[i]`` holds block row ``i``'s tile statistics of its current group
    (its blocks run in order, one at a time); every group writes its own rows
    of its own nodes.
    """
    (r0, r1), (v0, v1) = blocks.block_rows[i], blocks.tile_spans[j]
    scratch.begin_tile(v0, v1)
    h = blocks.hidden_rows(r0, r1, scratch)
    z = blocks.transformed(scratch, blocks.logits(scratch, h, v0, v1))
    idx, inside = blocks.tile_labels(r0, r1, v0, v1)
    z_label[r0:r1] = torch.where(inside, z.gather(1, idx), z_label[r0:r1])
    g = groups.of_block[j]
    j0, j1 = groups.bounds[g]
    g0 = blocks.tile_spans[j0][0]
    if j == j0:
        n = tree.tile_count(blocks.tile_spans[j1][1] - g0)
        k = 3 if entropy else 2
        pending[i] = torch.empty(r1 - r0, n, k, dtype=z_label.dtype, device=z.device)
    leaves = pending[i]
    a = (v0 - g0) // tree.TILE
    for s0, s1 in blocks.slices(r1 - r0):
        tile_stats(
            z[s0:s1],
            scratch.small,
            temperature=temp.rows(r0 + s0, r0 + s1),
            entropy=entropy,
            out=leaves[s0:s1, a : a + tree.tile_count(v1 - v0)],
        )
    if j == j1:
        del pending[i]
        values = tree.local_nodes(leaves, first + g0 // tree.TILE, total, STATS_TREE)
        for node, value in zip(groups.plans[g], values, strict=True):
            table[node][r0:r1] = value


def tile_stats(
    src: torch.Tensor,
    ws: Workspace,
    *,
    temperature: torch.Tensor | None,
    entropy: bool,
    out: torch.Tensor,
) -> None:
    """``(m, s, t)`` of every 128-column tile of one ``(c, W)`` chunk of logits, into ``out``.

    Per tile: ``m = max z``, ``s = Σ exp(z - m)``, ``t = Σ exp(z - m)·(z - m)``
    with ``z = src / T``, shifted by the tile's own max (a leaf of
    :data:`rlmath.engine.stats.STATS_TREE`). A tile without a finite logit
    gives ``(-inf, 0, 0)``, the tree's empty node; ``-inf`` logits among
    finite ones drop out (their ``0·(-inf)`` products are skipped); a NaN
    logit makes its tile NaN.

    Args:
        src: ``(c, W)`` logits, any floating dtype and strides (read only);
            column 0 is the first column of a tile.
        ws: scratch buffers (``"y"`` and ``"e"``, ``(c, W)`` in the compute dtype).
        temperature: ``None`` or a ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
        entropy: also compute ``t``.
        out: ``(c, ceil(W / 128), 3)`` (``2`` without the entropy), compute dtype.
    """
    c, width = src.shape
    full, y = width // tree.TILE, ws.get("y", c)
    if upcasts_first(src, ws.dtype):
        src = upcast(src, y)  # the max and the shift read the fp32 copy
    m = _tile_max(src, full)
    if m.dtype != ws.dtype:
        m = m.to(ws.dtype)
    if temperature is not None:
        m = m / temperature  # fl(max x / T) = max fl(x / T): T > 0, rounding is monotonic
    # Each tile shifted by its own max: the full tiles in one op, then the tail.
    parts = [(0, full * tree.TILE, slice(0, full))] if full else []
    if width > full * tree.TILE:
        parts.append((full * tree.TILE, width, slice(full, full + 1)))
    for a, b, cols in parts:
        tiles = (b - a) // tree.TILE or 1
        shape = (c, tiles, (b - a) // tiles)
        t3 = None if temperature is None else temperature.unsqueeze(-1)
        scaled_shift(
            src[:, a:b].unflatten(-1, shape[1:]),
            t3,
            m[:, cols].unsqueeze(-1),
            y[:, a:b].unflatten(-1, shape[1:]),
        )
    e = torch.exp(y, out=ws.get("e", c))
    s = tree.tile_sums(e)
    t = tree.tile_sums(e.mul_(y), nan=True) if entropy else None
    # A tile without a finite logit: -inf - (-inf) is NaN; it has no mass instead.
    dead = m == float("-inf")
    out[..., 0] = m
    out[..., 1] = s.masked_fill_(dead, 0.0)
    if t is not None:
        out[..., 2] = t.masked_fill_(dead, 0.0)


def _tile_max(src: torch.Tensor, full: int) -> torch.Tensor:
    """The max of each 128-column tile of ``src`` ``(c, W)``: ``(c, ceil(W / 128))``."""
    c, width = src.shape
    cut = full * tree.TILE
    parts = []
    if full:
        parts.append(src[:, :cut].unflatten(-1, (full, tree.TILE)).amax(-1))
    if width > cut:
        parts.append(src[:, cut:].amax(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)
