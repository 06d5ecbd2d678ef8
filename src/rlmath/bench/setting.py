"""What a benchmark run measures under, and how it reads the clock.

:func:`session` fixes the device, torch's CPU thread count and the load
(:class:`~rlmath.bench.busy.BusyLoad`) for a run and yields the
:class:`Setting` every area reads. :func:`interleaved` times several
implementations run by run, in turns (each round's order rotated by one), so
that a change in the machine's load during the run, or what one
implementation leaves behind, hits each of them alike, and reports the
median (or minimum) per implementation. :func:`header` is the line above every table: the torch
version, the thread count, the device and the load.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlmath.bench.busy import BusyLoad, check_busy_cores

__all__ = [
    "MAX_REPEATS",
    "MIN_REPEATS",
    "BenchSettingError",
    "Setting",
    "check_device",
    "check_repeats",
    "elapsed",
    "floating_dtype",
    "header",
    "interleaved",
    "release_memory",
    "session",
]

#: Timed runs per implementation: a median of fewer than 5 says little, and
#: more than 1000 only lengthens a run.
MIN_REPEATS, MAX_REPEATS = 5, 1000
STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


class BenchSettingError(ValueError):
    """A benchmark setting that cannot run here: a device, a thread count, a repeat count."""


@dataclass(frozen=True)
class Setting:
    """The device, the peers switch and the load of a benchmark run.

    ``rss``: the memory columns also report peak RSS, measured in a fresh
    process per case (:func:`rlmath.bench.memory.peak_rss_bytes`, CPU only).
    """

    device: torch.device
    peers: bool
    load: BusyLoad
    rss: bool = True


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` of type cpu or cuda that this machine has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise BenchSettingError(
            f"unknown device {device!r} (expected cpu, cuda or cuda:N)"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise BenchSettingError(f"only cpu and cuda devices are supported, got {str(dev)!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchSettingError(f"device {str(dev)!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BenchSettingError(
            f"device {str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return dev


def check_repeats(repeats: int) -> int:
    """``repeats`` if it is an int in ``[MIN_REPEATS, MAX_REPEATS]``."""
    if (
        isinstance(repeats, bool)
        or not isinstance(repeats, int)
        or not MIN_REPEATS <= repeats <= MAX_REPEATS
    ):
        raise BenchSettingError(
            f"repeats must be an int in [{MIN_REPEATS}, {MAX_REPEATS}], got {repeats!r}"
        )
    return repeats


@contextmanager
def session(
    *,
    device: str | torch.device = "cpu",
    busy_cores: int = 0,
    threads: int | None = None,
    peers: bool = True,
    rss: bool = True,
) -> Iterator[Setting]:
    """Fix the device, the thread count and the load for a run; undo all of it on exit.

    ``threads=None`` keeps torch's thread count; a number sets it for the
    run and restores the previous one afterwards. ``busy_cores`` processes
    keep that many cores busy until the block ends (also on an exception or
    Ctrl-C). ``peers``: include verl / TRL / TorchRL where they import.
    ``rss``: also measure peak RSS (:class:`Setting`).
    """
    dev = check_device(device)
    try:
        check_busy_cores(busy_cores)
    except (TypeError, ValueError) as err:
        raise BenchSettingError(str(err)) from None
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise BenchSettingError(f"threads must be an int >= 1 or None, got {threads!r}")
    previous = torch.get_num_threads()
    frozen_before = gc.get_freeze_count()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with BusyLoad(busy_cores) as load:
            yield Setting(device=dev, peers=peers, load=load, rss=rss)
    finally:
        torch.set_num_threads(previous)
        if not frozen_before:  # else the caller froze objects of its own: leave them so
            gc.unfreeze()  # what the run froze (see _collect_and_freeze) is collectable again
            gc.collect()


def floating_dtype(name: str) -> torch.dtype:
    """The floating torch dtype called ``name`` (``"float32"``, ``"bfloat16"``, ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise BenchSettingError(f"unknown floating dtype {name!r} (e.g. float32, bfloat16)")
    return dtype


def release_memory(device: torch.device) -> None:
    """Collect garbage, and on CUDA return cached blocks, between cases."""
    _collect_and_freeze()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _collect_and_freeze() -> None:
    """Collect garbage, then exempt the survivors from later collections until the session ends.

    With torch (and a peer library) loaded a full collection scans hundreds
    of thousands of objects, tens of milliseconds; once they are frozen, the
    collections between timed runs scan only what the runs created.
    Freezing does not keep anything alive: objects are still freed when
    their last reference goes.
    """
    gc.collect()
    gc.freeze()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call of ``fn``, in seconds; on CUDA from a synchronized start to a synchronized end."""
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    *,
    stat: str = "median",
    warmup: bool = True,
    collect: bool = True,
) -> dict[str, float]:
    """The median (``stat="min"``: the minimum) time of ``repeats`` runs of each function, in seconds.

    Round ``r`` runs every function once before round ``r + 1`` starts, the
    order given rotated by ``r`` places: what a function leaves behind (memory
    the allocator returned to the system, evicted caches) then falls on each
    of the others in turn, instead of always on the one after it (measured: a
    forward+backward of log-probs + entropy that always followed the naive
    path with entropy, 4 GB of temporaries, took 1.2 s instead of 0.85 s).
    ``warmup`` calls each function once first, untimed; ``collect`` runs the
    garbage collector (untimed) before each timed call, so that one
    implementation's garbage is not collected on another's clock.
    """
    pick = STATS[stat]
    if warmup:
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    if collect:
        _collect_and_freeze()
    order = list(fns)
    for r in range(repeats):
        k = r % len(order) if order else 0
        for name in order[k:] + order[:k]:
            if collect:
                gc.collect()
            times[name].append(elapsed(fns[name], device))
    return {name: pick(ts) for name, ts in times.items()}


def _load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):  # not on every platform
        return "n/a"
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min)"


def header(setting: Setting, repeats: int, *, stat: str = "median", peers: str = "") -> str:
    """The line above a table: torch, threads, device, the statistic, the load, the peers."""
    dev = setting.device
    where = f"cuda ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "cpu"
    clock = ", CUDA-synchronized" if dev.type == "cuda" else ""
    threads = torch.get_num_threads()
    running, started = setting.load.running(), setting.load.k
    busy = f"{running} busy process{'' if running == 1 else 'es'}"
    if running != started:  # a busy process ends by itself after busy.MAX_SECONDS
        busy += f" ({started - running} of the {started} started have ended)"
    line = (
        f"torch {torch.__version__}, {threads} thread{'' if threads == 1 else 's'}, {where}; "
        f"{stat} of {repeats} interleaved runs{clock}; "
        f"load: {busy}, load average at the start {_load_average()}"
    )
    return f"{line}; {peers}" if peers else line
