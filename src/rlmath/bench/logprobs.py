"""Benchmark: chunked log-probs (and entropy) from logits vs naive ``log_softmax`` + gather.

For each logits shape and dtype it times, in one process and interleaved run
by run (so that load from other processes hits every implementation alike):

* ``naive log_softmax+gather``: :func:`~rlmath.bench.baselines.naive_log_probs`,
  the baseline of every ratio, timed in every case (``×naive`` columns);
* ``naive + entropy``: the same plus ``−(p·logp).sum(-1)``;
* ``rlmath``: :func:`rlmath.log_probs_from_logits` /
  :func:`rlmath.log_probs_and_entropy_from_logits`;
* ``verl`` (``verl.utils.torch_functional.logprobs_from_logits`` and
  ``entropy_from_logits_with_chunking``) and ``trl``
  (``trl.trainer.utils.selective_log_softmax`` and ``entropy_from_logits``)
  when peers are on and they import.

Columns: median forward time and forward+backward time over the repeats
(after a warm-up) and the ratio to ``naive log_softmax+gather`` on the same
logits (also for the functions that add the entropy); the extra peak memory
of one forward+backward beyond the logits and their gradient, measured once
per implementation, as a share of the logits' fp32 size, twice: the tensors
the call allocates (:func:`rlmath.bench.memory.peak_bytes`, deterministic on
CPU) and the peak RSS of the call in a fresh process on a CPU
(:func:`rlmath.bench.memory.peak_rss_bytes`: what the operating system
counts, allocator caches and libraries' buffers included; ``n/a`` elsewhere);
the largest error of the log-probs (and entropy) against fp64 math on the
first 256 rows (bf16 logits: fp64 of the same bf16 values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

import rlmath as R
from rlmath.bench import baselines
from rlmath.bench.memory import RssCase, peak_bytes, peak_rss_bytes
from rlmath.bench.setting import (
    BenchSettingError,
    Setting,
    check_repeats,
    floating_dtype,
    header,
    interleaved,
    release_memory,
)
from rlmath.bench.tables import LOGPROBS_HEADER, print_header, print_rows, significant

__all__ = [
    "DEFAULT_REPEATS",
    "FULL_SHAPES",
    "FUNCTIONS",
    "QUICK_SHAPES",
    "bench_case",
    "implementations",
    "rss_case",
    "run",
]

Impl = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]
#: (log-probs, entropy) functions of a peer library.
PeerFns = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]

FULL_SHAPES: tuple[tuple[int, int], ...] = ((8192, 32000), (4096, 151936))
QUICK_SHAPES: tuple[tuple[int, int], ...] = ((256, 32000), (64, 151936))
DTYPES = ("float32", "bfloat16")
FUNCTIONS = ("log_probs", "log_probs_and_entropy")
DEFAULT_REPEATS = 5
ERROR_ROWS = 256
BASE = "naive log_softmax+gather"


def find_peers(enabled: bool) -> dict[str, PeerFns]:
    """verl's and TRL's log-probs and entropy functions, those that import (none if not ``enabled``)."""
    found: dict[str, PeerFns] = {}
    if not enabled:
        return found
    try:  # optional peers, never dependencies: absent or broken reads the same here
        from verl.utils.torch_functional import (  # type: ignore[import-not-found]
            entropy_from_logits_with_chunking,
            logprobs_from_logits,
        )

        found["verl"] = (logprobs_from_logits, entropy_from_logits_with_chunking)
    except Exception:
        pass
    try:
        from trl.trainer.utils import (  # type: ignore[import-not-found]
            entropy_from_logits,
            selective_log_softmax,
        )

        found["trl"] = (selective_log_softmax, entropy_from_logits)
    except Exception:
        pass
    return found


def _log_probs_only(logp: Callable[..., torch.Tensor]) -> Impl:
    def impl(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (logp(x, labels),)

    return impl


def _with_entropy(logp: Callable[..., torch.Tensor], ent: Callable[..., torch.Tensor]) -> Impl:
    def impl(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return logp(x, labels), ent(x)

    return impl


def implementations(with_entropy: bool, peers: dict[str, PeerFns]) -> dict[str, Impl]:
    """The implementations of one case, the baseline first."""
    # Every implementation, with or without the entropy, is compared with the
    # naive fp32 log_softmax + gather: it is timed in every case.
    impls: dict[str, Impl] = {BASE: _log_probs_only(baselines.naive_log_probs)}
    if with_entropy:
        impls["naive + entropy"] = baselines.naive_log_probs_and_entropy
        impls["rlmath"] = R.log_probs_and_entropy_from_logits
        for name, (logp, ent) in peers.items():
            impls[name] = _with_entropy(logp, ent)
    else:
        impls["rlmath"] = _log_probs_only(R.log_probs_from_logits)
        for name, (logp, _) in peers.items():
            impls[name] = _log_probs_only(logp)
    return impls


def _errors(fn: Impl, x: torch.Tensor, labels: torch.Tensor) -> str:
    rows = min(ERROR_ROWS, x.shape[0])
    xs, ls = x[:rows], labels[:rows]
    with torch.no_grad():
        outs = fn(xs, ls)
        ref = torch.log_softmax(xs.double(), -1)
        errs = [float((outs[0].double() - ref.gather(-1, ls[:, None]).squeeze(-1)).abs().max())]
        if len(outs) > 1:
            entropy = -(ref.exp() * ref).sum(-1)
            errs.append(float((outs[1].double() - entropy).abs().max()))
    return " / ".join(f"{e:.1e}" for e in errs)


def _inputs(
    n: int, v: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The logits, labels and upstream gradients of a case (seeded: the same in every process)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, v, generator=g) * 2).to(dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    grads = [torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)]
    return x, labels, grads


def _forward_backward(
    fn: Impl, x: torch.Tensor, labels: torch.Tensor, grads: list[torch.Tensor]
) -> torch.Tensor:
    """One forward+backward of ``fn``; returns the gradient of the logits."""
    leaf = x.detach().requires_grad_()
    outs = fn(leaf, labels)
    torch.autograd.backward(list(outs), grads[: len(outs)])
    assert leaf.grad is not None
    return leaf.grad


def rss_case(n: int, v: int, dtype: str, impl: str, with_entropy: bool, peers: bool) -> RssCase:
    """The case of :func:`bench_case` on a CPU for :func:`~rlmath.bench.memory.peak_rss_bytes`."""
    x, labels, grads = _inputs(n, v, floating_dtype(dtype), torch.device("cpu"))
    fn = implementations(with_entropy, find_peers(peers))[impl]
    rows = min(64, n)
    return (
        lambda: _forward_backward(fn, x[:rows], labels[:rows], [g[:rows] for g in grads]),
        lambda: [_forward_backward(fn, x, labels, grads)],
    )


def bench_case(
    setting: Setting,
    n: int,
    v: int,
    dtype: torch.dtype,
    with_entropy: bool,
    repeats: int,
    peers: dict[str, PeerFns],
) -> list[list[str]]:
    """The rows of one ``(n, v)`` logits shape, dtype and function."""
    device = setting.device
    x, labels, grads = _inputs(n, v, dtype, device)
    impls = implementations(with_entropy, peers)

    def forward(fn: Impl) -> None:
        with torch.no_grad():
            fn(x, labels)

    def forward_backward(fn: Impl) -> None:
        _forward_backward(fn, x, labels, grads)

    for fn in impls.values():  # warm-up, on a slice
        with torch.no_grad():
            fn(x[:64], labels[:64])
    runs: dict[str, Callable[[], object]] = {}
    for name, fn in impls.items():
        runs[f"fwd {name}"] = partial(forward, fn)
        runs[f"bwd {name}"] = partial(forward_backward, fn)
    times = interleaved(runs, device, repeats, warmup=False)
    fp32_bytes = 4 * n * v
    grad_bytes = x.numel() * x.element_size()
    base_f, base_b = times[f"fwd {BASE}"], times[f"bwd {BASE}"]
    rows = []
    for name, fn in impls.items():
        mf, mb = times[f"fwd {name}"], times[f"bwd {name}"]
        # The gradient of the logits is not extra: every implementation returns one.
        _, peak = peak_bytes(partial(forward_backward, fn), device)
        peak -= grad_bytes
        rss = None
        if device.type == "cpu" and setting.rss:
            case = {"n": n, "v": v, "dtype": str(dtype).replace("torch.", ""), "impl": name,
                    "with_entropy": with_entropy, "peers": setting.peers}  # fmt: skip
            threads = torch.get_num_threads()
            rss = peak_rss_bytes("rlmath.bench.logprobs", case, threads=threads)
        rows.append(
            [
                f"[{n}, {v}]",
                str(dtype).replace("torch.", ""),
                "log_probs + entropy" if with_entropy else "log_probs",
                name,
                significant(mf * 1e3),
                f"{mf / base_f:.2f}",
                significant(mb * 1e3),
                f"{mb / base_b:.2f}",
                f"{peak / 2**20:.0f}",
                f"{100 * peak / fp32_bytes:.1f}%",
                "n/a" if rss is None else f"{rss / 2**20:.0f}",
                "n/a" if rss is None else f"{100 * rss / fp32_bytes:.1f}%",
                _errors(fn, x, labels),
            ]
        )
    return rows


def run(
    setting: Setting,
    *,
    quick: bool = False,
    repeats: int | None = None,
    shapes: Sequence[tuple[int, int]] | None = None,
    dtypes: Sequence[str] = DTYPES,
    functions: Sequence[str] = FUNCTIONS,
) -> None:
    """Print the log-probs table: every shape × dtype × function (``shapes`` overrides ``quick``)."""
    repeats = check_repeats(DEFAULT_REPEATS if repeats is None else repeats)
    unknown = sorted(set(functions) - set(FUNCTIONS))
    if unknown:
        raise BenchSettingError(f"unknown functions {unknown}; expected some of {list(FUNCTIONS)}")
    torch_dtypes = [floating_dtype(name) for name in dtypes]
    if shapes is None:
        shapes = QUICK_SHAPES if quick else FULL_SHAPES
    peers = find_peers(setting.peers)
    listed = ", ".join(f"{p}: {'yes' if p in peers else 'no'}" for p in ("verl", "trl"))
    print("### Log-probs and entropy from logits\n")
    print(header(setting, repeats, peers=listed) + "\n")
    print_header(LOGPROBS_HEADER)
    for n, v in shapes:
        for dtype in torch_dtypes:
            for func in functions:
                with_entropy = func == "log_probs_and_entropy"
                print_rows(bench_case(setting, n, v, dtype, with_entropy, repeats, peers))
                release_memory(setting.device)
