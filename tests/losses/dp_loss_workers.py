"""Code run inside spawned ranks by test_dp_invariance (real gloo collectives).

Every rank rebuilds the same global batch from a seed, takes its micro-batches,
computes the loss of each with the counts of global_batch_info over the group,
backpropagates, and all-reduces the gradient divided by the world size, which
is exactly what DDP does. The test compares with one process on the full batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmath import get_policy_loss, global_batch_info

from .helpers import LOSS_KWARGS, policy_batch

B, T, MICRO = 12, 8, 2


def global_batch(seed: int):
    return policy_batch(B, T, seed, empty_rows=(1, 6))


def micro_batches(world: int, rank: int) -> list[list[int]]:
    """Uneven row blocks: rank r owns rows of sizes that differ between ranks."""
    sizes = [1, 2, 3, 1, 2, 1, 1, 1][: world * MICRO]
    sizes[-1] += B - sum(sizes)
    rows, start = [], 0
    for s in sizes:
        rows.append(list(range(start, start + s)))
        start += s
    return rows[rank * MICRO : (rank + 1) * MICRO]


def dp_policy_worker(seed: int, cases: list[tuple[str, str]]):
    """One result per ``(loss name, aggregation mode)`` case (one spawn for all of them)."""
    return [_one_case(seed, name, mode) for name, mode in cases]


def _one_case(seed: int, name: str, mode: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    old, logp, adv, mask = global_batch(seed)
    leaf = logp.clone().requires_grad_()
    mine = micro_batches(world, rank)
    info = global_batch_info([mask[rows] for rows in mine], group=dist.group.WORLD)
    fn = get_policy_loss(name)
    total = torch.zeros((), dtype=torch.float64)
    for rows in mine:
        idx = torch.tensor(rows)
        loss, _ = fn(
            old[idx], leaf[idx], adv[idx], mask[idx],
            loss_agg_mode=mode, norm_length=T, **info, **LOSS_KWARGS[name],
        )  # fmt: skip
        loss.backward()
        total = total + loss.detach()
    grad = leaf.grad.clone()
    dist.all_reduce(grad)
    dist.all_reduce(total)
    return {
        "grad": grad / world,
        "loss": total / world,
        "dp_size": info["dp_size"],
        "tokens": info["global_num_tokens"],
    }
