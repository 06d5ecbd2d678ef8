"""Benchmark: log-probs under a sampler's kept set vs plain log-probs vs a sort-based reference.

For each logits shape, dtype and truncation (top-p, top-k, ...), three
implementations of the label log-probs:

- ``rlmath``: ``log_probs_from_logits`` with the truncation arguments;
- ``plain``: ``log_probs_from_logits`` without them (the full softmax), the
  cost the truncation is compared with;
- ``naive sort``: a plain-torch reference that sorts every row (vLLM's rules,
  ties cut by sort order): fp32 copy, sort, cumulative softmax, mask,
  ``log_softmax``, gather.

Time: the median of interleaved runs (:func:`rlmath.bench.setting.interleaved`)
of a forward under ``no_grad`` and of a forward + backward. Memory: the
tensor peak of one forward + backward beyond its inputs
(:func:`~rlmath.bench.memory.peak_bytes`) and the peak RSS of one call in a
fresh process (:func:`~rlmath.bench.memory.peak_rss_bytes`), each also as a
fraction of the fp32 logits ``4·N·V`` bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlmath.bench.memory import peak_bytes, peak_rss_bytes
from rlmath.bench.setting import Setting, floating_dtype, header, interleaved, release_memory
from rlmath.bench.tables import print_header, print_rows, significant
from rlmath.log_probs import log_probs_from_logits

__all__ = [
    "LOGITS",
    "TRUNCATIONS",
    "bench_case",
    "implementations",
    "naive_log_probs",
    "rss_case",
    "run",
]

TRUNCATIONS: dict[str, dict[str, Any]] = {
    "top_p=0.9": {"top_p": 0.9},
    "top_k=50": {"top_k": 50},
    "top_k=50+top_p=0.9": {"top_k": 50, "top_p": 0.9},
    "min_p=0.05": {"min_p": 0.05},
}
"""The truncations the benchmark runs, by name (vLLM's rules)."""

Impl = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def naive_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """vLLM's kept set by sorting every row, then ``log_softmax`` over it (labels added).

    Shape: ``(N, V)``, ``(N,)`` → ``(N,)`` fp32.
    """
    z = logits.float()
    zm = z
    if min_p is not None:
        probs = z.softmax(-1)
        zm = z.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    zs, order = zm.sort(-1, descending=True)
    keep = zs > float("-inf")
    if top_k is not None:
        keep &= torch.arange(zs.shape[-1], device=z.device) < top_k
    if top_p is not None:
        probs = zs.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= probs.cumsum(-1) - probs < top_p
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    mask[torch.arange(z.shape[0], device=z.device), labels] = True
    ls = z.masked_fill(~mask, float("-inf")).log_softmax(-1)
    return ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def implementations(truncation: dict[str, Any]) -> dict[str, Impl]:
    """The implementations compared, by name."""
    return {
        "rlmath": lambda x, y: log_probs_from_logits(x, y, **truncation),
        "plain": lambda x, y: log_probs_from_logits(x, y),
        "naive sort": lambda x, y: naive_log_probs(x, y, **truncation),
    }


LOGITS = ("normal", "peaky")
"""The logits the benchmark draws: ``"normal"``, i.i.d. ``N(0, 2²)`` (a flat distribution
whose nucleus holds thousands of tokens); ``"peaky"``, 32 logits per row about 12 above
a normal tail (most of the mass on a few tokens, as a language model's often is)."""


def _inputs(
    n: int, v: int, dtype: torch.dtype, device: torch.device, logits: str = "normal"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, v, generator=g) * 2
    if logits == "peaky":
        x[:, : min(32, v)] += 12
    x = x.to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    grad = torch.randn(n, generator=g).to(device)
    return x, labels, grad


def _forward_backward(
    fn: Impl, x: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    out = fn(leaf, labels)
    out.backward(grad)
    assert leaf.grad is not None
    return leaf.grad


RssCase = tuple[Callable[[], object], Callable[[], list[torch.Tensor]]]


def rss_case(
    n: int, v: int, dtype: str, impl: str, truncation: str, logits: str = "normal"
) -> RssCase:
    """The case of :func:`bench_case` on a CPU for :func:`~rlmath.bench.memory.peak_rss_bytes`."""
    x, labels, grad = _inputs(n, v, floating_dtype(dtype), torch.device("cpu"), logits)
    fn = implementations(TRUNCATIONS[truncation])[impl]
    rows = min(64, n)
    return (
        lambda: _forward_backward(fn, x[:rows], labels[:rows], grad[:rows]),
        lambda: [_forward_backward(fn, x, labels, grad)],
    )


def bench_case(
    setting: Setting,
    n: int,
    v: int,
    dtype: torch.dtype,
    truncation: str,
    repeats: int,
    naive: bool,
    logits: str = "normal",
) -> list[list[str]]:
    """The rows of one shape, dtype, truncation and kind of logits (:data:`LOGITS`)."""
    device = setting.device
    x, labels, grad = _inputs(n, v, dtype, device, logits)
    impls = implementations(TRUNCATIONS[truncation])
    if not naive:
        del impls["naive sort"]

    def forward(fn: Impl) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                fn(x, labels)

        return call

    def forward_backward(fn: Impl) -> Callable[[], torch.Tensor]:
        return lambda: _forward_backward(fn, x, labels, grad)

    fwd = interleaved({k: forward(f) for k, f in impls.items()}, device, repeats)
    both = interleaved({k: forward_backward(f) for k, f in impls.items()}, device, repeats)
    fp32_bytes = 4 * n * v
    rows = []
    for name, fn in impls.items():
        release_memory(device)
        grad_x, peak = peak_bytes(forward_backward(fn), device)
        extra = peak - grad_x.numel() * grad_x.element_size()  # the gradient is the result
        del grad_x
        rss = None
        if device.type == "cpu" and setting.rss:
            rss = peak_rss_bytes(
                "rlmath.bench.sampling",
                {"n": n, "v": v, "dtype": str(dtype).split(".")[-1], "impl": name,
                 "truncation": truncation, "logits": logits},
                threads=torch.get_num_threads(),
            )  # fmt: skip
        rows.append(
            [
                f"{n}×{v}",
                logits,
                str(dtype).split(".")[-1],
                truncation,
                name,
                significant(fwd[name] * 1e3),
                significant(fwd[name] / fwd["plain"]),
                significant(both[name] * 1e3),
                significant(both[name] / both["plain"]),
                significant(extra / 2**20),
                f"{extra / fp32_bytes:.1%}",
                "n/a" if rss is None else significant(rss / 2**20),
                "n/a" if rss is None else f"{rss / fp32_bytes:.1%}",
            ]
        )
    return rows


HEADER = [
    "logits", "drawn", "dtype", "truncation", "impl", "fwd ms", "fwd × plain", "fwd+bwd ms",
    "fwd+bwd × plain", "extra peak MiB", "extra / fp32 logits", "extra peak RSS MiB",
    "RSS / fp32 logits",
]  # fmt: skip


def run(
    setting: Setting,
    shapes: list[tuple[int, int]],
    dtypes: list[str],
    truncations: list[str],
    repeats: int,
    naive: bool = True,
    logits: str = "normal",
) -> None:
    """Print the table: every shape × dtype × truncation, each implementation a row."""
    unknown = [t for t in truncations if t not in TRUNCATIONS]
    if unknown:
        raise ValueError(f"unknown truncation {unknown}; known: {', '.join(TRUNCATIONS)}")
    if logits not in LOGITS:
        raise ValueError(f"unknown logits {logits!r}; known: {', '.join(LOGITS)}")
    print(header(setting, repeats))
    print_header(HEADER)
    for n, v in shapes:
        for dtype in dtypes:
            for truncation in truncations:
                print_rows(
                    bench_case(
                        setting, n, v, floating_dtype(dtype), truncation, repeats, naive, logits
                    )
                )
