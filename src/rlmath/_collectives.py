"""Thin wrappers over torch.distributed shared by the data-parallel statistics.

``group=None`` means this process alone (no collective), as the ``group``
argument of every public function: pass ``torch.distributed.group.WORLD`` for
every rank. When torch.distributed is not initialized every group is a world
of one process, so code written for several ranks also runs unchanged in a
single process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlmath.engine.groups import ProcessGroup, is_distributed
from rlmath.engine.groups import group_rank as rank
from rlmath.engine.groups import group_size as world_size

__all__ = [
    "ProcessGroup",
    "all_reduce",
    "check_same_dtype",
    "global_sum",
    "is_distributed",
    "rank",
    "world_size",
]

#: The dtypes statistics are computed (and communicated) in; see ``result_dtype``.
_RESULT_DTYPES = (torch.float32, torch.float64)


def _metadata_device(group: ProcessGroup | None, fallback: torch.device) -> torch.device:
    """CPU when the group's backend takes CPU tensors (gloo, MPI): then no device sync."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if "gloo" in backend or "mpi" in backend else fallback


def check_same_dtype(
    name: str,
    values: torch.Tensor,
    dtype: torch.dtype,
    group: ProcessGroup | None,
    extremes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Raise the same ``ValueError`` on every rank unless all ranks compute in ``dtype``.

    Ranks that disagree would all-reduce buffers of different element sizes,
    which crashes gloo (SIGABRT) or corrupts NCCL's result. One all-reduce
    (MAX) of ``[c, −c]`` for the dtype's code ``c`` gives every rank the
    largest and the smallest code; it cannot hang, since every rank makes it
    whatever its dtype. Shapes are not exchanged: they may differ between
    ranks by design, every collective here being on sums. On a gloo or MPI
    group the codes travel in a CPU tensor (no device sync); on an NCCL-only
    group reading them is one host sync.

    ``extremes`` (a local max and the negated local min, 0-d) ride in the
    same MAX all-reduce, in fp64 on the values' device, which holds fp32 and
    fp64 values exactly; the global (max, −min) are returned in ``dtype``.
    """
    if group is None or not is_distributed(group):
        return extremes
    code = float(_RESULT_DTYPES.index(dtype))
    if extremes is None:
        device = _metadata_device(group, values.device)
        buffer = torch.tensor([code, -code], dtype=torch.float64, device=device)
    else:
        codes = torch.tensor([code, -code], dtype=torch.float64, device=values.device)
        buffer = torch.cat([codes, torch.stack(extremes).to(torch.float64)])
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = buffer[:2].tolist()  # host read: a device sync only on a GPU-only group
    if high != -neg_low:
        raise ValueError(
            f"{name} must give the same statistics dtype on every rank of the group: some "
            f"ranks pass float64 {name} (float64 statistics) and others a lower precision "
            f"(float32 statistics); this rank passes {values.dtype}. Cast {name} to one "
            "dtype on every rank."
        )
    if extremes is None:
        return None
    return buffer[2].to(dtype), buffer[3].to(dtype)


def all_reduce(x: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """Out-of-place all-reduce of a detached copy (the input is never modified)."""
    out = x.detach().clone()
    if group is not None and is_distributed(group):
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
    if group is None or not is_distributed(group):
        return x
    return _AllReduceSum.apply(x, group)
