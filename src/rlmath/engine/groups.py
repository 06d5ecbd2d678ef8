"""Process groups by name, and the few collectives the engine runs.

The engine's operators take plain values only, so a process group travels as
its name. :func:`group_name` gives the name when a call is prepared and
:func:`resolve_group` finds the group inside the operator through
``torch.distributed``'s own registry of names (the one its functional
collectives resolve names in), which forgets a group when
``destroy_process_group`` destroys it: rlmath keeps no reference to a group,
so a destroyed group is freed. The empty name is a world of one process: every
collective is then the identity, as is every collective over a group of one
rank or without an initialized ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = [
    "ProcessGroup",
    "all_gather",
    "all_reduce",
    "group_name",
    "group_rank",
    "group_size",
    "is_distributed",
    "resolve_group",
]

ProcessGroup = dist.ProcessGroup


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """True when collectives over ``group`` (``None``: the world) involve more than this process."""
    return _initialized() and dist.get_world_size(group) > 1


def group_size(group: ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (``None``: the world); 1 without ``torch.distributed``."""
    return dist.get_world_size(group) if _initialized() else 1


def group_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (``None``: the world); 0 without ``torch.distributed``."""
    return dist.get_rank(group) if _initialized() else 0


def group_name(group: ProcessGroup | None) -> str:
    """The name an operator receives for ``group`` (``None``: the world group).

    ``""`` when the collectives over it would involve only this process.
    """
    if not is_distributed(group):
        return ""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    return str(pg.group_name)


def resolve_group(name: str) -> ProcessGroup | None:
    """The live group named ``name`` in this process; ``None`` for ``""`` (a world of one).

    Raises:
        RuntimeError: no live group has that name (it was destroyed, or
            created in another process).
    """
    if not name:
        return None
    try:
        # The name's type is a NewType of str in newer torch (GroupName).
        return distributed_c10d._resolve_process_group(cast(Any, name))
    except RuntimeError:
        raise RuntimeError(
            f"process group {name!r} is unknown in this process: it was destroyed "
            "(destroy_process_group) or never created here"
        ) from None


def all_reduce(x: torch.Tensor, op: str, group: ProcessGroup | None) -> torch.Tensor:
    """Out-of-place all-reduce (``"sum"``, ``"max"`` or ``"min"``) of a detached copy.

    ``group=None`` here means a world of one (the identity, no copy): callers
    resolve names with :func:`resolve_group`.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    out = x.detach().clone()
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(out, op=reduce_op[op], group=group)
    return out


def all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on each), stacked in rank order: ``(world, *x.shape)``."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return torch.stack(parts)
