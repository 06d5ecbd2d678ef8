"""The chunks of a CPU pass shared out over worker threads, one intra-op thread each.

A pass over the logits is a loop over chunks of rows (2 MiB each on a CPU,
for the cache), each chunk a handful of torch ops. Run as is, every one of
those ops is an OpenMP parallel region of its own, ending in a barrier: for
``(8192, 32000)`` logits in 1 MiB chunks some 5000 regions per pass, each
holding tens of microseconds of work. When another process keeps a core busy, one thread of
each region waits for the scheduler, up to a time slice, and the pass
collapses (forward: 0.24 s quiet, 2.1 s with one core busy, at 2 threads).

Here instead each of ``torch.get_num_threads()`` workers (the calling thread
and threads of a shared pool) takes the next chunk whenever it is free and
runs its ops on one thread (:func:`rlmath._threads.limit_threads`): one
synchronization per pass, and a worker slowed by a busy core simply takes
fewer chunks. Each chunk is computed by the same ops in the same order
whichever worker takes it, so the results do not depend on the number of
threads. torch releases the GIL inside its ops, so the workers compute in
parallel.

The fused head's passes are a grid of blocks instead (rows of tokens ×
vocabulary tiles) whose outputs are sums over a row (``grad_hidden``, the
softmax statistics) or over a column (``grad_weight``):
:func:`for_each_block` lets a block start once the blocks before it in its
row and column are done, so every sum is added in the same order whichever
worker runs which block, and still the workers synchronize once per pass.

A worker computes what the calling thread would have: the calling thread's
thread-local PyTorch state is captured when a pass starts and entered in every
worker for the pass (:class:`CallerState`: grad and inference mode, CPU
autocast, flushing of denormal numbers). ``torch.use_deterministic_algorithms``,
the default dtype and anomaly detection are process-wide and need nothing.
A ``TorchDispatchMode`` or ``TorchFunctionMode`` active on the calling thread
cannot be carried over (it must see the ops, on the thread it lives on): the
pass then runs on the calling thread alone, as it does when the pool is off
(:func:`rlmath._threads.pool_workers`).

The engine calls these through :mod:`rlmath.engine.execution` only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from rlmath._threads import limit_threads, pool_workers

__all__ = ["MAX_BLOCK_WORKERS", "CallerState", "for_each_block", "for_each_chunk", "pass_workers"]

MAX_BLOCK_WORKERS = 8
"""Most workers of a block pass (the fused head's): each holds one block's buffers."""

W = TypeVar("W")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _reset_after_fork() -> None:
    # A forked child (a DataLoader worker) has none of the parent's threads.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            helpers = max(1, (os.cpu_count() or 1) - 1, pool_workers() - 1)
            _pool = ThreadPoolExecutor(
                max_workers=helpers,
                thread_name_prefix="rlmath-chunks",
                initializer=_start_pool_thread,
            )
        return _pool


def _mode_active() -> bool:
    """Whether a dispatch or function mode is active on the calling thread (it lives there only)."""
    return _get_current_dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled()


def pass_workers(device: torch.device, chunks: int) -> int:
    """Workers for a pass of ``chunks`` chunks on ``device``: 1 off a CPU or with the pool off."""
    if device.type != "cpu" or chunks < 2:
        return 1
    return max(1, min(pool_workers(), chunks))


# The smallest positive fp32 subnormal: a product of it is 0 exactly when the
# thread flushes denormal numbers (torch.set_flush_denormal), a per-thread
# setting of the CPU (x86's MXCSR, Arm's FPCR) that a pool thread started
# earlier does not share.
_SUBNORMAL = torch.tensor(torch.finfo(torch.float32).smallest_normal / 2**23, dtype=torch.float32)


def _flushes_denormals() -> bool:
    return torch.mul(_SUBNORMAL, 1.0).item() == 0.0


def _start_pool_thread() -> None:
    # A new thread inherits the denormal setting of the thread that starts it:
    # a pool thread starts from torch's default (no flushing), which
    # CallerState.entered then changes only for callers that flush.
    torch.set_flush_denormal(False)


@dataclass(frozen=True)
class CallerState:
    """The calling thread's thread-local PyTorch state, captured to be entered in a worker.

    ``autocast`` is the CPU autocast's ``(dtype, cache_enabled)``, ``None`` when it is off.
    """

    grad: bool
    inference: bool
    autocast: tuple[torch.dtype, bool] | None
    flush_denormal: bool

    @staticmethod
    def capture() -> CallerState:
        autocast = None
        if torch.is_autocast_enabled("cpu"):
            autocast = (torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())
        return CallerState(
            grad=torch.is_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=autocast,
            flush_denormal=_flushes_denormals(),
        )

    @contextmanager
    def entered(self) -> Iterator[None]:
        """This state on a pool thread inside the block; the thread's own after it."""
        with ExitStack() as stack:
            if self.inference:
                # Tensors made under inference mode may be written only under it.
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(self.grad))
            if self.autocast is not None:
                dtype, cache = self.autocast
                stack.enter_context(torch.autocast("cpu", dtype=dtype, cache_enabled=cache))
            if self.flush_denormal:
                # Entered on pool threads only, which do not flush otherwise.
                torch.set_flush_denormal(True)
                stack.callback(torch.set_flush_denormal, False)
            yield


