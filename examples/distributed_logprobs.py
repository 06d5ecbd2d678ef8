"""Tensor-parallel (vocabulary-sharded) log-probs and entropy equal the single-process result.

Each rank holds some columns of the logits of the same tokens, as after a
Megatron column-parallel LM head. GPT-2's vocabulary of 50257 tokens does not
divide evenly, so every rank passes the global id of its first column.

Run either way (two processes on this machine, gloo on CPU, NCCL on GPUs):

    torchrun --nproc-per-node 2 examples/distributed_logprobs.py
    python examples/distributed_logprobs.py          # starts 2 processes itself
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlmath import VocabParallel, log_probs_and_entropy_from_logits
from rlmath.distributed import init_from_env, run_distributed

VOCAB = 50257  # GPT-2: not a multiple of 2 or 4
TOKENS = 6
TEMPERATURE = 0.8


def shard_bounds(world: int) -> list[int]:
    """Rank ``r`` holds columns ``[bounds[r], bounds[r + 1])``.

    For 2 ranks: ``[0, 25128, 50257]``, i.e. 25128 columns on rank 0 and 25129
    on rank 1 (``round`` takes 25128.5 to the even 25128).
    """
    return [round(r * VOCAB / world) for r in range(world + 1)]


def demo(verbose: bool = True) -> dict[str, float]:
    """Compare the sharded and the single-process computation; return the largest differences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = None
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)

    # The same "model output" on every rank (a fixed seed), fp64 so the check is tight.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(TOKENS, VOCAB, generator=g, dtype=torch.float64) * 2).to(device)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g).to(device)
    labels[-1] = -100  # an ignored position (padding): log-prob and entropy 0, no gradient

    # This rank's columns: uneven shards (see shard_bounds).
    bounds = shard_bounds(world)
    start, end = bounds[rank], bounds[rank + 1]
    shard = logits[:, start:end].clone().requires_grad_()

    logp, entropy = log_probs_and_entropy_from_logits(
        shard, labels, temperature=TEMPERATURE, vocab_parallel=VocabParallel(start=start)
    )
    # Every rank computes the same loss from the replicated outputs and backpropagates it.
    loss = -logp.sum() - 0.01 * entropy.sum()
    loss.backward()

    # Single process on the whole vocabulary: the same operation, without a shard.
    full = logits.clone().requires_grad_()
    ref_logp, ref_entropy = log_probs_and_entropy_from_logits(full, labels, temperature=TEMPERATURE)
    (-ref_logp.sum() - 0.01 * ref_entropy.sum()).backward()

    diffs = {
        "log_probs": (logp - ref_logp).abs().max().item(),
        "entropy": (entropy - ref_entropy).abs().max().item(),
        "grad_logits": (shard.grad - full.grad[:, start:end]).abs().max().item(),
    }
    if verbose:
        if rank == 0:
            print(f"log-probs on rank 0: {[round(x, 4) for x in logp.tolist()]}")
        print(
            f"rank {rank}/{world}: columns [{start}, {end}); max |TP - single process|: "
            + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()),
            flush=True,
        )
    return diffs


def main() -> dict[str, float]:
    started_here = not dist.is_initialized()
    init_from_env()
    try:
        return demo()
    finally:
        if started_here:
            dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        main()
    else:
        results = run_distributed(main, 2)
        worst = max(max(r.values()) for r in results)
        print(f"largest difference over both ranks: {worst:.1e}")
