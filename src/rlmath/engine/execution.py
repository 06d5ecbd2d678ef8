"""Where a pass's chunks and blocks run: the engine's one door to the CPU worker pool.

A pure-torch pass is written as the work on one chunk of rows
(:func:`run_chunks`) or on one block of rows × vocabulary tile
(:func:`run_blocks`), and hands that work here. Nothing else in the engine
starts, counts or configures a thread.

On a CPU the work is shared out over worker threads, each running its part
on one intra-op thread (:mod:`rlmath.engine.workers`, ``docs/engine.md``,
"Threads on a CPU"); the results are bitwise those of a plain loop. Every
chunk or block runs in order on the calling thread instead — a plain loop —
on an accelerator, for a single chunk, under a ``TorchDispatchMode`` or
``TorchFunctionMode`` (which must see the ops on the thread it lives on), and
when the pool is off: ``RLMATH_CPU_WORKERS=0``, or a torch whose per-thread
thread count cannot be set (built on TBB, or without OpenMP; a platform such
as Windows where the OpenMP runtime cannot be looked up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from rlmath.engine.workers import MAX_BLOCK_WORKERS, for_each_block, for_each_chunk, pass_workers

__all__ = ["row_multiple", "run_blocks", "run_chunks"]

W = TypeVar("W")


def run_chunks(
    ranges: Iterable[tuple[int, int]],
    work: Callable[[int, int, W], None],
    scratch: Callable[[], W],
    device: torch.device,
    *,
    in_order: bool = False,
) -> None:
    """``work(start, end, buffers)`` for every range of rows.

    ``buffers`` comes from ``scratch()``, called once per worker and reused for
    every range it takes. ``work`` writes only its own rows of shared outputs;
    with ``in_order`` it may add into rows shared between ranges, and the
    ranges run one after another in their order.
    """
    ranges = list(ranges)
    workers = 1 if in_order else pass_workers(device, len(ranges))
    for_each_chunk(ranges, work, scratch, workers)


def run_blocks(
    rows: int,
    columns: int,
    work: Callable[[int, int, W], None],
    scratch: Callable[[], W],
    device: torch.device,
    *,
    along_rows: bool,
    along_columns: bool,
) -> None:
    """``work(i, j, buffers)`` for every block of a ``rows × columns`` grid.

    ``along_rows``: the blocks of a row run in column order (they add into
    that row's outputs); ``along_columns``: the blocks of a column run in row
    order. On a CPU any order those two rules allow, shared out; elsewhere
    row by row on the calling thread with one ``buffers`` (so that buffers
    kept per row are reused).
    """
    if device.type != "cpu":
        buffers = scratch()
        for i in range(rows):
            for j in range(columns):
                work(i, j, buffers)
        return
    workers = min(MAX_BLOCK_WORKERS, pass_workers(device, rows * columns))
    for_each_block(
        rows,
        columns,
        work,
        scratch,
        workers,
        along_rows=along_rows,
        along_columns=along_columns,
    )


def row_multiple() -> int:
    """Rows per chunk go in multiples of this where they can: torch's intra-op thread count.

    A chunk's row reductions are shared out over torch's threads by rows
    where a pass runs as plain torch ops, so a whole number of rows per
    thread keeps none of them idle.
    """
    return max(1, torch.get_num_threads())
