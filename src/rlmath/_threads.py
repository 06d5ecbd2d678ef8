"""How many intra-op threads one call uses on a CPU: decided once, set on the calling thread.

torch runs every CPU op above a small size as an OpenMP parallel region, which
ends in a barrier: the op is done when its slowest thread is. When another
process keeps a core busy, one of those threads waits for the scheduler at
every barrier, for up to a time slice (milliseconds), however little work the
op holds. A call made of many small parallel ops then collapses: GAE on
``(64, 4096)`` (about 350 ops, each a few microseconds of work) took 2.4 ms
on a quiet 2-core machine and 15–210 ms with one core busy at torch's default
of 2 threads, but 2.7 ms quiet and 3.5 ms busy with 1 thread. A call whose ops
are large gains from the threads and loses little to a busy core.

So a call decides once how many threads its CPU ops use
(:func:`threads_for`) and runs them under :func:`limit_threads`. That never
calls ``torch.set_num_threads`` (it is process-wide: it also changes the count
that threads started later take), but sets the OpenMP thread count of the
calling thread alone (``omp_set_num_threads`` acts on the calling thread's
own setting, which torch reads for each op), for the duration of the call,
and restores it. Calls from several Python threads at once do not affect
each other, and the results do not depend on the thread count (every op
computes the same values with any number of threads; the tests check it).

Matmuls need a second setting. torch's CPU matmuls run in MKL, which keeps
its own per-thread count: once ``torch.set_num_threads(n)`` has been called
(by the user, a launcher, a test harness), every thread that runs torch ops
gets MKL's per-thread count ``n``, and MKL then ignores the OpenMP setting.
A worker limited to one thread would still run each matmul on ``n``
threads: with two workers on 2 cores, four threads, and a matmul of
1366×1024×1408 measured 2.0 CPU-seconds per second under a one-thread limit.
So :func:`limit_threads` also sets MKL's per-thread count of the calling
thread (``MKL_Set_Num_Threads_Local``, thread-local by MKL's definition)
where torch's MKL exports it, and restores it.

The per-thread OpenMP count is what keeps the worker pool of the vocabulary
passes (:mod:`rlmath.engine.workers`) from oversubscribing the cores. Where
it cannot be set — a torch built on TBB or its own thread pool instead of
OpenMP, a platform whose C library cannot be searched for OpenMP's symbols
(Windows: ``ctypes.CDLL(None)`` raises ``TypeError``) — :func:`pool_workers`
is 1: the passes then run as plain torch ops on the calling thread. Each case
is detected once per process. The environment variable
:data:`WORKERS_ENV_VAR` sets the pool by hand.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "SERIAL_ELEMENTS",
    "WORKERS_ENV_VAR",
    "call_with_threads",
    "limit_threads",
    "pool_workers",
    "threads_for",
    "threads_per_call",
]

#: Largest per-op size (elements) for which a call runs on one thread: below
#: it, an op's work per thread is smaller than what one wait for a busy core
#: costs, and one thread is about as fast as two on a quiet machine too.
SERIAL_ELEMENTS = 1 << 22

WORKERS_ENV_VAR = "RLMATH_CPU_WORKERS"
"""Environment variable that sets the worker pool of the CPU passes, read at its first use:
``0`` turns the pool off (every pass on the calling thread), a positive ``N`` runs
each pass on at most ``N`` workers instead of ``torch.get_num_threads()``."""


@functools.cache
def _openmp() -> Any:
    """The OpenMP runtime torch runs its CPU ops on, or None (another backend, or not found)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None  # TBB or torch's own pool: no per-thread count to set
    try:
        # torch loads its OpenMP runtime into the process: its symbols are visible.
        lib = ctypes.CDLL(None)
        get, set_ = lib.omp_get_max_threads, lib.omp_set_num_threads
    except (OSError, AttributeError, TypeError):
        # TypeError: a platform whose CDLL needs a file name (Windows).
        return None
    get.restype, get.argtypes = ctypes.c_int, []
    set_.restype, set_.argtypes = None, [ctypes.c_int]
    return lib


