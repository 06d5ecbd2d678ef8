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
(MAX) the code of that dtype and its negation (on a gloo or MPI group a CPU
tensor, so this costs no device sync, while on an NCCL-only group reading
them is one host sync per call) and raises the same ``ValueError`` on every
rank when they differ, where the sums themselves would crash gloo (SIGABRT)
or corrupt NCCL's result.

Collectives per call: ``masked_sum`` and ``masked_mean`` 2 (the check, then
one all-reduce of every sum they need), ``masked_var`` and ``masked_whiten``
3 (the second pass adds one), ``distributed_mean_max_min_std`` 3 (the max and
min travel with the check).

Gradients flow as in SyncBatchNorm: when each rank backpropagates its own
share ``L_r`` of a total loss ``Σ_r L_r``, each rank receives the gradient of
that total with respect to its local values, i.e. exactly its slice of the
single-process gradient. Backward is then a collective too (every rank runs it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlmath._validation import check_in_range, check_mask, check_tensor, result_dtype, valid_mask
from rlmath.distributed._collectives import ProcessGroup, global_sum, is_distributed

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
    ranks by design, every collective here being on sums.

    ``extremes`` (a local max and the negated local min, 0-d) ride in the
    same MAX all-reduce, in fp64 on the values' device, which holds fp32 and
    fp64 values exactly; the global (max, −min) are returned in ``dtype``.
    """
    if not is_distributed(group):
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
    """Global (mean, count) of prepared values and weights: one all-reduce of both sums."""
    total, n = global_sum(torch.stack([(v * w).sum(), w.sum()]), group).unbind()
    return total / _nonzero(n), n


def _global_var(
    v: torch.Tensor, w: torch.Tensor, unbiased: bool, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (mean, variance, count) of prepared values and weights: two passes, two sums."""
    mean, n = _global_mean(v, w, group)
    centered = torch.where(w != 0, v - mean, 0)
    sq = global_sum((centered * centered * w).sum(), group)
    if not unbiased:
        return mean, sq / _nonzero(n), n
    return mean, torch.where(n > 1, sq / _nonzero(n - 1), torch.zeros_like(sq)), n


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
    mean, var, _ = _global_var(v, w, True, group)
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
    and ``group`` are additions. Disabled statistics are ``None``. The mean is
    weighted by a non-binary ``mask`` as in ``masked_mean``; max, min and std
    are of the valid (nonzero-mask) elements. With no valid element anywhere
    every statistic is 0 (verl divides by zero). Results are
    detached 0-d tensors (fp32, fp64 for fp64 input).
    Shape: ``local_tensor`` ``(*)``; ``mask`` ``(*)`` or None.
    """
    check_tensor("local_tensor", local_tensor, real=True)
    if mask is None:
        mask = torch.ones_like(local_tensor, dtype=torch.bool)
    check_mask("mask", mask, "local_tensor", local_tensor)
    dtype = result_dtype(local_tensor)
    valid = valid_mask(mask)
    values = local_tensor.detach().to(dtype)
    v = torch.where(valid, values, 0)
    w = torch.where(valid, mask.to(dtype), 0)
    ones = valid.to(dtype)
    if values.numel() == 0:  # amax/amin of an empty tensor raise
        local_max = local_neg_min = values.new_tensor(float("-inf"))
    else:
        local_max = torch.where(valid, values, float("-inf")).amax()
        local_neg_min = torch.where(valid, -values, float("-inf")).amax()
    # Collective 1 (MAX): the dtype check carries the extremes.
    extremes = _check_same_dtype(
        "local_tensor", local_tensor, dtype, group, extremes=(local_max, local_neg_min)
    )
    assert extremes is not None
    # Collective 2: the mask-weighted sums of the mean and the valid count and
    # sum of the std, all at once.
    sums = torch.stack([(v * w).sum(), w.sum(), v.sum(), ones.sum()])
    weighted, weight, total, n = global_sum(sums, group).unbind()
    mean = weighted / _nonzero(weight)
    any_valid = n > 0
    zero = torch.zeros_like(mean)
    vmax = torch.where(any_valid, extremes[0], zero) if compute_max else None
    vmin = torch.where(any_valid, -extremes[1], zero) if compute_min else None
    std = None
    if compute_std:
        # Collective 3: Σ(v − mean)² about the unweighted mean of the valid elements.
        centered = torch.where(valid, v - total / _nonzero(n), 0)
        sq = global_sum((centered * centered).sum(), group)
        std = torch.where(n > 1, sq / _nonzero(n - 1), zero).sqrt()
    return mean, vmax, vmin, std
