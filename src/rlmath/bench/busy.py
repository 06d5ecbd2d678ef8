"""Contention for the benchmarks: K busy processes of the benchmark's own, ended by pid.

A training job seldom has its CPU cores to itself: a data loader, a reward
model, a second rank on the same host or another user of a shared machine
keep some of them busy. Multi-threaded kernels suffer most: a thread that
waits for a descheduled sibling stalls the whole op. ``rlmath bench
--busy-cores K`` measures under a known load of that kind: :class:`BusyLoad`
starts K processes that each keep one core busy, the benchmark runs, and
the processes are ended.

Each process is ``python -c <loop>``: a pure-Python loop (no torch, no
threads) that ends by itself after ``max_seconds`` (at most
:data:`MAX_SECONDS`) or as soon as its parent process is gone, so that a
benchmark killed without a chance to clean up leaves nothing running for
long. :class:`BusyLoad` remembers the processes and their pids and ends
them on exit from its ``with`` block, also after an exception or Ctrl-C:
SIGTERM, a wait of up to ``grace`` seconds, then SIGKILL. An ``atexit``
hook does the same for any it did not get to.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from types import TracebackType

__all__ = ["MAX_SECONDS", "BusyLoad", "check_busy_cores"]

#: The longest a busy process runs before it ends by itself, in seconds.
MAX_SECONDS = 3600.0

# Checking the clock and the parent every 100 000 iterations (about a
# millisecond) keeps the loop busy nearly all the time and still ends it soon.
_LOOP = """\
import os, time
parent, end = {parent}, time.monotonic() + {seconds!r}
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(100_000):
        pass
"""


def check_busy_cores(k: int) -> int:
    """``k`` if it is a whole number in ``[0, os.cpu_count()]``, else ``ValueError``/``TypeError``."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"busy_cores must be an int, got {type(k).__name__}")
    cores = os.cpu_count() or 1
    if not 0 <= k <= cores:
        raise ValueError(f"busy_cores must be in [0, {cores}] (os.cpu_count()), got {k}")
    return k


class BusyLoad:
    """``with BusyLoad(k) as load:``: ``k`` busy processes for the duration of the block.

    ``k = 0`` starts nothing. ``load.pids`` are the processes' pids,
    ``load.processes`` their :class:`subprocess.Popen` handles (kept after
    the block, ended), ``load.running()`` how many are running now.
    """

    def __init__(self, k: int, *, max_seconds: float = MAX_SECONDS, grace: float = 3.0) -> None:
        self.k = check_busy_cores(k)
        if not 0 < max_seconds <= MAX_SECONDS:
            raise ValueError(f"max_seconds must be in (0, {MAX_SECONDS:g}], got {max_seconds}")
        if grace < 0:
            raise ValueError(f"grace must be >= 0, got {grace}")
        self.max_seconds = float(max_seconds)
        self.grace = float(grace)
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        """The pids of the processes started, in order."""
        return [p.pid for p in self.processes]

    def running(self) -> int:
        """How many of the processes are running now."""
        return sum(p.poll() is None for p in self.processes)

    def start(self) -> None:
        """Start the ``k`` processes (a second call starts nothing)."""
        if self.processes:
            return
        code = _LOOP.format(parent=os.getpid(), seconds=self.max_seconds)
        atexit.register(self.stop)
        try:
            for _ in range(self.k):
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-c", code],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """End every process still running: SIGTERM, up to ``grace`` seconds, then SIGKILL."""
        # Popen signals a pid only while it has not reaped that process, so a
        # pid the system has since given to another process is never signalled.
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + self.grace
        for p in self.processes:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        atexit.unregister(self.stop)

    def __enter__(self) -> BusyLoad:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
