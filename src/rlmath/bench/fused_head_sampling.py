"""Benchmark: the fused LM head under a sampler's kept set, against the plain head and the logits.

For one shape ``(N tokens, H hidden, V vocabulary)``, dtype and truncation
(:data:`rlmath.bench.sampling.TRUNCATIONS`), three ways to the label
log-probs and entropy with their gradients (hidden states and weight):

- ``fused, kept set``: ``log_probs_and_entropy_from_hidden`` with the
  truncation (blocks of rows taken whole, recomputed in backward);
- ``fused, full softmax``: the same call without it, the plain fused head
  (vocabulary tiles, no kept set): what the kept set costs on top of it;
- ``logits, kept set``: ``hidden @ weight.T`` into the ``(N, V)`` logits, then
  ``log_probs_and_entropy_from_logits`` with the truncation: the same numbers
  with the logits held.

Time: the median of interleaved forward + backward runs. Memory: the tensor
peak of one forward + backward beyond its inputs and the peak RSS of one call
in a fresh process, less the gradients it returns, also as a fraction of the
fp32 logits ``4·N·V`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlmath.bench.memory import peak_bytes, peak_rss_bytes
from rlmath.bench.sampling import TRUNCATIONS
from rlmath.bench.setting import Setting, floating_dtype, header, interleaved, release_memory
from rlmath.bench.tables import print_header, print_rows, significant
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import log_probs_and_entropy_from_logits

__all__ = ["HEADER", "bench_case", "implementations", "rss_case", "run"]

Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def implementations(truncation: dict[str, Any]) -> dict[str, Impl]:
    """The three ways, by name: ``fn(hidden, weight, labels) -> (log_probs, entropy)``."""

    def fused(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> Any:
        return log_probs_and_entropy_from_hidden(h, w, labels, **truncation)

    def fused_plain(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> Any:
        return log_probs_and_entropy_from_hidden(h, w, labels)

    def logits(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> Any:
        return log_probs_and_entropy_from_logits(h @ w.T, labels, **truncation)

    return {
        "fused, kept set": fused,
        "fused, full softmax": fused_plain,
        "logits, kept set": logits,
    }


def _inputs(
    n: int, h: int, v: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) * h**-0.5 * 2).to(dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    grads = [torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)]
    return hidden, weight, labels, grads


def _forward_backward(
    fn: Impl, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
    lp, ent = fn(hl, wl, labels)
    torch.autograd.backward([lp, ent], grads)
    assert hl.grad is not None and wl.grad is not None
    return [hl.grad, wl.grad]


RssCase = tuple[Callable[[], object], Callable[[], list[torch.Tensor]]]


def rss_case(n: int, h: int, v: int, dtype: str, impl: str, truncation: str) -> RssCase:
    """The case of :func:`bench_case` on a CPU for :func:`~rlmath.bench.memory.peak_rss_bytes`."""
    hidden, weight, labels, grads = _inputs(n, h, v, floating_dtype(dtype), torch.device("cpu"))
    fn = implementations(TRUNCATIONS[truncation])[impl]
    rows = min(64, n)
    return (
        lambda: _forward_backward(
            fn, hidden[:rows], weight, labels[:rows], [g[:rows] for g in grads]
        ),
        lambda: _forward_backward(fn, hidden, weight, labels, grads),
    )


HEADER = [
    "shape N×H×V", "dtype", "truncation", "impl", "fwd+bwd ms", "× fused full softmax",
    "extra peak MiB", "extra / fp32 logits", "extra peak RSS MiB", "RSS / fp32 logits",
]  # fmt: skip


def bench_case(
    setting: Setting, n: int, h: int, v: int, dtype: torch.dtype, truncation: str, repeats: int
) -> list[list[str]]:
    """The rows of one shape, dtype and truncation."""
    device = setting.device
    hidden, weight, labels, grads = _inputs(n, h, v, dtype, device)
    impls = implementations(TRUNCATIONS[truncation])

    def call(fn: Impl) -> Callable[[], list[torch.Tensor]]:
        return lambda: _forward_backward(fn, hidden, weight, labels, grads)

    times = interleaved({k: call(f) for k, f in impls.items()}, device, repeats)
    fp32_bytes = 4 * n * v
    rows = []
    for name, fn in impls.items():
        release_memory(device)
        out, peak = peak_bytes(call(fn), device)
        extra = peak - sum(t.numel() * t.element_size() for t in out)  # the gradients
        del out
        rss = None
        if device.type == "cpu" and setting.rss:
            rss = peak_rss_bytes(
                "rlmath.bench.fused_head_sampling",
                {"n": n, "h": h, "v": v, "dtype": str(dtype).split(".")[-1], "impl": name,
                 "truncation": truncation},
                threads=torch.get_num_threads(),
            )  # fmt: skip
        rows.append(
            [
                f"{n}×{h}×{v}",
                str(dtype).split(".")[-1],
                truncation,
                name,
                significant(times[name] * 1e3),
                significant(times[name] / times["fused, full softmax"]),
                significant(extra / 2**20),
                f"{extra / fp32_bytes:.1%}",
                "n/a" if rss is None else significant(rss / 2**20),
                "n/a" if rss is None else f"{rss / fp32_bytes:.1%}",
            ]
        )
    return rows


def run(
    setting: Setting,
    shapes: list[tuple[int, int, int]],
    dtypes: list[str],
    truncations: list[str],
    repeats: int,
) -> None:
    """Print the table: every shape × dtype × truncation, each way a row."""
    unknown = [t for t in truncations if t not in TRUNCATIONS]
    if unknown:
        raise ValueError(f"unknown truncation {unknown}; known: {', '.join(TRUNCATIONS)}")
    print(header(setting, repeats))
    print_header(HEADER)
    for n, h, v in shapes:
        for dtype in dtypes:
            for truncation in truncations:
                print_rows(bench_case(setting, n, h, v, floating_dtype(dtype), truncation, repeats))
