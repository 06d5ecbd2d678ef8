"""How a demo run is laid out over processes: data-parallel × tensor-parallel ranks.

``world = dp × tp`` processes. Rank ``r`` is data-parallel rank ``r // tp`` and
tensor-parallel rank ``r % tp`` (tensor parallelism innermost, as Megatron
orders it). The ranks of one tensor-parallel group hold the same prompts and
each owns a slice of the LM head's vocabulary; the ranks of one data-parallel
group hold the same vocabulary slice and different prompts.

A world of one process is the ordinary single-process run: every reduction
here is then the identity, so the trainers have one code path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "Layout",
    "LayoutError",
    "check_layout",
    "current_layout",
    "full_tensor",
    "prompt_shard",
    "rows_per_step",
    "world_from_env",
]


class LayoutError(ValueError):
    """The requested processes cannot split the run: raised before any work."""


def rows_per_step(algo: str, batch_size: int, group_size: int) -> int:
    """Rollout rows per step: prompts (PPO) or prompts × group size (GRPO)."""
    return batch_size * (group_size if algo == "grpo" else 1)


def check_layout(
    *,
    world_size: int,
    tp: int,
    batch_size: int,
    vocab_size: int,
    fsdp: bool,
) -> None:
    """Raise :class:`LayoutError` unless ``world_size`` processes can run this config.

    Prompts are split evenly over the data-parallel ranks (a GRPO group stays
    on one rank), so ``batch_size`` must be a multiple of ``world_size / tp``;
    the LM head's vocabulary is split evenly over the ``tp`` ranks of a
    tensor-parallel group.
    """
    if tp > world_size:
        raise LayoutError(f"--tp {tp} is larger than the number of processes ({world_size})")
    if world_size % tp:
        raise LayoutError(
            f"--tp {tp} does not divide the number of processes ({world_size}): every "
            "data-parallel rank needs a whole tensor-parallel group"
        )
    if vocab_size % tp:
        raise LayoutError(
            f"--tp {tp} does not divide the vocabulary ({vocab_size} tokens): each "
            "tensor-parallel rank holds an equal slice of the LM head"
        )
    dp = world_size // tp
    if dp > batch_size:
        raise LayoutError(
            f"{dp} data-parallel ranks but only {batch_size} prompts per step (--batch-size): "
            "every rank needs at least one prompt"
        )
    if batch_size % dp:
        raise LayoutError(
            f"--batch-size {batch_size} is not divisible by the {dp} data-parallel ranks "
            f"({world_size} processes / --tp {tp}): each rank takes an equal share of the prompts"
        )
    if fsdp and world_size < 2:
        raise LayoutError(
            "--fsdp shards the model over data-parallel ranks: start several processes "
            "(--nproc N, or torchrun --nproc-per-node N)"
        )


def world_from_env() -> int | None:
    """``WORLD_SIZE`` when the process was started by torchrun (or a launcher like it), else None."""
    value = os.environ.get("WORLD_SIZE")
    if value is None or "RANK" not in os.environ:
        return None
    return int(value)


def prompt_shard(batch_size: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """The prompts ``[start, stop)`` of the global batch that data-parallel rank ``dp_rank`` takes."""
    share = batch_size // dp_size
    return dp_rank * share, (dp_rank + 1) * share


@dataclass(frozen=True)
class Layout:
    """This process's place in the run, and its process groups (``None`` in one process).

    A layout is shared, never copied: a model that keeps a reference to it
    (the vocabulary-parallel head) keeps it through ``copy.deepcopy``.
    """

    rank: int = 0
    world_size: int = 1
    tp: int = 1
    dp_group: Any = None
    tp_group: Any = None
    #: The data-parallel DeviceMesh, for FSDP2's ``fully_shard`` (None in one process).
    dp_mesh: Any = None

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the outputs and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def __deepcopy__(self, memo: dict[int, Any]) -> Layout:
        return self

    def dp_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the data-parallel ranks (one all-reduce; a copy in one process)."""
        out = values.clone()
        if self.dp > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.dp_group)
        return out

    def statistics_group(self) -> Any:
        """The group to give rlmath's data-parallel statistics: ``None`` without data parallelism."""
        return self.dp_group if self.dp > 1 else None

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wrap(self, module: nn.Module, *, fsdp: bool) -> nn.Module:
        """``module`` made data-parallel: DDP over the data-parallel group, or FSDP2.

        Either way the gradient each rank sees after ``backward`` is the mean
        over the data-parallel ranks (FSDP2: its shard of that mean), which the
        losses' ``dp_size`` factor turns into the full-batch gradient. Without
        data parallelism (and without ``fsdp``) the module is returned as is.
        """
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=self.dp_mesh)
            return module
        if self.dp == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        # Every trainable parameter takes part in every backward (the critic's
        # unused LM head is frozen), so DDP needs no search for unused ones.
        return DistributedDataParallel(module, process_group=self.dp_group)


def current_layout(tp: int, device: torch.device) -> Layout:
    """The layout of the initialized default process group, or of one process."""
    if not (dist.is_available() and dist.is_initialized()):
        if tp != 1:
            raise LayoutError(f"--tp {tp} needs {tp} processes or more (--nproc N)")
        return Layout()
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Layout(
        rank=dist.get_rank(),
        world_size=world,
        tp=tp,
        dp_group=mesh.get_group("dp"),
        tp_group=mesh.get_group("tp"),
        dp_mesh=mesh["dp"],
    )


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP2's gradient norm), a plain tensor as is."""
    to_full: Callable[[], torch.Tensor] | None = getattr(value, "full_tensor", None)
    return to_full() if to_full is not None else value
