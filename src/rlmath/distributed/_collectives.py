"""Thin wrappers over torch.distributed shared by the data- and vocab-parallel code.

``group=None`` means the default (world) group. When torch.distributed is not
initialized every function behaves as a world of one process, so code written
for several ranks also runs unchanged in a single process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlmath.engine.groups import ProcessGroup, is_distributed
from rlmath.engine.groups import group_rank as rank
from rlmath.engine.groups import group_size as world_size

__all__ = ["ProcessGroup", "all_reduce", "global_sum", "is_distributed", "rank", "world_size"]


def all_reduce(x: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """Out-of-place all-reduce of a detached copy (the input is never modified)."""
    out = x.detach().clone()
    if is_distributed(group):
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(out, op=reduce_op[op], group=group)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Σ over ranks; backward is Σ over ranks of the incoming gradients.

    This is the adjoint of a sum whose result every rank uses: rank r's loss
    L_r depends on every rank's input through it, so the gradient reaching a
    local input is Σ_r ∂L_r/∂(sum) (as in SyncBatchNorm).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, "sum", ctx.group), None


def global_sum(x: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable Σ over the ranks of ``group`` (identity in a single process).

    Backward is a collective: every rank must run it. If each rank backpropagates
    its own share L_r of a total loss Σ_r L_r, each receives ∂(Σ_r L_r)/∂x_local,
    the gradient of the whole batch in one process.
    """
    if not is_distributed(group):
        return x
    return _AllReduceSum.apply(x, group)
