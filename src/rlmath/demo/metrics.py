"""Per-step metrics: the ``metrics.jsonl`` writer and the end-of-run summary table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch

__all__ = [
    "MetricsWriter",
    "NonFiniteError",
    "Record",
    "check_finite",
    "read_metrics",
    "summary_table",
]

#: One line of metrics.jsonl; None where a value was not finite (JSON null).
Record = dict[str, float | None]

# The keys every line of metrics.jsonl holds, in this order (others follow).
CORE_KEYS = (
    "step",
    "reward_mean",
    "success_rate",
    "kl",
    "entropy",
    "clip_frac",
    "value_loss",
    "lr",
    "tokens_per_s",
)


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or statistic of the run is NaN or infinite: training diverged.

    ``metric`` names the quantity (``"pg_loss"``, ``"grad_norm"``, ...) and
    ``value`` is what it was; the runner adds the step.
    """

    def __init__(self, metric: str, value: float) -> None:
        super().__init__(f"{metric} is {value} (not finite)")
        self.metric = metric
        self.value = value


def check_finite(metric: str, value: object) -> float:
    """``float(value)``, or :class:`NonFiniteError` naming ``metric`` if it is NaN or inf.

    Reads a tensor on the host: the demo checks once per update, outside the
    math, so that a diverging run stops at the first bad number instead of
    failing later inside sampling.
    """
    if isinstance(value, torch.Tensor):
        value = value.detach()
    v = float(value)  # type: ignore[arg-type]
    if not math.isfinite(v):
        raise NonFiniteError(metric, v)
    return v


class MetricsWriter:
    """Appends one JSON object per step to ``path`` and flushes it at once.

    Flushing every line means an interrupted run (Ctrl-C, a crash) keeps every
    step it finished.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("w", encoding="utf-8")
        self.records: list[Record] = []

    def write(self, record: dict[str, float] | Record) -> None:
        ordered = {k: record[k] for k in CORE_KEYS if k in record}
        ordered.update({k: v for k, v in record.items() if k not in ordered})
        clean = {k: _json_number(v) for k, v in ordered.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()
        self.records.append(clean)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _json_number(v: float | None) -> float | None:
    # JSON has no NaN/inf; write null so that every line stays parseable.
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def read_metrics(path: Path) -> list[Record]:
    """The records of a ``metrics.jsonl`` file."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _window_mean(records: Sequence[Record], key: str) -> float:
    vals = [v for r in records if (v := r.get(key)) is not None]
    return sum(vals) / len(vals) if vals else math.nan


def summary_table(records: Sequence[Record], *, window: int = 10) -> str:
    """A plain-text table: each core metric averaged over the first and last ``window`` steps."""
    if not records:
        return "no steps finished"
    w = max(1, min(window, len(records) // 2 or 1))
    first, last = records[:w], records[-w:]
    keys = [k for k in CORE_KEYS[1:] if any(r.get(k) is not None for r in records)]
    head = f"steps {_step(records[0])}-{_step(records[w - 1])}"
    tail = f"steps {_step(records[-w])}-{_step(records[-1])}"
    rows = [("metric", head, tail)]
    for k in keys:
        rows.append((k, _fmt(_window_mean(first, k)), _fmt(_window_mean(last, k))))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = []
    for n, r in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
        )
        if n == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    return "\n".join(lines)


def _step(record: Record) -> int:
    return int(record.get("step") or 0)


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "-"
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4f}"
