"""Benchmark: the fused LM head vs ``hidden @ weight.T`` followed by rlmath's log-probs + entropy.

For each ``N×H×V`` shape and dtype it runs forward+backward of label
log-probs and entropies (both outputs used, random upstream gradients; hidden
and weight require grad, no bias) with:

* ``unfused``: ``log_probs_and_entropy_from_logits(hidden @ weight.T, labels)``,
  the path every ratio is measured against (the ``(N, V)`` logits and
  their gradient exist);
* ``rlmath fused``: :func:`rlmath.fused_head.log_probs_and_entropy_from_hidden`;
* ``verl``: ``FusedLinearForPPO`` (``verl.utils.experimental.torch_functional``,
  its default chunk of 512 tokens) when it can be imported: run with
  ``.venv-peers/bin/python`` to include it.

Columns: median forward+backward time over ``--repeats`` runs (≥ 5; the
implementations take turns run by run, in one process, so that load from
other processes hits them alike) and its ratio to ``unfused``; the peak memory
of one forward+backward beyond the inputs, their gradients, the outputs and,
for half-precision weights, one fp32 buffer of the weight's shape, as a share
of the fp32 ``(N, V)`` logits. Memory is counted by a ``TorchDispatchMode``
that accounts every tensor an op allocates (deterministic, see
``tests/memory_tracker.py``), in a separate untimed run that also warms up.
Last, the largest error of the log-probs and entropies against fp64 math on
the first 64 rows (fp64 matmul of the same input values).

"extra peak MiB" is everything beyond the gradients and the outputs (the
inputs exist before and are not counted); the percentage also leaves out the
fp32 buffer of the weight's shape that the memory bound allows for bf16 weights (for
every implementation alike, whether it uses one or not).

Usage: ``python benchmarks/bench_fused_head.py [--quick] [--shapes 8192x1024x32000,...]
[--dtypes float32,bfloat16] [--repeats 5] [--no-peers] [--threads 2]``.
The full shapes take minutes per run on a 2-core CPU; ``--quick`` runs small ones.
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

from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.logprobs import log_probs_and_entropy_from_logits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.memory_tracker import MemoryTracker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _tables import fused_header, print_header, print_rows

try:  # an optional peer, never a dependency
    from verl.utils.experimental.torch_functional import (  # type: ignore[import-not-found]
        FusedLinearForPPO,
    )
except Exception:  # pragma: no cover - depends on the environment
    FusedLinearForPPO = None

Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
FULL_SHAPES = "8192x1024x32000,4096x2048x151936"
QUICK_SHAPES = "4096x256x32000,1024x256x151936"


def implementations(peers: bool) -> dict[str, Impl]:
    impls: dict[str, Impl] = {
        "unfused": lambda h, w, lab: log_probs_and_entropy_from_logits(h @ w.T, lab),
        "rlmath fused": lambda h, w, lab: log_probs_and_entropy_from_hidden(h, w, lab),  # type: ignore[dict-item]
    }
    if peers and FusedLinearForPPO is not None:
        verl_head = FusedLinearForPPO()
        impls["verl FusedLinearForPPO"] = lambda h, w, lab: verl_head(h, w, lab)
    return impls


def forward_backward(
    fn: Impl, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grads
) -> tuple[torch.Tensor, ...]:
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    lp, ent = fn(h, w, labels)
    torch.autograd.backward([lp, ent], [grads[0].to(lp.dtype), grads[1].to(ent.dtype)])
    return lp.detach(), ent.detach(), h.grad, w.grad  # type: ignore[return-value]


def extra_peak(fn: Impl, hidden, weight, labels, grads) -> int:
    """Peak tracked bytes of one forward+backward beyond the gradients and the outputs."""
    with MemoryTracker() as mem:
        outs = forward_backward(fn, hidden, weight, labels, grads)
    kept = sum(t.numel() * t.element_size() for t in outs if t is not None)
    del outs
    gc.collect()
    return mem.peak_bytes - kept


def errors(fn: Impl, hidden, weight, labels) -> str:
    rows = min(64, hidden.shape[0])
    h, lab = hidden[:rows], labels[:rows]
    with torch.no_grad():
        lp, ent = fn(h, weight, lab)
        ls = torch.log_softmax(h.double() @ weight.double().T, -1)
        ref_lp = ls.gather(-1, lab[:, None]).squeeze(-1)
        ref_ent = -(ls.exp() * ls).sum(-1)
    e_lp = (lp.double() - ref_lp).abs().max().item()
    e_ent = (ent.double() - ref_ent).abs().max().item()
    return f"{e_lp:.1e} / {e_ent:.1e}"


def bench_case(
    n: int, h: int, v: int, dtype: torch.dtype, repeats: int, peers: bool
) -> list[list[str]]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * h**-0.5 * 2).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    grads = [torch.randn(n, generator=g), torch.randn(n, generator=g)]
    impls = implementations(peers)
    peaks = {name: extra_peak(fn, hidden, weight, labels, grads) for name, fn in impls.items()}
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            gc.collect()
            t0 = time.perf_counter()
            forward_backward(fn, hidden, weight, labels, grads)
            times[name].append(time.perf_counter() - t0)
    fp32_logits = 4 * n * v
    # The memory bound also leaves out one fp32 buffer of the weight's shape for half weights.
    allowance = 4 * weight.numel() if dtype in (torch.bfloat16, torch.float16) else 0
    base = statistics.median(times["unfused"])
    rows = []
    for name, fn in impls.items():
        med = statistics.median(times[name])
        rows.append(
            [
                f"{n}×{h}×{v}",
                str(dtype).replace("torch.", ""),
                name,
                f"{med:.2f}",
                f"{med / base:.2f}",
                f"{peaks[name] / 2**20:.0f}",
                f"{100 * (peaks[name] - allowance) / fp32_logits:.1f}%",
                errors(fn, hidden, weight, labels),
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=FULL_SHAPES, help="comma-separated NxHxV")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-peers", action="store_true", help="skip verl")
    parser.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = QUICK_SHAPES if args.quick else args.shapes
    repeats = max(5, args.repeats)
    verl = FusedLinearForPPO is not None and not args.no_peers
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {repeats}; "
        f"verl: {'yes' if verl else 'no'}\n"
    )
    print_header(fused_header("s"))
    for shape in shapes.split(","):
        n, h, v = (int(s) for s in shape.split("x"))
        for dt in args.dtypes.split(","):
            print_rows(bench_case(n, h, v, getattr(torch, dt), repeats, not args.no_peers))
            gc.collect()


if __name__ == "__main__":
    main()
