"""Process-wide options of the verl compatibility layer (set by ``install()``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["OPTIONS", "finish_metrics", "world_group"]


class _Options:
    #: Return metric values as Python floats, verl's type (a host sync, as verl
    #: does); ``install(float_metrics=False)`` keeps them detached 0-d tensors.
    float_metrics: bool = True


OPTIONS = _Options()


def finish_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Python floats, verl's type, or detached 0-d tensors after ``install(float_metrics=False)``.

    The floats of one dict are read back in one transfer (a host sync, where
    verl syncs once per value); each equals ``float(value)``.
    """
    if OPTIONS.float_metrics:
        tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
        read: dict[str, float] = {}
        if tensors:
            device = next(iter(tensors.values())).device
            stacked = torch.stack(
                [v.detach().reshape(()).to(device, torch.float64) for v in tensors.values()]
            )
            read = dict(zip(tensors, stacked.tolist(), strict=True))
        return {k: read[k] if k in read else float(v) for k, v in metrics.items()}
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def world_group() -> Any:
    """The default process group when ``torch.distributed`` is initialized, else ``None``.

    verl's distributed statistics reduce over the world; rlmath's take the group
    as an argument (``None``: this process only).
    """
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
