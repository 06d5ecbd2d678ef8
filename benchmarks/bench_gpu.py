"""Benchmark on a CUDA device: rlmath's backends for log-probs and the fused head vs the naive paths and peers.

For each case it prints the median time of ``--repeats`` runs (CUDA-synchronized
wall clock after a warm-up), the ratio to the naive path in the same run, the
extra peak memory of forward+backward (``torch.cuda.max_memory_allocated``
beyond the inputs and the gradients of the inputs), and the error against
fp64 of the same inputs. Each rlmath row names its backend: ``torch`` (the
chunked pure-torch kernels) or ``triton`` (when the ``triton`` package
imports).

* log-probs: ``naive`` = ``log_softmax(logits.float()).gather`` (plus
  ``-(p·logp).sum`` for the entropy) vs :func:`rlmath.log_probs_from_logits` /
  :func:`rlmath.log_probs_and_entropy_from_logits`. ``% HBM`` is the bytes a
  pass must move at least (forward: one read of the logits; forward+backward:
  two reads and one write of the gradient) over the time, as a share of
  ``--hbm`` bytes/s (4.8e12: an H200).
* fused head: ``unfused`` = ``hidden @ weight.T`` then rlmath's log-probs +
  entropy vs :func:`rlmath.log_probs_and_entropy_from_hidden`; and, computing
  the label log-probs only (the loss summed), rlmath's fused head against the
  peers that import here: Liger-Kernel's fused linear cross entropy
  (``reduction="none"``) and torch's ``F.linear_cross_entropy(...,
  options=LinearCrossEntropyOptions())``. Peers that cannot run are listed
  with the reason.

Usage: ``python benchmarks/bench_gpu.py [--repeats 10] [--quick] [--areas logprobs,fused]
[--backends torch,triton]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch

import rlmath as R
from rlmath.bench.tables import LOGPROBS_HEADER, fused_header, print_header, print_rows
from rlmath.engine import available_backends

Fn = Callable[..., tuple[torch.Tensor, ...]]

SKIPPED: list[str] = []
"""Implementations that could not run, with the reason (printed at the end)."""


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
        fn()  # warm-up (and, for Triton, compilation)
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved, so drift hits every implementation alike
            times[name].append(_sync_time(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def _runnable(impls: dict[str, Callable[[], object]], what: str) -> dict[str, Callable[[], object]]:
    """The implementations whose first call succeeds; the others go to :data:`SKIPPED`."""
    ok = {}
    for name, fn in impls.items():
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:  # a peer's version, an unsupported dtype, out of memory
            SKIPPED.append(
                f"{name} ({what}): {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            )
            gc.collect()
            torch.cuda.empty_cache()
        else:
            ok[name] = fn
    return ok


LOGPROBS_GPU_HEADER = [
    *LOGPROBS_HEADER[:6],
    "fwd % HBM",
    *LOGPROBS_HEADER[6:8],
    "fwd+bwd % HBM",
    *LOGPROBS_HEADER[8:],
]


def logprobs_rows(
    n: int, v: int, dtype: torch.dtype, repeats: int, backends: list[str], hbm: float
) -> list[list[str]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    gl = torch.randn(n, device="cuda", generator=g)
    ge = torch.randn(n, device="cuda", generator=g)

    def naive(z: torch.Tensor, lab: torch.Tensor, ent: bool) -> tuple[torch.Tensor, ...]:
        ls = torch.log_softmax(z.float(), -1)
        lp = ls.gather(-1, lab[:, None]).squeeze(-1)
        return (lp, -(ls.exp() * ls).sum(-1)) if ent else (lp,)

    def ours(backend: str) -> Fn:
        def f(z: torch.Tensor, lab: torch.Tensor, ent: bool) -> tuple[torch.Tensor, ...]:
            if ent:
                return R.log_probs_and_entropy_from_logits(z, lab, backend=backend)
            return (R.log_probs_from_logits(z, lab, backend=backend),)

        return f

    impls: dict[str, Fn] = {"naive": naive}
    impls.update({f"rlmath ({b})": ours(b) for b in backends})
    rows = []
    rows_ref = min(n, 128)
    ref = torch.log_softmax(x[:rows_ref].double(), -1)
    ref_lp = ref.gather(-1, labels[:rows_ref, None]).squeeze(-1)
    ref_ent = -torch.where(ref.exp() > 0, ref.exp() * ref, 0).sum(-1)
    del ref
    nbytes = n * v * x.element_size()
    for ent in (False, True):

        def fwd(f: Fn, ent: bool = ent) -> None:
            with torch.no_grad():
                f(x, labels, ent)

        def fwd_bwd(f: Fn, ent: bool = ent) -> None:
            leaf = x.detach().requires_grad_()
            outs = f(leaf, labels, ent)
            torch.autograd.backward(list(outs), [gl, ge][: len(outs)])

        what = f"[{n}, {v}] {dtype}"
        run = _runnable({k: (lambda f=f: fwd_bwd(f)) for k, f in impls.items()}, what)
        tf = _time({k: (lambda f=impls[k]: fwd(f)) for k in run}, repeats)
        tb = _time(run, repeats)
        for name in run:
            f = impls[name]
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
                    f"{100 * nbytes / tf[name] / hbm:.0f}%",
                    f"{tb[name] * 1e3:.2f}",
                    f"{tb[name] / tb['naive']:.2f}",
                    f"{100 * 3 * nbytes / tb[name] / hbm:.0f}%",
                    f"{peak / 2**20:.0f}",
                    f"{100 * peak / (4 * n * v):.1f}%",
                    " / ".join(f"{e:.1e}" for e in errs),
                ]
            )
    return rows


FUSED_GPU_HEADER = [*fused_header("ms")[:3], "computes", *fused_header("ms")[3:]]


def _liger_loss() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    if importlib.util.find_spec("liger_kernel") is None:
        SKIPPED.append("liger FLCE: liger_kernel is not installed")
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as exc:
        SKIPPED.append(f"liger FLCE: import failed: {type(exc).__name__}: {exc}")
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    return lambda h, w, lab: loss(w, h, lab)


def _torch_lce() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    fn = getattr(torch.nn.functional, "linear_cross_entropy", None)
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if fn is None or options is None:
        SKIPPED.append(f"torch linear_cross_entropy: not in torch {torch.__version__}")
        return None
    return lambda h, w, lab: fn(h, w, lab, reduction="none", options=options())


def fused_rows(
    n: int, h: int, v: int, dtype: torch.dtype, repeats: int, backends: list[str]
) -> list[list[str]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    gl = torch.randn(n, device="cuda", generator=g)
    ge = torch.randn(n, device="cuda", generator=g)

    def unfused(hh: torch.Tensor, ww: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return R.log_probs_and_entropy_from_logits(hh @ ww.T, labels, backend=backends[-1])

    def fused(backend: str, entropy: bool) -> Fn:
        def f(hh: torch.Tensor, ww: torch.Tensor) -> tuple[torch.Tensor, ...]:
            lp, ent = R.log_probs_and_entropy_from_hidden(
                hh, ww, labels, return_entropy=entropy, backend=backend
            )
            return (lp, ent) if ent is not None else (lp,)

        return f

    def peer(loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Fn:
        return lambda hh, ww: (-loss(hh, ww, labels),)

    # key: (function, what it computes, the name printed)
    impls: dict[str, tuple[Fn, str, str]] = {
        "unfused": (unfused, "logp + H", f"unfused ({backends[-1]})")
    }
    for b in backends:
        impls[f"fused {b}"] = (fused(b, True), "logp + H", f"rlmath fused ({b})")
    for b in backends:
        impls[f"fused {b} logp"] = (fused(b, False), "logp", f"rlmath fused ({b})")
    for name, make in (("liger FLCE", _liger_loss), ("torch linear_cross_entropy", _torch_lce)):
        loss = make()
        if loss is not None:
            impls[name] = (peer(loss), "logp", name)

    def fwd_bwd(f: Fn) -> None:
        hh, ww = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        outs = f(hh, ww)
        if len(outs) == 2:
            torch.autograd.backward(list(outs), [gl, ge])
        else:
            outs[0].sum().backward()  # peers with reduction="none": a summed loss

    what = f"{n}×{h}×{v} {dtype}"
    run = _runnable({k: (lambda f=f: fwd_bwd(f)) for k, (f, _, _) in impls.items()}, what)
    if "unfused" not in run:
        return []
    tb = _time(run, repeats)
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
    for name in run:
        f, computes, label = impls[name]
        peak = _peak(lambda f=f: fwd_bwd(f), grads)
        with torch.no_grad():
            if name == "unfused":
                outs = R.log_probs_and_entropy_from_logits(
                    hidden[:rows_ref] @ weight.T, labels[:rows_ref], backend=backends[-1]
                )
            elif name.startswith("fused"):
                lp, ent = R.log_probs_and_entropy_from_hidden(
                    hidden[:rows_ref], weight, labels[:rows_ref], backend=name.split()[1]
                )
                outs = (lp, ent) if computes != "logp" else (lp,)
            else:
                outs = (f(hidden, weight)[0][:rows_ref],)
        errs = [(outs[0].double() - ref_lp).abs().max().item()]
        if len(outs) == 2 and outs[1] is not None:
            errs.append((outs[1].double() - ref_ent).abs().max().item())
        rows.append(
            [
                f"{n}×{h}×{v}",
                str(dtype).replace("torch.", ""),
                label,
                computes,
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


def _backends(requested: str) -> list[str]:
    out = []
    probe = torch.empty(1, device="cuda")
    for name in requested.split(","):
        if name in available_backends(probe):
            out.append(name)
        else:
            SKIPPED.append(f"rlmath ({name}): backend not available on this device")
    return out or ["torch"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke)")
    parser.add_argument("--areas", default="logprobs,fused", help="comma-separated subset")
    parser.add_argument("--backends", default="torch,triton", help="rlmath backends to time")
    parser.add_argument("--hbm", type=float, default=4.8e12, help="HBM bandwidth, bytes/s")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    repeats = max(5, args.repeats)
    backends = _backends(args.backends)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, median of {repeats}, "
        f"CUDA-synchronized wall clock; rlmath backends: {', '.join(backends)}\n"
    )
    areas = args.areas.split(",")
    lp_shapes = [(1024, 32000)] if args.quick else [(8192, 32000), (16384, 151936)]
    if "logprobs" not in areas:
        lp_shapes = []
    rows = []
    for n, v in lp_shapes:
        for dt in (torch.float32, torch.bfloat16):
            rows += logprobs_rows(n, v, dt, repeats, backends, args.hbm)
            gc.collect()
            torch.cuda.empty_cache()
    _table(LOGPROBS_GPU_HEADER, rows)
    fh_shapes = (
        [(1024, 256, 32000)] if args.quick else [(16384, 4096, 151936), (16384, 2048, 32000)]
    )
    if "fused" not in areas:
        fh_shapes = []
    rows = []
    for n, h, v in fh_shapes:
        for dt in (torch.float32, torch.bfloat16):
            rows += fused_rows(n, h, v, dt, repeats, backends)
            gc.collect()
            torch.cuda.empty_cache()
    _table(FUSED_GPU_HEADER, rows)
    if SKIPPED:
        print("Could not run:")
        for line in SKIPPED:
            print(f"- {line}")


if __name__ == "__main__":
    main()
