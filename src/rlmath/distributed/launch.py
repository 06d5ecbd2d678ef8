"""Start several processes the way ``torchrun --nproc-per-node N`` does.

User code calls :func:`init_from_env` at start-up; under torchrun that reads
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``. :func:`run_distributed`
sets the same variables for N local processes and runs a function in each, so
tests and users exercise the same initialisation path.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["init_from_env", "run_distributed"]


def init_from_env(backend: str | None = None) -> None:
    """Initialise the default process group from torchrun's environment variables.

    ``backend`` defaults to NCCL when CUDA is available, else gloo. Does nothing
    if the default group already exists.
    """
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
    dist.init_process_group(backend=backend)


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
    init_from_env(backend)
    try:
        result = fn(*args)
        with open(os.path.join(out_dir, f"{local_rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo"
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh local processes; return each rank's result.

    ``fn`` must be importable by name (a module-level function) because the
    processes are spawned. An exception on any rank is raised here.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _entry,
            args=(fn, world_size, _free_port(), backend, args, out_dir),
            nprocs=world_size,
            join=True,
        )
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
