"""The cross-rank check of a vocabulary-parallel call (``validate=True``).

The shards' tiling of ``[0, V)`` is checked on every call, inside the
engine's first collective (:func:`rlmath.engine.stats.combine_shards`);
:func:`validate_layout` adds, with one more collective and a host sync, that
every rank passes the same rows and labels and that every label is a token
id of the whole vocabulary or ``ignore_index``.
"""

from __future__ import annotations

import torch

from rlmath.engine.config import VocabShard
from rlmath.engine.groups import ProcessGroup, all_reduce, group_rank, group_size, resolve_group

__all__ = ["validate_layout"]


def validate_layout(
    shard: VocabShard,
    width: int,
    rows: int,
    labels: torch.Tensor | None,
    ignore_index: int | None,
    device: torch.device,
) -> None:
    """Check across the shard's group that the shards tile the vocabulary and the rows agree.

    One all-reduce of a ``(world, 5)`` int64 table, then a host sync. Raises
    ``ValueError`` on every rank with the same message.
    """
    group: ProcessGroup | None = resolve_group(shard.group)
    if group is None:
        return
    world, me = group_size(group), group_rank(group)
    real = shard.real_columns(width)
    label_sum = int(labels.sum()) if labels is not None and labels.numel() else 0
    table = torch.zeros(world, 5, dtype=torch.int64, device=device)
    table[me] = torch.tensor([shard.start, width, real, rows, label_sum])
    rows_all = all_reduce(table, "sum", group).tolist()
    starts = sorted((r[0], r[1], k) for k, r in enumerate(rows_all))
    expected = 0
    for start, w, k in starts:
        if start != expected:
            raise ValueError(
                "vocabulary shards must tile [0, V) without gaps or overlap: rank "
                f"{k} starts at vocab_start_index={start}, expected {expected} "
                f"(layout as (start, width) by rank: {[(r[0], r[1]) for r in rows_all]})"
            )
        expected = start + w
    if len({r[3] for r in rows_all}) != 1:
        raise ValueError(
            f"every rank must pass the same tokens: rows per rank are {[r[3] for r in rows_all]}"
        )
    if len({r[4] for r in rows_all}) != 1:
        raise ValueError("every rank must pass the same labels: they differ between ranks")
    if labels is not None and labels.numel():
        vocab = sum(r[2] for r in rows_all)
        ok = (labels >= 0) & (labels < vocab)
        if ignore_index is not None:
            ok |= labels == ignore_index
        if not bool(ok.all()):
            bad = int(labels[~ok][0])
            raise ValueError(
                f"labels must lie in [0, {vocab}) (the real vocabulary over all shards) or "
                f"equal ignore_index={ignore_index}, found {bad}"
            )
