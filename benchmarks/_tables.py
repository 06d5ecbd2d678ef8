"""Markdown tables shared by the benchmark scripts (the same columns on CPU and GPU)."""

from __future__ import annotations

from collections.abc import Iterable

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
        "max err vs fp64 (logp / H)",
    ]


def print_header(header: list[str]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))


def print_rows(rows: Iterable[list[str]]) -> None:
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)
