"""Masked statistics over a data-parallel group.

Each function equals the single-process function of ``rlmath.masked`` applied
to the concatenation of every rank's ``values`` and ``mask``. Variance is two
passes (global mean first, then the global sum of squared deviations), which
is as accurate as the single-process version; the sums travel in fp32 (fp64
for fp64 inputs). Every rank joins every collective, including a rank with no
valid element, so nothing hangs; if no rank has a valid element the results
are 0 like the single-process functions.

Every rank must pass ``values`` that give the same statistics dtype (fp64
for fp64 values, fp32 for every other dtype): each call first all-reduces
two int64 codes of that dtype (the only extra collective; on a gloo or MPI
group the codes are a CPU tensor, so this costs no device sync, while on an
NCCL-only group reading them is one host sync per call) and raises the same
``ValueError`` on every rank when they differ, where the sums themselves
would crash gloo (SIGABRT) or corrupt NCCL's result.

Gradients flow as in SyncBatchNorm: when each rank backpropagates its own
share ``L_r`` of a total loss ``Σ_r L_r``, each rank receives the gradient of
that total with respect to its local values, i.e. exactly its slice of the
single-process gradient. Backward is then a collective too (every rank runs it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmath._validation import check_in_range, check_mask, check_tensor, result_dtype, valid_mask
from rlmath.distributed._collectives import ProcessGroup, all_reduce, global_sum, is_distributed

__all__ = [
    "distributed_mean_max_min_std",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


#: The dtypes statistics are computed (and communicated) in; see ``result_dtype``.
_RESULT_DTYPES = (torch.float32, torch.float64)


def _metadata_device(group: ProcessGroup | None, fallback: torch.device) -> torch.device:
    """CPU when the group's backend takes CPU tensors (gloo, MPI): then no device sync."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if "gloo" in backend or "mpi" in backend else fallback


def _check_same_dtype(
    name: str, values: torch.Tensor, dtype: torch.dtype, group: ProcessGroup | None
) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks compute in ``dtype``.

    Ranks that disagree would all-reduce buffers of different element sizes,
    which crashes gloo (SIGABRT) or corrupts NCCL's result. One all-reduce
    (MAX) of two int64 codes, ``[c, −c]``, gives every rank the largest and
    the smallest code; it cannot hang, since every rank makes it whatever
    its dtype. Shapes are not exchanged: they may differ between ranks by
    design, every collective here being on 0-d sums.
    """
    if not is_distributed(group):
        return
    code = _RESULT_DTYPES.index(dtype)
    codes = torch.tensor([code, -code], dtype=torch.int64)
    codes = codes.to(_metadata_device(group, values.device))
    dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = codes.tolist()  # host read: a device sync only for a GPU-only backend
    if high != -neg_low:
        raise ValueError(
            f"{name} must give the same statistics dtype on every rank of the group: some "
            f"ranks pass float64 {name} (float64 statistics) and others a lower precision "
            f"(float32 statistics); this rank passes {values.dtype}. Cast {name} to one "
            "dtype on every rank."
        )


def _prepare(
    values: torch.Tensor,
    mask: torch.Tensor,
    group: ProcessGroup | None,
    name: str = "values",
) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor(name, values, real=True)
    check_mask("mask", mask, name, values)
    dtype = result_dtype(values)
    _check_same_dtype(name, values, dtype, group)
    valid = valid_mask(mask)
    return torch.where(valid, values.to(dtype), 0), torch.where(valid, mask.to(dtype), 0)


def _nonzero(n: torch.Tensor) -> torch.Tensor:
    return torch.where(n == 0, torch.ones_like(n), n)


def _global_mean(
    v: torch.Tensor, w: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    n = all_reduce(w.sum(), "sum", group)
    total = global_sum((v * w).sum(), group)
    return total / _nonzero(n), n


def _global_var(
    v: torch.Tensor, w: torch.Tensor, unbiased: bool, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global mean and variance of prepared values and weights (two passes)."""
    mean, n = _global_mean(v, w, group)
    centered = torch.where(w != 0, v - mean, 0)
    sq = global_sum((centered * centered * w).sum(), group)
    if not unbiased:
        return mean, sq / _nonzero(n)
    return mean, torch.where(n > 1, sq / _nonzero(n - 1), torch.zeros_like(sq))


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, *, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Σ mask·values over every rank of ``group``.

    Shape: ``values``, ``mask`` ``(*)`` (local, any shape per rank); result ``()``.
    """
    v, w = _prepare(values, mask, group)
    return global_sum((v * w).sum(), group)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, *, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Global masked mean over every rank of ``group``; 0 if all masks are empty.

    Shape: ``values``, ``mask`` ``(*)``; result ``()``. Dtype fp32 (fp64 for fp64).
    """
    v, w = _prepare(values, mask, group)
    return _global_mean(v, w, group)[0]


def masked_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    unbiased: bool = True,
    *,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Global masked variance; with ``unbiased`` and a global count ≤ 1 it is 0.

    Shape: ``values``, ``mask`` ``(*)``; result ``()``. Dtype fp32 (fp64 for fp64).
    """
    v, w = _prepare(values, mask, group)
    return _global_var(v, w, unbiased, group)[1]


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    eps: float = 1e-8,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Whiten with the global masked mean and unbiased variance; masked positions 0.

    Shape: ``values``, ``mask`` ``(*)``; result ``(*)``. Dtype fp32 (fp64 for fp64).
    """
    eps = check_in_range("eps", eps, 0.0, None, low_inclusive=False)
    v, w = _prepare(values, mask, group)
    mean, var = _global_var(v, w, True, group)
    whitened = (v - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(w != 0, whitened, 0)


def distributed_mean_max_min_std(
    local_tensor: torch.Tensor,
    compute_max: bool = True,
    compute_min: bool = True,
    compute_std: bool = True,
    *,
    mask: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Global (mean, max, min, unbiased std) of the valid elements, for logging.

    Same positional arguments as verl's function; ``mask`` (default: all valid)
    and ``group`` are additions. Disabled statistics are ``None``. With no valid
    element anywhere every statistic is 0 (verl divides by zero). Results are
    detached 0-d tensors (fp32, fp64 for fp64 input).
    Shape: ``local_tensor`` ``(*)``; ``mask`` ``(*)`` or None.
    """
    check_tensor("local_tensor", local_tensor, real=True)
    if mask is None:
        mask = torch.ones_like(local_tensor, dtype=torch.bool)
    v, w = _prepare(local_tensor.detach(), mask, group, "local_tensor")
    mean, n = _global_mean(v, w, group)
    valid = w != 0
    any_valid = n > 0

    def extreme(op: str, fill: float) -> torch.Tensor:
        filled = torch.where(valid, v, fill)
        if filled.numel() == 0:  # amax/amin of an empty tensor raise
            local = v.new_tensor(fill)
        else:
            local = filled.amax() if op == "max" else filled.amin()
        out = all_reduce(local, op, group)
        return torch.where(any_valid, out, torch.zeros_like(out))

    vmax = extreme("max", float("-inf")) if compute_max else None
    vmin = extreme("min", float("inf")) if compute_min else None
    std = _global_var(v, valid.to(v.dtype), True, group)[1].sqrt() if compute_std else None
    return mean, vmax, vmin, std