def for_each_chunk(
    ranges: Iterable[tuple[int, int]],
    work: Callable[[int, int, W], None],
    scratch: Callable[[], W],
    workers: int,
) -> None:
    """``work(start, end, scratch_of_this_worker)`` for every range, on ``workers`` workers.

    Each worker builds its own scratch (``scratch()``, e.g. a
    :class:`~rlmath.engine.torch_backend.buffers.Workspace`) once and reuses it
    for every range it takes. ``work`` must write only its own rows of shared
    outputs. With one worker, or a dispatch or function mode active (it must
    see the ops, on this thread), the ranges run in order on the calling
    thread, as a plain loop. Every worker runs under the calling thread's
    :class:`CallerState`. An exception in any worker stops the others after
    their current range and is raised here.
    """
    if workers > 1 and _mode_active():
        workers = 1
    if workers <= 1:
        buffers = scratch()
        try:
            for a, b in ranges:
                work(a, b, buffers)
        finally:
            _release(buffers)
        return
    todo = iter(ranges)
    lock = threading.Lock()
    failed = threading.Event()

    def worker() -> None:
        buffers = scratch()
        try:
            with limit_threads(1):
                while not failed.is_set():
                    with lock:
                        r = next(todo, None)
                    if r is None:
                        return
                    try:
                        work(r[0], r[1], buffers)
                    except BaseException:
                        failed.set()
                        raise
        finally:
            _release(buffers)

    _share_out(worker, workers)


