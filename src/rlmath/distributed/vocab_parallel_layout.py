"""Where each rank's vocabulary columns sit, from the public keyword arguments, and its check.

Shape-only checks run on every call; :func:`validate_layout` (``validate=True``)
compares the ranks' layouts with one collective and a host sync.
"""

from __future__ import annotations

from typing import cast

import torch

from rlmath.distributed._collectives import ProcessGroup, all_reduce, rank, world_size
from rlmath.distributed.vocab_parallel_stats import ShardSpec

__all__ = ["positive", "shard_spec", "validate_layout"]


def _optional_int(name: str, value: object, low: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def positive(name: str, value: object) -> int | None:
    return _optional_int(name, value, 1)


def shard_spec(
    width: int,
    *,
    vocab_start_index: object,
    vocab_size: object,
    ignore_index: object,
    group: ProcessGroup | None,
) -> ShardSpec:
    """This rank's :class:`ShardSpec` from the public keyword arguments (shape-only checks)."""
    start = _optional_int("vocab_start_index", vocab_start_index, 0)
    total = _optional_int("vocab_size", vocab_size, 1)
    if ignore_index is not None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(
                f"ignore_index must be an int or None, got {type(ignore_index).__name__}"
            )
        if ignore_index >= 0 and (total is None or ignore_index < total):
            raise ValueError(
                f"ignore_index must not be a token id (negative, or >= vocab_size when "
                f"vocab_size is given), got {ignore_index}"
            )
    if start is None:
        start = rank(group) * width
    real = width if total is None else max(0, min(width, total - start))
    return ShardSpec(start=start, real=real, ignore_index=cast("int | None", ignore_index))


def validate_layout(
    shard: ShardSpec,
    width: int,
    rows: int,
    labels: torch.Tensor | None,
    device: torch.device,
    group: ProcessGroup | None,
) -> None:
    """Check across the group that the shards tile the vocabulary and the rows agree.

    One all-reduce of a ``(world, 5)`` int64 table, then a host sync. Raises
    ``ValueError`` on every rank with the same message.
    """
    world, me = world_size(group), rank(group)
    label_sum = int(labels.sum()) if labels is not None and labels.numel() else 0
    table = torch.zeros(world, 5, dtype=torch.int64, device=device)
    table[me] = torch.tensor([shard.start, width, shard.real, rows, label_sum])
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
        if shard.ignore_index is not None:
            ok |= labels == shard.ignore_index
        if not bool(ok.all()):
            bad = int(labels[~ok][0])
            raise ValueError(
                f"labels must lie in [0, {vocab}) (the real vocabulary over all shards) or "
                f"equal ignore_index={shard.ignore_index}, found {bad}"
            )
