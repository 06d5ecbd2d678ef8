"""Benchmark on a CUDA device: rlmath's pure-torch log-probs and fused head vs the naive paths.

The CPU benchmarks (``bench_logprobs.py``, ``bench_fused_head.py``) measure
rlmath's performance goals; this script shows what the same pure-torch code does on a
GPU, where no Triton kernel sits behind it yet. For each case it prints the
median time of ``--repeats`` runs (CUDA-synchronized wall clock after a
warm-up), the ratio to the naive path in the same run, the extra peak memory
of forward+backward (``torch.cuda.max_memory_allocated`` beyond the inputs
and the gradients of the inputs), and the error against fp64.

* log-probs: ``naive`` = ``log_softmax(logits.float()).gather`` (plus
  ``-(p·logp).sum`` for the entropy) vs :func:`rlmath.log_probs_from_logits` /
  :func:`rlmath.log_probs_and_entropy_from_logits`;
* fused head: ``unfused`` = ``hidden @ weight.T`` then rlmath's log-probs +
  entropy vs :func:`rlmath.log_probs_and_entropy_from_hidden`.

Usage: ``python benchmarks/bench_gpu.py [--repeats 10] [--quick]``.
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
from _tables import LOGPROBS_HEADER, fused_header, print_header, print_rows

Fn = Callable[..., tuple[torch.Tensor, ...]]


def _sync_time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _peak(fn: Callable[[], object], exclude: int) -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base - exclude


def _time(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift hits every implementation alike
            times[name].append(_sync_time(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def logprobs_rows(n: int, v: int, dtype: torch.dtype, repeats: int) -> list[list[str]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    gl = torch.randn(n, device="cuda", generator=g)
    ge = torch.randn(n, device="cuda", generator=g)

    def naive(z: torch.Tensor, lab: torch.Tensor, ent: bool) -> tuple[torch.Tensor, ...]:
        ls = torch.log_softmax(z.float(), -1)
        lp = ls.gather(-1, lab[:, None]).squeeze(-1)
        return (lp, -(ls.exp() * ls).sum(-1)) if ent else (lp,)

    def ours(z: torch.Tensor, lab: torch.Tensor, ent: bool) -> tuple[torch.Tensor, ...]:
        if ent:
            return R.log_probs_and_entropy_from_logits(z, lab)
        return (R.log_probs_from_logits(z, lab),)

    rows = []
    rows_ref = min(n, 128)
    ref = torch.log_softmax(x[:rows_ref].double(), -1)
    ref_lp = ref.gather(-1, labels[:rows_ref, None]).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    del ref
    for ent in (False, True):
        impls: dict[str, Fn] = {"naive": naive, "rlmath": ours}

        def fwd(f: Fn = naive, ent: bool = ent) -> None:
            with torch.no_grad():
                f(x, labels, ent)

        def fwd_bwd(f: Fn = naive, ent: bool = ent) -> None:
            leaf = x.detach().requires_grad_()
            outs = f(leaf, labels, ent)
            torch.autograd.backward(list(outs), [gl, ge][: len(outs)])

        tf = _time({k: (lambda f=f: fwd(f)) for k, f in impls.items()}, repeats)
        tb = _time({k: (lambda f=f: fwd_bwd(f)) for k, f in impls.items()}, repeats)
        for name, f in impls.items():
            peak = _peak(lambda f=f: fwd_bwd(f), x.numel() * x.element_size())
            with torch.no_grad():
                outs = f(x[:rows_ref], labels[:rows_ref], ent)
            errs = [(outs[0].double() - ref_lp).abs().max().item()]
            if ent:
                errs.append((outs[1].double() - ref_ent).abs().max().item())
            rows.append(
                [
                    f"[{n}, {v}]",
                    str(dtype).replace("torch.", ""),
                    "log_probs + entropy" if ent else "log_probs",
                    name,
                    f"{tf[name] * 1e3:.2f}",
                    f"{tf[name] / tf['naive']:.2f}",
                    f"{tb[name] * 1e3:.2f}",
                    f"{tb[name] / tb['naive']:.2f}",
                    f"{peak / 2**20:.0f}",
                    f"{100 * peak / (4 * n * v):.1f}%",
                    " / ".join(f"{e:.1e}" for e in errs),
                ]
            )
    return rows


def fused_rows(n: int, h: int, v: int, dtype: torch.dtype, repeats: int) -> list[list[str]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    gl = torch.randn(n, device="cuda", generator=g)
    ge = torch.randn(n, device="cuda", generator=g)

    def unfused(hh: torch.Tensor, ww: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return R.log_probs_and_entropy_from_logits(hh @ ww.T, labels)

    def fused(hh: torch.Tensor, ww: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lp, ent = R.log_probs_and_entropy_from_hidden(hh, ww, labels)
        assert ent is not None
        return lp, ent

    impls: dict[str, Fn] = {"unfused": unfused, "rlmath fused": fused}

    def fwd_bwd(f: Fn) -> None:
        hh, ww = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        lp, ent = f(hh, ww)
        torch.autograd.backward([lp, ent], [gl, ge])

    tb = _time({k: (lambda f=f: fwd_bwd(f)) for k, f in impls.items()}, repeats)
    rows_ref = min(n, 128)
    with torch.no_grad():
        ref = torch.log_softmax(hidden[:rows_ref].double() @ weight.double().T, -1)
        ref_lp = ref.gather(-1, labels[:rows_ref, None]).squeeze(-1)
        ref_ent = -(ref.exp() * ref).sum(-1)
    del ref
    grads = (hidden.numel() + weight.numel()) * hidden.element_size()
    if dtype != torch.float32:
        grads += weight.numel() * 4  # the fp32 grad_weight accumulator the memory bound allows
    rows = []
    for name, f in impls.items():
        peak = _peak(lambda f=f: fwd_bwd(f), grads)
        with torch.no_grad():
            lp, ent = (
                R.log_probs_and_entropy_from_logits(hidden[:rows_ref] @ weight.T, labels[:rows_ref])
                if name == "unfused"
                else R.log_probs_and_entropy_from_hidden(
                    hidden[:rows_ref], weight, labels[:rows_ref]
                )
            )
        assert ent is not None
        errs = [
            (lp.double() - ref_lp).abs().max().item(),
            (ent.double() - ref_ent).abs().max().item(),
        ]
        rows.append(
            [
                f"{n}×{h}×{v}",
                str(dtype).replace("torch.", ""),
                name,
                f"{tb[name] * 1e3:.1f}",
                f"{tb[name] / tb['unfused']:.2f}",
                f"{peak / 2**20:.0f}",
                f"{100 * peak / (4 * n * v):.1f}%",
                " / ".join(f"{e:.1e}" for e in errs),
            ]
        )
    return rows


def _table(header: list[str], rows: list[list[str]]) -> None:
    if rows:
        print_header(header)
        print_rows(rows)
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke)")
    parser.add_argument("--areas", default="logprobs,fused", help="comma-separated subset")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    repeats = max(5, args.repeats)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, median of {repeats}, "
        "CUDA-synchronized wall clock\n"
    )
    areas = args.areas.split(",")
    lp_shapes = [(1024, 32000)] if args.quick else [(8192, 32000), (16384, 151936)]
    if "logprobs" not in areas:
        lp_shapes = []
    rows = []
    for n, v in lp_shapes:
        for dt in (torch.float32, torch.bfloat16):
            rows += logprobs_rows(n, v, dt, repeats)
            gc.collect()
            torch.cuda.empty_cache()
    _table(LOGPROBS_HEADER, rows)
    fh_shapes = [(1024, 256, 32000)] if args.quick else [(8192, 4096, 151936), (16384, 2048, 32000)]
    if "fused" not in areas:
        fh_shapes = []
    rows = []
    for n, h, v in fh_shapes:
        for dt in (torch.float32, torch.bfloat16):
            rows += fused_rows(n, h, v, dt, repeats)
            gc.collect()
            torch.cuda.empty_cache()
    _table(fused_header("ms"), rows)


if __name__ == "__main__":
    main()
