"""Functions run inside spawned ranks by the launcher tests."""

import time

import torch
import torch.distributed as dist


def sleep_worker():
    """Every rank stays alive without ever finishing (nothing a collective timeout can catch)."""
    time.sleep(3600)


def missing_rank_worker():
    """Rank 0 never joins the all-reduce that the other ranks wait in."""
    if dist.get_rank() == 0:
        time.sleep(3600)
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def ok_worker():
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()
