"""A truncating sampler's kept set in the Triton passes: which columns of a block count.

The kept set of a row is described to a kernel in one of three ways (a
``KEEP_MODE`` constexpr; 0 is no kept set and compiles the plain kernels):

- ``KEEP_TAU`` (1): a threshold ``tau`` per row, the kept set is
  ``z >= tau`` with ``z = x / T`` rounded as the threshold search rounds it
  (:func:`rlmath.engine.sampling.scaled_rows`: one correctly rounded division
  in fp32), so that the kernels keep exactly the tokens the search counted;
- ``KEEP_MASK`` (2): a replayed ``(M, V)`` bool mask, read a byte per column;
- ``KEEP_IDS`` (3): replayed token ids, sorted per row on the host, with the
  range of ids that falls in each block of columns (one ``searchsorted``), so
  a block compares its columns with only its own ids.

In every mode each row's valid labels are added to its kept set (a label the
rule leaves out is scored as if kept, as in the pure-torch backend).

The thresholds themselves (and the kept-set sizes) come from the pure-torch
search (:meth:`rlmath.engine.sampling.KeptSet.chunk`, run chunk by chunk on
the logits' device: :func:`rlmath.engine.torch_backend.logits_forward.kept_thresholds`),
or over vocabulary shards from
:func:`rlmath.engine.torch_backend.kept_shards.sharded_thresholds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from rlmath.engine.triton_backend.row_math import merge_block

if TYPE_CHECKING:
    from rlmath.engine.sampling import KeptSet

__all__ = [
    "KEEP_IDS",
    "KEEP_MASK",
    "KEEP_NONE",
    "KEEP_TAU",
    "KeptArgs",
    "kept_args",
    "kept_block",
    "kept_row_stats",
    "scaled",
    "temperature_value",
]

KEEP_NONE, KEEP_TAU, KEEP_MASK, KEEP_IDS = 0, 1, 2, 3


@triton.jit
def scaled(x, T, TEMP_MODE: tl.constexpr):
    """``x / T`` correctly rounded (the kept-set search's rounding of the scaled logits)."""
    if TEMP_MODE != 0:
        x = tl.math.div_rn(x, T)
    return x


@triton.jit
def kept_block(
    z,
    c,
    idx,
    TAU,
    MASK,
    mask_stride,
    IDS,
    ids_stride,
    BOUNDS,
    bounds_stride,
    block_index,
    ADD,
    K,
    n,
    KEEP_MODE: tl.constexpr,
):
    """Whether each column ``c`` of one block of row ``idx`` is in its kept set (labels added).

    ``z``: the block's scaled logits; ``n``: the row's real columns.
    """
    if KEEP_MODE == 1:
        keep = z >= tl.load(TAU + idx)
    elif KEEP_MODE == 2:
        keep = tl.load(MASK + idx * mask_stride + c, mask=c < n, other=0) != 0
    else:
        keep = c < 0
        lo = tl.load(BOUNDS + idx * bounds_stride + block_index)
        hi = tl.load(BOUNDS + idx * bounds_stride + block_index + 1)
        for j in range(lo, hi):
            keep = keep | (c == tl.load(IDS + idx * ids_stride + j))
    for k in range(0, K):
        keep = keep | (c == tl.load(ADD + idx * K + k))
    return keep


def temperature_value(temperature: torch.Tensor | float | None) -> float:
    """The scalar ``T`` a kept-set kernel divides by (per-row temperatures are read from their
    tensor; 1.0 when there is none)."""
    if isinstance(temperature, torch.Tensor) or temperature is None:
        return 1.0
    return float(temperature)


@dataclass
class KeptArgs:
    """The kernel arguments of a kept set (``like`` stands in for unused pointers)."""

    mode: int
    tau: torch.Tensor
    mask: torch.Tensor
    mask_stride: int
    ids: torch.Tensor
    ids_stride: int
    bounds: torch.Tensor
    bounds_stride: int
    add: torch.Tensor
    K: int

    def kernel_args(self) -> tuple[torch.Tensor | int, ...]:
        """The positional kernel arguments ``TAU, MASK, mask_stride, IDS, ids_stride, BOUNDS,
        bounds_stride, ADD, K``, in the order :func:`kept_block` takes them."""
        return (self.tau, self.mask, self.mask_stride, self.ids, self.ids_stride, self.bounds,
                self.bounds_stride, self.add, self.K)  # fmt: skip


def kept_args(
    restrict: KeptSet | None,
    like: torch.Tensor,
    block: int,
    width: int,
) -> KeptArgs:
    """The :class:`KeptArgs` of ``restrict`` for kernels that step ``block`` columns over ``width``.

    Its thresholds must be found already (``restrict.tau``). Replayed ids are
    sorted per row and located per block here (``(M, K')`` and
    ``(M, ceil(width / block) + 1)`` integers).
    """
    if restrict is None:
        return KeptArgs(KEEP_NONE, like, like, 0, like, 0, like, 0, like, 0)
    tau, mask, ids, bounds = like, like, like, like
    mask_stride = ids_stride = bounds_stride = 0
    kept = restrict.kept
    if kept is None:
        mode = KEEP_TAU
        tau = restrict.tau.to(torch.float32).contiguous()
    elif kept.dtype == torch.bool:
        mode = KEEP_MASK
        if kept.shape[-1] and kept.stride(-1) != 1:
            kept = kept.contiguous()
        mask = kept.view(torch.uint8) if kept.numel() else kept.to(torch.uint8)
        mask_stride = mask.stride(0) if mask.dim() == 2 else 0
    else:
        mode = KEEP_IDS
        ids = kept.sort(-1).values.contiguous()  # -1 (padding) first: below every block
        ids_stride = ids.shape[-1]
        starts = torch.arange(0, width + block, block, device=ids.device, dtype=ids.dtype)
        bounds = torch.searchsorted(ids, starts.expand(ids.shape[0], -1).contiguous())
        bounds = bounds.to(torch.int32).contiguous()
        bounds_stride = bounds.shape[-1]
    add, K = like, 0
    if restrict.labels is not None and restrict.owned is not None:
        add = torch.where(restrict.owned, restrict.labels, -1).contiguous()
        K = add.shape[-1]
    return KeptArgs(mode, tau, mask, mask_stride, ids, ids_stride, bounds, bounds_stride, add, K)


@triton.jit
def kept_row_stats(
    ptr,
    col_stride,
    n,
    n_load,
    T,
    idx,
    TAU,
    MASK,
    mask_stride,
    IDS,
    ids_stride,
    BOUNDS,
    bounds_stride,
    ADD,
    K,
    TEMP_MODE: tl.constexpr,
    KEEP_MODE: tl.constexpr,
    WANT_T: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """:func:`~.row_math.row_stats` of row ``idx`` restricted to its kept set (others ``-inf``)."""
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([1], float("-inf"), tl.float32), 0)
    s_vec = tl.zeros([BLOCK], tl.float32)
    t_vec = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        c = start + cols
        x = tl.load(ptr + c * col_stride, mask=c < n_load, other=float("-inf")).to(tl.float32)
        if PAD:
            x = tl.where(c < n, x, float("-inf"))
        z = scaled(x, T, TEMP_MODE)
        keep = kept_block(
            z, c, idx, TAU, MASK, mask_stride, IDS, ids_stride, BOUNDS, bounds_stride,
            start // BLOCK, ADD, K, n, KEEP_MODE,
        )  # fmt: skip
        z = tl.where(keep, z, float("-inf"))
        m, s_vec, t_vec = merge_block(z, m, s_vec, t_vec, WANT_T)
    return m, tl.sum(s_vec, 0), tl.sum(t_vec, 0)