def _share_out(worker: Callable[[], None], workers: int) -> None:
    """``worker()`` on the calling thread and on ``workers - 1`` pool threads; the first error raised.

    A pool thread runs ``worker`` under the calling thread's :class:`CallerState`.
    """
    pool = _shared_pool()
    state = CallerState.capture()

    def helper() -> None:
        with state.entered():
            worker()

    helpers: list[Future[None]] = [pool.submit(helper) for _ in range(workers - 1)]
    # The calling thread works too: the pass finishes even when every pool
    # thread is busy with other calls (their tasks then find nothing left).
    error: BaseException | None = None
    try:
        worker()
    except BaseException as e:
        error = e
    for f in helpers:
        if f.cancel():
            continue  # never started: the other workers did all the work
        try:
            f.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def for_each_block(
    rows: int,
    columns: int,
    work: Callable[[int, int, W], None],
    scratch: Callable[[], W],
    workers: int,
    *,
    along_rows: bool,
    along_columns: bool,
) -> None:
    """``work(i, j, scratch_of_this_worker)`` for every block of a ``rows × columns`` grid.

    With ``along_rows`` block ``(i, j)`` starts only after ``(i, j - 1)`` has
    finished, with ``along_columns`` only after ``(i - 1, j)``: ``work`` may then
    add into outputs shared along a row (or column) without a lock, and the
    additions happen in column (row) order whoever runs them, so the results
    do not depend on ``workers``. Within those rules a worker that finishes a
    block takes the next block of its column if it can (the operands of a
    column stay in the cache), else the next of its row, else the ready block
    of the lowest column. A worker slowed by a busy core holds up only the
    blocks after its own; the others work on elsewhere in the grid, and the
    workers synchronize once per call. With one worker (or a mode active, see
    :func:`for_each_chunk`) the blocks run on the calling thread, column by
    column. An exception in any worker stops the others after their current
    block and is raised here.
    """
    if workers > 1 and _mode_active():
        workers = 1
    if rows <= 0 or columns <= 0:
        return
    if workers <= 1:
        buffers = scratch()
        try:
            for j in range(columns):
                for i in range(rows):
                    work(i, j, buffers)
        finally:
            _release(buffers)
        return
    grid = _BlockGrid(rows, columns, along_rows, along_columns)

    def worker() -> None:
        buffers = scratch()
        done: tuple[int, int] | None = None
        try:
            with limit_threads(1):
                while True:
                    block = grid.take(done)
                    if block is None:
                        return
                    try:
                        work(block[0], block[1], buffers)
                    except BaseException:
                        grid.fail()
                        raise
                    done = block
        finally:
            _release(buffers)

    _share_out(worker, workers)


def _release(buffers: object) -> None:
    """Hand a worker's scratch on when its pass is over (``release()``, when it has one)."""
    release = getattr(buffers, "release", None)
    if release is not None:
        release()


class _BlockGrid:
    """The state of a :func:`for_each_block` call: which blocks are done, ready and taken."""

    def __init__(self, rows: int, columns: int, along_rows: bool, along_columns: bool):
        self.rows, self.columns = rows, columns
        self.along_rows, self.along_columns = along_rows, along_columns
        # Blocks finished in each row (along_rows: always its first ones) and column.
        self.row_done = [0] * rows
        self.column_done = [0] * columns
        self.left = rows * columns
        self.failed = False
        self.started: set[tuple[int, int]] = set()
        self.ready = {
            (i, j)
            for i in range(1 if along_columns else rows)
            for j in range(1 if along_rows else columns)
        }
        self.cond = threading.Condition()

    def _can_start(self, i: int, j: int) -> bool:
        return (not self.along_rows or self.row_done[i] == j) and (
            not self.along_columns or self.column_done[j] == i
        )

    def take(self, done: tuple[int, int] | None) -> tuple[int, int] | None:
        """Mark ``done`` finished and return the next block to run (``None``: nothing left)."""
        with self.cond:
            if done is not None:
                i, j = done
                self.left -= 1
                self.row_done[i] += 1
                self.column_done[j] += 1
                for nxt in ((i + 1, j), (i, j + 1)):
                    inside = nxt[0] < self.rows and nxt[1] < self.columns
                    if inside and nxt not in self.started and self._can_start(*nxt):
                        self.ready.add(nxt)
                self.cond.notify_all()
            while True:
                if self.failed or (not self.ready and self.left == 0):
                    return None
                if self.ready:
                    break
                self.cond.wait()
            block: tuple[int, int] | None = None
            if done is not None:
                for nxt in ((done[0] + 1, done[1]), (done[0], done[1] + 1)):
                    if nxt in self.ready:
                        block = nxt
                        break
            if block is None:
                block = min(self.ready, key=lambda b: (b[1], b[0]))
            self.ready.discard(block)
            self.started.add(block)
            # Taken blocks still count in `left` until done: waiting workers wake
            # when a block finishes and either find a ready one or leave at zero.
            return block

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()
