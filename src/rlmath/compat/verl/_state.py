"""Process-wide options of the verl compatibility layer (set by ``install()``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["OPTIONS", "finish_metrics", "world_group"]


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


def world_group() -> Any:
    """The default process group when ``torch.distributed`` is initialized, else ``None``.

    verl's distributed statistics reduce over the world; rlmath's take the group
    as an argument (``None``: this process only).
    """
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
