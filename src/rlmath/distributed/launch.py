"""Start several processes the way ``torchrun --nproc-per-node N`` does.

User code calls :func:`init_from_env` at start-up; under torchrun that reads
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``. :func:`run_distributed`
sets the same variables for N local processes and runs a function in each, so
tests and users exercise the same initialisation path.

Timeouts: a rank that stays alive without joining a collective leaves the
others waiting in it for the process group's timeout (torch's default: 30
minutes for gloo, 10 for NCCL). ``init_from_env(timeout=...)`` sets that
timeout; :func:`run_distributed` also bounds its own wait for the workers.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlmath._validation import check_in_range, check_int

__all__ = ["init_from_env", "run_distributed"]


def _check_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return check_in_range("timeout", timeout, 0.0, None, low_inclusive=False)


def init_from_env(
    backend: str | None = None, *, timeout: float | datetime.timedelta | None = None
) -> None:
    """Initialise the default process group from torchrun's environment variables.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. Does nothing
    if the default group already exists. ``timeout`` (seconds or a
    ``timedelta``) is passed to ``init_process_group``: the longest any
    collective (and the initial rendezvous) waits for the other ranks before
    raising; ``None`` keeps torch's default (30 minutes for gloo).
    """
    seconds = _check_timeout(timeout)
    if dist.is_initialized():
        return
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"environment variable {var} is not set: start the program with "
                "torchrun --nproc-per-node N, or use rlmath.distributed.run_distributed"
            )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if seconds is None:
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=seconds))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    local_rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    args: tuple[Any, ...],
    out_dir: str,
    timeout: float | None,
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Several ranks share few cores; one thread each avoids oversubscription.
    torch.set_num_threads(1)
    init_from_env(backend, timeout=timeout)
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"{local_rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        # Every rank leaves together: a rank still inside a collective while
        # another one exits would wait for it until the timeout.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # The worker ends here, without destroying the group: in torch 2.6 the
    # destructor of a gloo group can deadlock (it holds the GIL while joining a
    # worker thread that is releasing a Python tensor of an earlier collective
    # and waits for the GIL). The result is on disk and every collective has
    # completed, so nothing is lost by skipping the interpreter's clean-up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | datetime.timedelta | None = 300.0,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh local processes; return each rank's result.

    ``fn`` must be importable by name (a module-level function) because the
    processes are spawned. An exception on any rank is raised here (and the
    other ranks are terminated).

    ``timeout`` (seconds or a ``timedelta``; default 300; ``None`` for no
    limit) bounds both:

    * every collective of the workers, through
      ``init_process_group(timeout=...)``: a rank left waiting for a rank that
      never joins raises after ``timeout`` seconds instead of gloo's 30 minutes;
    * this call's wait for the workers: if they have not all finished
      ``timeout`` seconds after the start (start-up included), every worker
      still running is terminated and ``TimeoutError`` names the ranks that
      were still running.

    So a hung rank makes the call fail within about ``timeout`` seconds, with
    no process left behind. Give a larger value for long jobs.
    """
    world_size = check_int("world_size", world_size, 1)
    seconds = _check_timeout(timeout)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, _free_port(), backend, args, out_dir, seconds),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        assert context is not None
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            # join() raises (after terminating the others) as soon as a worker fails.
            while not context.join(timeout=0.5):
                if deadline is not None and time.monotonic() >= deadline:
                    running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                    _terminate(context.processes)
                    raise TimeoutError(
                        f"run_distributed: rank(s) {running} of {world_size} still running "
                        f"after timeout={seconds:g} s; every worker was terminated (a rank "
                        "that never joins a collective hangs the others: check that every "
                        "rank makes the same collective calls, or pass a larger timeout)"
                    )
        except KeyboardInterrupt:
            # Ctrl-C reaches every worker too, each at a different point; ranks left
            # waiting in a collective would never finish, so none is left behind.
            _terminate(context.processes)
            raise
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _terminate(processes: list[Any]) -> None:
    """SIGTERM every live worker, SIGKILL the ones still alive a few seconds later."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
