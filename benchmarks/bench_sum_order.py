"""Benchmark: the cost of the fixed summation order (128-column tiles and a tree) on a CPU.

The pure-torch passes sum each row over the vocabulary per 128-column tile and
add the tiles in a fixed tree (``rlmath/engine/tree.py``), which makes the
results bitwise independent of the tensor-parallel degree. This compares the
same public calls with the tile sums replaced by one plain row sum per row
(the order the passes used before; the tree over one tile is the identity),
interleaved in one process: the ratio is what the fixed order costs.

The fused head (``--head-shapes NxHxV``) merges per-tile statistics in the
tree instead: its baseline takes one tile per 2048-column block (``TILE``
patched to the block width: one max and one pair of sums per block and row,
the reductions the head made before its blocks were cut into tiles), merged in
the same tree of blocks.

Prints a table: median milliseconds per call of each, their ratio, and the
load average. ``--clock thread`` times the calling thread's CPU time (for one
thread: a busy machine then slows both variants less unevenly). Run:
``python benchmarks/bench_sum_order.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch

import rlmath.engine.torch_backend.head_forward as head_forward
import rlmath.engine.torch_backend.kl_forward as kl_forward
import rlmath.engine.torch_backend.logits_forward as logits_forward
import rlmath.engine.torch_backend.sum_pi_squared as sum_pi_squared
from rlmath.engine import tree
from rlmath.engine.policy import HEAD_TILE
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import (
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    sum_pi_squared_from_logits,
)

MODULES = (logits_forward, kl_forward, sum_pi_squared)


def _row_sums(
    x: torch.Tensor, *, nan: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One "tile" per row: the plain row sum (into ``out`` when given, as ``tile_sums``)."""
    sums = x.nansum(-1, keepdim=True) if nan else x.sum(-1, keepdim=True)
    return sums if out is None else out.copy_(sums)


PATCHES = {
    "tile_sums": _row_sums,
    "tile_count": lambda columns: 1 if columns else 0,
}


@contextlib.contextmanager
def plain_row_sums() -> Iterator[None]:
    """Within the block, the passes sum each row in one reduction instead of tiles."""
    saved = [(m, name, getattr(m, name)) for m in MODULES for name in PATCHES if hasattr(m, name)]
    try:
        for m, name, _ in saved:
            setattr(m, name, PATCHES[name])
        yield
    finally:
        for m, name, f in saved:
            setattr(m, name, f)


@contextlib.contextmanager
def one_tile_per_block() -> Iterator[None]:
    """Within the block, the fused head reduces each of its blocks as one tile."""
    saved = tree.TILE
    try:
        tree.TILE = HEAD_TILE
        yield
    finally:
        tree.TILE = saved


def _head_cases(n: int, h: int, v: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.05).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    assert head_forward.tile_stats is not None  # the pass the baseline changes

    def forward() -> object:
        with torch.no_grad():
            return log_probs_and_entropy_from_hidden(hidden, weight, labels)

    def forward_backward() -> object:
        lp, ent = log_probs_and_entropy_from_hidden(hg, wg, labels)
        (lp.sum() + ent.sum()).backward()
        return None

    return {"fused head fwd": forward, "fused head fwd+bwd": forward_backward}


def _cases(n: int, v: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    ref = (x.float() + 0.3 * torch.randn(n, v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    xg = x.clone().requires_grad_()

    def forward() -> object:
        with torch.no_grad():
            return log_probs_and_entropy_from_logits(x, labels)

    def forward_backward() -> object:
        lp, ent = log_probs_and_entropy_from_logits(xg, labels)
        (lp.sum() + ent.sum()).backward()
        return None

    def kl() -> object:
        with torch.no_grad():
            return kl_from_logits(x, ref)

    def pi_squared() -> object:
        return sum_pi_squared_from_logits(x)

    return {
        "log-probs+entropy fwd": forward,
        "log-probs+entropy fwd+bwd": forward_backward,
        "KL fwd": kl,
        "Σπ²": pi_squared,
    }


def _row(
    name: str,
    shape: str,
    dt: str,
    fn: Callable[[], object],
    baseline: Callable[[], contextlib.AbstractContextManager[None]],
    repeats: int,
    clock: Callable[[], float],
) -> None:
    fn()
    with baseline():
        fn()
    tiled, plain = [], []
    for _ in range(repeats):  # interleaved: the load hits both alike
        t0 = clock()
        fn()
        tiled.append(clock() - t0)
        with baseline():
            t0 = clock()
            fn()
            plain.append(clock() - t0)
    a, b = statistics.median(tiled) * 1e3, statistics.median(plain) * 1e3
    print(f"| {name:<28} | {shape:>15} | {dt:>8} | {a:13.1f} | {b:11.1f} | {a / b:5.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shapes", default="4096x32000,1024x151936")
    parser.add_argument("--head-shapes", default="1024x1024x32000", help="NxHxV; '' for none")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--quick", action="store_true", help="256x32000 fp32, 5 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.dtypes, args.repeats = "256x32000", "float32", 5
        args.head_shapes = "64x256x8192"
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(
        f"threads={args.threads} clock={args.clock} load average at start {os.getloadavg()[0]:.1f}"
    )
    print(f"| {'case':<28} | {'shape':>15} | {'dtype':>8} | tiles+tree ms | baseline ms | ratio |")
    print(f"|{'-' * 30}|{'-' * 17}|{'-' * 10}|---------------|-------------|-------|")
    for shape in filter(None, args.shapes.split(",")):
        n, v = (int(p) for p in shape.split("x"))
        for dt in args.dtypes.split(","):
            for name, fn in _cases(n, v, getattr(torch, dt)).items():
                _row(name, shape, dt, fn, plain_row_sums, args.repeats, clock)
    for shape in filter(None, args.head_shapes.split(",")):
        n, h, v = (int(p) for p in shape.split("x"))
        for dt in args.dtypes.split(","):
            for name, fn in _head_cases(n, h, v, getattr(torch, dt)).items():
                _row(name, shape, dt, fn, one_tile_per_block, args.repeats, clock)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