def _mkl_function(name: str) -> Any:
    """The function ``name`` of the MKL torch's CPU matmuls run in, or None (no MKL, not exported)."""
    if not torch.backends.mkl.is_available():
        return None
    candidates: list[str | None] = [None]  # the process's global symbols first
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates += sorted(glob.glob(os.path.join(lib_dir, "*torch_cpu*")))
    for path in candidates:
        try:
            # Already loaded by torch: this finds the same library, loads nothing new.
            return getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
    return None


@functools.cache
def _mkl_local() -> Any:
    """MKL's ``MKL_Set_Num_Threads_Local(n) -> previous``, or None."""
    fn = _mkl_function("MKL_Set_Num_Threads_Local")
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    return fn


@functools.cache
def _workers_setting() -> int | None:
    """:data:`WORKERS_ENV_VAR` as a count (``None``: unset), checked once."""
    raw = os.environ.get(WORKERS_ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{WORKERS_ENV_VAR} must be 0 (no worker pool) or a positive number of "
            f"workers, got {raw!r}"
        )
    return value


def pool_workers() -> int:
    """Most workers a CPU pass may run on: 1 when the pool is off.

    Off where the per-thread OpenMP count cannot be set (the workers would
    each run torch's full count of threads) or :data:`WORKERS_ENV_VAR` is
    ``0``; a positive value of that variable, else ``torch.get_num_threads()``.

    Raises:
        ValueError: :data:`WORKERS_ENV_VAR` is neither a non-negative integer nor empty.
    """
    setting = _workers_setting()
    if setting == 0 or _openmp() is None:
        return 1
    return setting if setting is not None else max(1, torch.get_num_threads())


def threads_for(elements: int, device: torch.device) -> int:
    """Intra-op threads for a call whose largest op handles ``elements`` values on ``device``.

    One thread on a CPU below :data:`SERIAL_ELEMENTS`, else torch's thread
    count (accelerators: not applicable, torch's count is returned).
    """
    if device.type == "cpu" and elements < SERIAL_ELEMENTS:
        return 1
    return torch.get_num_threads()


@contextmanager
def limit_threads(n: int) -> Iterator[None]:
    """At most ``n`` intra-op threads for the CPU ops the calling thread runs inside the block.

    Other threads, and this thread after the block, keep their count. Does
    nothing when ``n`` is not below the current count, or when torch does not
    run its CPU ops on OpenMP.
    """
    omp = _openmp()
    # torch.get_num_threads() first sets up this thread's OpenMP count from
    # torch's setting if nothing has yet; the value restored is then torch's.
    current = torch.get_num_threads()
    if omp is None or n >= current:
        yield
        return
    mkl = _mkl_local()
    omp.omp_set_num_threads(max(1, n))
    # The previous per-thread value (0: MKL's global setting), restored below.
    mkl_before = mkl(max(1, n)) if mkl is not None else None
    try:
        yield
    finally:
        if mkl is not None:
            mkl(mkl_before)
        omp.omp_set_num_threads(current)


def call_with_threads(n: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under :func:`limit_threads` ``(n)``; a plain call while compiling.

    A compiled graph runs its own kernels, and torch.compile cannot trace the
    context manager (torch 2.6), so nothing is set while tracing.
    """
    if torch.compiler.is_compiling():
        return fn(*args, **kwargs)
    with limit_threads(n):
        return fn(*args, **kwargs)


def threads_per_call(fn: F) -> F:
    """Run ``fn`` under :func:`limit_threads` with :func:`threads_for` of its largest tensor argument.

    For functions made of many elementwise ops and reductions over one batch
    (the advantage estimators): validation, statistics and scans all run on
    the thread count decided once, at the call.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        largest = None
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and (largest is None or a.numel() > largest.numel()):
                largest = a
        if largest is None:
            return fn(*args, **kwargs)
        return call_with_threads(threads_for(largest.numel(), largest.device), fn, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
