"""Code run inside spawned ranks by test_dp_invariance (real gloo collectives).

Every rank rebuilds the same global batch from a seed, takes its micro-batches,
computes the loss of each with the counts of global_batch_info over the group,
backpropagates, and all-reduces the gradient divided by the world size, which
is exactly what DDP does. The test compares with one process on the full batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmath import (
    clip_cov_selection,
    get_policy_loss,
    global_batch_info,
    kl_cov_selection,
    prompt_batch_info,
)

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


def fixed_selection(name: str, old, logp, adv, mask):
    """Clip-Cov / KL-Cov select from batch statistics: the full batch's selection, fixed."""
    if name not in ("clip_cov", "kl_cov"):
        return None
    select = clip_cov_selection if name == "clip_cov" else kl_cov_selection
    gen = torch.Generator().manual_seed(0)
    return select(old, logp, adv, mask, generator=gen, **LOSS_KWARGS[name])


def _one_case(seed: int, name: str, mode: str):
    world, rank = dist.get_world_size(), dist.get_rank()
    old, logp, adv, mask = global_batch(seed)
    leaf = logp.clone().requires_grad_()
    mine = micro_batches(world, rank)
    info = global_batch_info([mask[rows] for rows in mine], group=dist.group.WORLD)
    # prompt-mean: prompt k is rows 2k, 2k + 1, which may sit on two ranks: dense ids.
    own = torch.tensor([r for rows in mine for r in rows])
    prompts = prompt_batch_info(
        mask[own], own // 2, group=dist.group.WORLD, num_prompt_ids=B // 2 + 1
    )
    prompt_tokens = dict(zip(own.tolist(), prompts["prompt_num_tokens"]))
    selection = fixed_selection(name, old, logp, adv, mask)
    fn = get_policy_loss(name)
    total = torch.zeros((), dtype=torch.float64)
    for rows in mine:
        idx = torch.tensor(rows)
        extra = {} if selection is None else {"selection": selection[idx]}
        loss, _ = fn(
            old[idx], leaf[idx], adv[idx], mask[idx],
            loss_agg_mode=mode, norm_length=T, **info, **LOSS_KWARGS[name], **extra,
            prompt_num_tokens=torch.stack([prompt_tokens[r] for r in rows]),
            global_num_prompts=prompts["global_num_prompts"],
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
