"""Process-wide options of the verl compatibility layer (set by ``install()``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OPTIONS", "finish_metrics"]


class _Options:
    #: Return metric values as Python floats (verl's type; one host read per value)
    #: instead of detached 0-d tensors.
    float_metrics: bool = False


OPTIONS = _Options()


def finish_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Detached 0-d tensors, or Python floats after ``install(float_metrics=True)``."""
    if OPTIONS.float_metrics:
        return {k: float(v) for k, v in metrics.items()}
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
