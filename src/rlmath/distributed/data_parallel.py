"""Logging statistics over a data-parallel group.

The masked statistics take ``group=`` themselves (:mod:`rlmath.masked`):
``rlmath.masked_mean(values, mask, group=g)`` and so on. This module holds
:func:`distributed_mean_max_min_std`, verl's logging summary of a tensor
spread over ranks.
"""

from __future__ import annotations

import torch

from rlmath._collectives import ProcessGroup, check_same_dtype, global_sum
from rlmath._validation import check_mask, check_tensor, result_dtype, valid_mask

__all__ = ["distributed_mean_max_min_std"]


def _nonzero(n: torch.Tensor) -> torch.Tensor:
    return torch.where(n == 0, torch.ones_like(n), n)


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
    and ``group`` (the process group to reduce over, ``None``: this process
    alone; verl's reduces over the world group, which
    ``torch.distributed.group.WORLD`` gives) are additions. Disabled statistics are ``None``. The mean is
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
    extremes = check_same_dtype(
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
