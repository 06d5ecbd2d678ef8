"""Markdown tables of the benchmarks: the same columns on CPU and GPU, printed row by row."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "LOGPROBS_HEADER",
    "fused_header",
    "print_header",
    "print_rows",
    "significant",
]

LOGPROBS_HEADER = [
    "logits",
    "dtype",
    "function",
    "impl",
    "fwd ms",
    "fwd ×naive",
    "fwd+bwd ms",
    "fwd+bwd ×naive",
    "extra peak MiB",
    "extra / fp32 logits",
    "extra peak RSS MiB",
    "RSS / fp32 logits",
    "max err vs fp64 (logp / H)",
]


def fused_header(time_unit: str) -> list[str]:
    """Columns of the fused-head tables; ``time_unit`` is ``"s"`` or ``"ms"``."""
    return [
        "N×H×V",
        "dtype",
        "impl",
        f"fwd+bwd {time_unit}",
        "× unfused",
        "extra peak MiB",
        "extra (− fp32 W buffer if half) / fp32 logits",
        "extra peak RSS MiB",
        "RSS (− fp32 W buffer if half) / fp32 logits",
        "max err vs fp64 (logp / H)",
    ]


def print_header(header: list[str]) -> None:
    """The header line and the separator line of a markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))


def print_rows(rows: Iterable[list[str]]) -> None:
    """One markdown line per row, flushed at once: long runs show their progress."""
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)


def significant(x: float) -> str:
    """A time with three significant digits (no decimals from 100 on): 1234, 123, 12.3, 1.23, 0.123."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"
