"""Run a computation as a module's ``forward``, so that the hooks around that module run.

Frameworks that shard parameters — FSDP2 (``fully_shard``), DeepSpeed ZeRO-3 —
gather a module's parameters in hooks around ``module(...)`` and register
their backward hooks on its outputs. A fused LM head reads the head's weight
without calling the head; run through :func:`swapped_forward`, it is called
*as* the head, so those hooks gather the weight for it, in forward and in
backward, exactly as for ``head(hidden)``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["swapped_forward"]


@contextlib.contextmanager
def swapped_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``module(...)`` runs ``forward(module, ...)`` instead of its forward.

    Only the instance attribute is set (and removed, or restored, on exit), so
    the module's class and every other instance are untouched. Not meant for
    concurrent calls of the same module from several Python threads.
    """
    had = "forward" in module.__dict__
    old = module.__dict__.get("forward")
    module.__dict__["forward"] = types.MethodType(forward, module)
    try:
        yield
    finally:
        if had:
            module.__dict__["forward"] = old
        else:
            del module.__dict__["forward"]
