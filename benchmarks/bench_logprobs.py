"""Benchmark: chunked log-probs (and entropy) from logits vs naive log_softmax + gather.

For each logits shape and dtype it times, in one process and interleaved run
by run (so that load from other processes hits every implementation alike):

* ``naive log_softmax+gather``: ``log_softmax(logits.float(), -1).gather(-1, labels)``,
  the baseline of every ratio, timed in every case (``×naive`` columns);
* ``naive + entropy``: the same plus ``-(p·logp).sum(-1)``;
* ``rlmath``: :func:`rlmath.log_probs_from_logits` /
  :func:`rlmath.log_probs_and_entropy_from_logits`;
* ``verl`` (``verl.utils.torch_functional.logprobs_from_logits`` and
  ``entropy_from_logits_with_chunking``) and ``trl``
  (``trl.trainer.utils.selective_log_softmax`` and ``entropy_from_logits``) when
  they can be imported (run with ``.venv-peers/bin/python`` to include them).

Columns: median forward time and forward+backward time over ``--repeats``
runs (≥ 5) after a warm-up and the ratio to ``naive log_softmax+gather`` on the
same logits (also for the functions that add the entropy); the extra
peak memory beyond the logits and their gradient, measured once per
implementation by a ``TorchDispatchMode`` that accounts every tensor an op
allocates (deterministic: see ``tests/memory_tracker.py``), as a share of the
logits' fp32 size; the largest error of the log-probs (and entropy) against an
fp64 reference on the first 256 rows (bf16 logits: fp64 of the same bf16
values).

Usage: ``python benchmarks/bench_logprobs.py [--repeats 5] [--quick] [--shapes 8192x32000,...]
[--dtypes float32,bfloat16] [--no-peers]``. Uses 2 intra-op threads (``--threads``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import rlmath as R

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tables import LOGPROBS_HEADER, print_header, print_rows

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.memory_tracker import MemoryTracker

try:  # optional peers, never dependencies
    from verl.utils.torch_functional import (  # type: ignore[import-not-found]
        entropy_from_logits_with_chunking as verl_entropy,
    )
    from verl.utils.torch_functional import (  # type: ignore[import-not-found]
        logprobs_from_logits as verl_logprobs,
    )
except Exception:  # pragma: no cover - depends on the environment
    verl_logprobs = verl_entropy = None
try:
    from trl.trainer.utils import (  # type: ignore[import-not-found]
        entropy_from_logits as trl_entropy,
    )
    from trl.trainer.utils import (  # type: ignore[import-not-found]
        selective_log_softmax as trl_logprobs,
    )
except Exception:  # pragma: no cover
    trl_logprobs = trl_entropy = None

Impl = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def naive_lp(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.log_softmax(x.float(), -1).gather(-1, labels[:, None]).squeeze(-1),)


def naive_lp_ent(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ls = torch.log_softmax(x.float(), -1)
    return ls.gather(-1, labels[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)


BASE = "naive log_softmax+gather"


def implementations(with_entropy: bool, peers: bool) -> dict[str, Impl]:
    # Every implementation, with or without the entropy, is compared to the naive
    # fp32 log_softmax + gather (docs/logprobs.md): it is timed in every case.
    impls: dict[str, Impl] = {BASE: naive_lp}
    if with_entropy:
        impls["naive + entropy"] = naive_lp_ent
        impls["rlmath"] = lambda x, lab: R.log_probs_and_entropy_from_logits(x, lab)
        if peers and verl_logprobs is not None:
            impls["verl"] = lambda x, lab: (verl_logprobs(x, lab), verl_entropy(x))
        if peers and trl_logprobs is not None:
            impls["trl"] = lambda x, lab: (trl_logprobs(x, lab), trl_entropy(x))
    else:
        impls["rlmath"] = lambda x, lab: (R.log_probs_from_logits(x, lab),)
        if peers and verl_logprobs is not None:
            impls["verl"] = lambda x, lab: (verl_logprobs(x, lab),)
        if peers and trl_logprobs is not None:
            impls["trl"] = lambda x, lab: (trl_logprobs(x, lab),)
    return impls


def fwd(fn: Impl, x: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(x, labels)
        return time.perf_counter() - t0


def fwd_bwd(fn: Impl, x: torch.Tensor, labels: torch.Tensor, grads: list[torch.Tensor]) -> float:
    leaf = x.detach().requires_grad_()
    t0 = time.perf_counter()
    outs = fn(leaf, labels)
    torch.autograd.backward(list(outs), grads[: len(outs)])
    elapsed = time.perf_counter() - t0
    del leaf, outs
    return elapsed


def extra_peak(fn: Impl, x: torch.Tensor, labels: torch.Tensor, grads: list[torch.Tensor]) -> int:
    """Peak tracked bytes during forward+backward, minus the gradient of the logits."""
    leaf = x.detach().requires_grad_()
    with MemoryTracker() as mem:
        outs = fn(leaf, labels)
        torch.autograd.backward(list(outs), grads[: len(outs)])
    grad_bytes = leaf.numel() * leaf.element_size()
    del leaf, outs
    gc.collect()
    return mem.peak_bytes - grad_bytes


def errors(fn: Impl, x: torch.Tensor, labels: torch.Tensor) -> str:
    rows = min(256, x.shape[0])
    xs, ls = x[:rows], labels[:rows]
    with torch.no_grad():
        outs = fn(xs, ls)
        ref = torch.log_softmax(xs.double(), -1)
        errs = [(outs[0].double() - ref.gather(-1, ls[:, None]).squeeze(-1)).abs().max().item()]
        if len(outs) > 1:
            ent = -(ref.exp() * ref).sum(-1)
            errs.append((outs[1].double() - ent).abs().max().item())
    return " / ".join(f"{e:.1e}" for e in errs)


def bench_case(
    n: int, v: int, dtype: torch.dtype, with_entropy: bool, repeats: int, peers: bool
) -> list[list[str]]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, v, generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    grads = [torch.randn(n, generator=g), torch.randn(n, generator=g)]
    impls = implementations(with_entropy, peers)
    t_f: dict[str, list[float]] = {k: [] for k in impls}
    t_b: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():  # warm-up
        fwd(fn, x[:64], labels[:64])
    for _ in range(repeats):
        for name, fn in impls.items():
            t_f[name].append(fwd(fn, x, labels))
            gc.collect()
            t_b[name].append(fwd_bwd(fn, x, labels, grads))
            gc.collect()
    fp32_bytes = 4 * n * v
    base_f = statistics.median(t_f[BASE])
    base_b = statistics.median(t_b[BASE])
    rows = []
    for name, fn in impls.items():
        mf, mb = statistics.median(t_f[name]), statistics.median(t_b[name])
        peak = extra_peak(fn, x, labels, grads)
        rows.append(
            [
                f"[{n}, {v}]",
                str(dtype).replace("torch.", ""),
                "log_probs + entropy" if with_entropy else "log_probs",
                name,
                f"{mf * 1e3:.0f}",
                f"{mf / base_f:.2f}",
                f"{mb * 1e3:.0f}",
                f"{mb / base_b:.2f}",
                f"{peak / 2**20:.0f}",
                f"{100 * peak / fp32_bytes:.1f}%",
                errors(fn, x, labels),
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="8192x32000,4096x151936")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--functions", default="log_probs,log_probs_and_entropy")
    parser.add_argument("--no-peers", action="store_true", help="skip verl / trl")
    parser.add_argument("--quick", action="store_true", help="small shapes, 5 repeats (smoke)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = "1024x32000,256x151936" if args.quick else args.shapes
    repeats = max(5, args.repeats)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {repeats}; "
        f"verl: {'yes' if verl_logprobs is not None and not args.no_peers else 'no'}, "
        f"trl: {'yes' if trl_logprobs is not None and not args.no_peers else 'no'}\n"
    )
    print_header(LOGPROBS_HEADER)
    for shape in shapes.split(","):
        n, v = (int(s) for s in shape.split("x"))
        for dt in args.dtypes.split(","):
            for func in args.functions.split(","):
                rows = bench_case(
                    n, v, getattr(torch, dt), func != "log_probs", repeats, not args.no_peers
                )
                print_rows(rows)
                gc.collect()


if __name__ == "__main__":
    main()
