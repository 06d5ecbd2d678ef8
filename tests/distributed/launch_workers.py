"""Functions run inside spawned ranks by the launcher tests."""

import os
import time

import torch
import torch.distributed as dist


def _record_pid(pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))


def sleep_worker(pid_dir: str):
    """Every rank stays alive without ever finishing (nothing a collective timeout can catch)."""
    _record_pid(pid_dir)
    time.sleep(3600)


def missing_rank_worker(pid_dir: str):
    """Rank 0 never joins the all-reduce that the other ranks wait in."""
    _record_pid(pid_dir)
    if dist.get_rank() == 0:
        time.sleep(3600)
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def ok_worker():
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()
