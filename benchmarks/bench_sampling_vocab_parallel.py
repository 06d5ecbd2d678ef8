"""Benchmark: kept-set log-probs over a vocabulary split between 2 gloo ranks, against one process.

Each rank holds half the columns of ``[M, V]`` fp32 logits and runs one
thread; the forward of ``log_probs_from_logits`` (plain, ``top_p``,
``top_k``, ``min_p``) is timed between barriers on rank 0, median of 5
interleaved runs; then rank 0 times the same calls on the whole vocabulary
alone. Prints the load average before and after (the ranks share the
machine's cores).

Usage: ``python benchmarks/bench_sampling_vocab_parallel.py [M] [V]`` (default 2048 32000).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import rlmath as R
from rlmath import VocabParallel
from rlmath.distributed import run_distributed

CASES = {
    "plain": {},
    "top_p=0.9": {"top_p": 0.9},
    "top_k=50": {"top_k": 50},
    "min_p=0.05": {"min_p": 0.05},
}


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def worker(M: int, V: int) -> tuple[dict[str, float], dict[str, float]]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, V, generator=g)
    labels = torch.randint(0, V, (M,), generator=g)
    width = V // world
    local = x[:, rank * width : (rank + 1) * width].contiguous()
    split: dict[str, list[float]] = {}
    for _ in range(5):
        for name, kw in CASES.items():
            dist.barrier()
            t = time.perf_counter()
            R.log_probs_from_logits(local, labels, vocab_parallel=VocabParallel(), **kw)
            dist.barrier()
            split.setdefault(name, []).append(time.perf_counter() - t)
    whole: dict[str, list[float]] = {}
    if rank == 0:
        for _ in range(5):
            for name, kw in CASES.items():
                t = time.perf_counter()
                R.log_probs_from_logits(x, labels, **kw)
                whole.setdefault(name, []).append(time.perf_counter() - t)
    return {k: _median(v) for k, v in split.items()}, {k: _median(v) for k, v in whole.items()}


def main() -> None:
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    V = int(sys.argv[2]) if len(sys.argv) > 2 else 32000
    before = os.getloadavg()[0]
    split, whole = run_distributed(worker, 2, M, V)[0]
    after = os.getloadavg()[0]
    print(f"[{M}, {V}] fp32, forward, ms (median of 5); load average {before:.2f} -> {after:.2f}")
    print(
        "| call | 2 ranks (half the columns each) | x plain | one process, whole vocabulary | x plain |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in CASES:
        s, w = split[name] * 1e3, whole[name] * 1e3
        # Three significant digits: a sub-millisecond time of a small shape stays nonzero.
        print(
            f"| {name} | {s:.3g} | {s / (split['plain'] * 1e3):.1f} | {w:.3g} | {w / (whole['plain'] * 1e3):.1f} |"
        )


if __name__ == "__main__":
    main()
