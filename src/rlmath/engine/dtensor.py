"""DTensor inputs: how a sharded tensor becomes a local call of the engine, and back.

A placement of the vocabulary dim (``Shard(-1)`` of logits, ``Shard(0)`` of an
LM-head weight) over a mesh dimension runs the vocabulary-parallel operation
over that mesh dimension's process group. ``Replicate()`` and the sharding of
batch dims run locally on each rank's block. Results are DTensors on the same
mesh: ``Replicate()`` over the vocabulary's mesh dimension, the inputs'
placement over the others; their gradients flow back to the inputs'
shards. ``Partial`` placements (and the sharding of any other dim) are
refused with a ``TypeError`` that names the placement.

Companion tensors (labels, temperatures, reference logits, a bias) may be
DTensors on the same mesh with matching placements, or plain tensors holding
the global values, of which each rank takes its own block (no communication).

The offsets of uneven shards follow DTensor's ``torch.chunk`` rule: ``n``
entries over ``k`` ranks are cut in pieces of ``ceil(n / k)``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from rlmath.engine.config import VocabShard
from rlmath.engine.groups import group_name

__all__ = ["Layout", "any_dtensor", "is_dtensor", "layout_of", "localize", "wrap"]


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing the module)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


def any_dtensor(*xs: object) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None:
        return False
    cls = mod.DTensor
    for x in xs:
        if isinstance(x, cls):
            return True
    return False


def _placement_types() -> Any:
    import torch.distributed.tensor as dt

    return dt


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``n`` entries cut by ``torch.chunk`` into ``parts``."""
    size = -(-n // parts) if n else 0
    start = min(index * size, n)
    return start, max(0, min(start + size, n) - start)


@dataclass(frozen=True)
class Layout:
    """How the main tensor of a call is laid out over its mesh.

    Attributes:
        mesh: the ``DeviceMesh``.
        shard_dims: for each mesh dim, the (non-negative) dim of the main tensor
            sharded over it, or ``None`` (replicated).
        vocab_mesh_dim: the mesh dim over which the vocabulary is sharded, or ``None``.
        shard: the :class:`VocabShard` of this rank (``None``: whole vocabulary here).
    """

    mesh: Any
    shard_dims: tuple[int | None, ...]
    vocab_mesh_dim: int | None
    shard: VocabShard | None


def layout_of(x: Any, name: str, *, vocab_dim: int, batch_dims: tuple[int, ...]) -> Layout:
    """The :class:`Layout` of DTensor ``x`` (``vocab_dim`` and ``batch_dims`` non-negative).

    Raises:
        TypeError: a placement that cannot be supported (``Partial``, a shard of a
            dim that is neither the vocabulary nor a batch dim, the vocabulary
            sharded over two mesh dims).
    """
    dt = _placement_types()
    mesh, placements = x.device_mesh, tuple(x.placements)
    vocab_mesh_dim = None
    shard_dims: list[int | None] = []
    for i, p in enumerate(placements):
        if isinstance(p, dt.Replicate):
            shard_dims.append(None)
            continue
        if not isinstance(p, dt.Shard):
            raise TypeError(
                f"{name} is a DTensor with placement {p!r} ({placements}), which rlmath does "
                "not support: redistribute it to Replicate() or a Shard of the vocabulary "
                "or batch dims"
            )
        d = p.dim % x.dim()
        if d == vocab_dim:
            if vocab_mesh_dim is not None:
                raise TypeError(
                    f"{name}: the vocabulary is sharded over mesh dims {vocab_mesh_dim} and "
                    f"{i} ({placements}); shard it over one mesh dim"
                )
            vocab_mesh_dim = i
        elif d not in batch_dims:
            raise TypeError(
                f"{name} is a DTensor sharded along dim {d} ({placements}); rlmath supports "
                "Shard of the vocabulary dim, Shard of batch dims, and Replicate()"
            )
        shard_dims.append(d)
    shard = None
    if vocab_mesh_dim is not None:
        vocab = x.shape[vocab_dim]
        start, length = _chunk(
            vocab, mesh.size(vocab_mesh_dim), mesh.get_local_rank(vocab_mesh_dim)
        )
        local = x.to_local().shape[vocab_dim]
        if local != length:
            raise TypeError(
                f"{name}: the local shard has {local} vocabulary columns where DTensor's "
                f"torch.chunk split gives {length}; only such shards are supported"
            )
        # Rank k starts at k · ceil(V / ranks) (torch.chunk): the layout follows from the shape.
        stride = -(-vocab // mesh.size(vocab_mesh_dim))
        shard = VocabShard(
            start=start,
            real=-1,
            group=group_name(mesh.get_group(vocab_mesh_dim)),
            stride=stride,
            total=vocab,
        )
    return Layout(mesh, tuple(shard_dims), vocab_mesh_dim, shard)


def _wanted(layout: Layout, dims: tuple[int, ...]) -> list[Any]:
    """Placements of a tensor whose dim ``j`` follows dim ``dims[j]`` of the main tensor."""
    dt = _placement_types()
    out = []
    for i, d in enumerate(layout.shard_dims):
        if d is not None and i != layout.vocab_mesh_dim and d in dims:
            out.append(dt.Shard(dims.index(d)))
        else:
            out.append(dt.Replicate())
    return out


def localize(t: Any, layout: Layout, name: str, *, dims: tuple[int, ...]) -> Any:
    """This rank's block of companion tensor ``t`` (``None`` and non-tensors pass through).

    ``dims[j]`` is the dim of the main tensor that dim ``j`` of ``t`` follows
    (``-1``: a dim with no counterpart, e.g. K labels, kept whole). A DTensor
    must live on the layout's mesh with the main tensor's sharding of the dims
    it follows and be replicated elsewhere; a plain tensor holds the global
    values (size-1 dims broadcast) and is cut like the main tensor.
    """
    if not isinstance(t, torch.Tensor):
        return t
    dt = _placement_types()
    want = _wanted(layout, dims)
    if is_dtensor(t):
        d: Any = t
        if d.device_mesh != layout.mesh:
            raise TypeError(f"{name} is a DTensor on another device mesh than the main input")
        got = tuple(d.placements)
        for w, g in zip(want, got, strict=True):
            same = (
                isinstance(g, dt.Shard) and g.dim % t.dim() == w.dim
                if isinstance(w, dt.Shard)
                else isinstance(g, dt.Replicate)
            )
            if not same:
                raise TypeError(
                    f"{name} is a DTensor with placements {got}; this call needs "
                    f"{tuple(want)} (the main input's sharding of the dims it follows, "
                    "Replicate() elsewhere)"
                )
        return d.to_local()
    out = t
    for i, w in enumerate(want):
        if isinstance(w, dt.Shard) and out.shape[w.dim] != 1:
            start, length = _chunk(
                out.shape[w.dim], layout.mesh.size(i), layout.mesh.get_local_rank(i)
            )
            out = out.narrow(w.dim, start, length)
    return out


def wrap(
    local: torch.Tensor, layout: Layout, global_shape: tuple[int, ...], dims: tuple[int, ...]
) -> Any:
    """A DTensor of ``global_shape`` on the layout's mesh from this rank's result ``local``.

    ``dims[j]`` is the dim of the main tensor that result dim ``j`` follows; the
    result is replicated over the vocabulary's mesh dim (every rank of it
    holds the same values).
    """
    dt = _placement_types()
    stride = torch.empty(global_shape, device="meta").stride()
    return dt.DTensor.from_local(
        local,
        layout.mesh,
        _wanted(layout, dims),
        run_check=False,
        shape=torch.Size(global_shape),
        stride=stride,
    )
