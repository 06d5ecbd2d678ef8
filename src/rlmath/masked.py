"""Masked statistics: sum, mean, variance and whitening over valid positions, in one process or over ranks.

Masks are bool or numeric tensors of the values' shape; nonzero = valid. A
non-binary float mask acts as a weight (a frequency weight: ``n = Σ w``).
A position with mask 0 never influences a result or a gradient, even when it
holds NaN or inf, because values are selected with ``torch.where`` before any
arithmetic. NaN on a valid position propagates.

Results are fp32 (fp64 for fp64 inputs) whatever the input dtype, and an empty
mask gives 0, never NaN, in every dtype. ``values`` may be bool, integer or
floating; complex values raise ``TypeError`` (their imaginary part would be
dropped).

``group=``: the statistics of the values and masks of every rank of a
process group (data parallelism), equal to the one-process statistics of
their concatenation; every rank must call. Variance is two passes (the global
mean first, then the global sum of squared deviations), as accurate as in one
process; the sums travel in fp32 (fp64 for fp64 inputs). A rank without a
valid element (or without any element) joins every collective, so nothing
hangs. Every rank must pass values that give the same statistics dtype: a
first collective checks it and raises the same ``ValueError`` on every rank
(ranks that disagree would crash gloo or corrupt NCCL's result). Collectives
per call: 2 for ``masked_sum`` and ``masked_mean``, 3 for ``masked_var`` and
``masked_whiten``. Gradients flow as in SyncBatchNorm: when each rank
backpropagates its own share ``L_r`` of a total loss ``Σ_r L_r``, each rank
receives exactly its slice of the one-process gradient (backward is then a
collective too). Without an initialized ``torch.distributed`` a group is a
world of one.
"""

from __future__ import annotations

import torch

from rlmath._collectives import ProcessGroup, check_same_dtype, global_sum
from rlmath._valid_select import where_valid
from rlmath._validation import (
    as_dtype,
    check_in_range,
    check_mask,
    check_tensor,
    result_dtype,
    valid_mask,
)

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]

Axis = int | tuple[int, ...] | None


def _prepare(
    values: torch.Tensor, mask: torch.Tensor, axis: Axis, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Valid values (0 elsewhere), the bool mask and the weights (``None``: a bool mask).

    Everything in the result dtype; with a ``group``, checks that every rank
    computes in the same dtype (one collective).
    """
    check_tensor("values", values, real=True)
    check_mask("mask", mask, "values", values)
    if group is not None and axis is not None:
        raise ValueError(
            f"axis={axis} with group=: statistics over a process group are over every "
            "element of every rank (axis=None)"
        )
    dtype = result_dtype(values)
    if group is not None:
        check_same_dtype("values", values, dtype, group)
    valid = valid_mask(mask)
    weights = None if mask.dtype == torch.bool else where_valid(valid, mask.to(dtype))
    return where_valid(valid, as_dtype(values, dtype)), valid, weights


def _sum(x: torch.Tensor, axis: Axis, keepdim: bool = False) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdim)


def _count(valid: torch.Tensor, weights: torch.Tensor | None, axis: Axis, dtype: torch.dtype):
    """``Σ w`` (the number of valid positions for a bool mask), kept dims, in ``dtype``."""
    if weights is not None:
        return _sum(weights, axis, keepdim=True)
    if axis is None:
        return torch.count_nonzero(valid).to(dtype).reshape([1] * valid.dim())
    return _sum(valid, axis, keepdim=True).to(dtype)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (num is 0 there too)."""
    return num / torch.where(den == 0, torch.ones_like(den), den)


def _sums(
    v: torch.Tensor,
    valid: torch.Tensor,
    w: torch.Tensor | None,
    axis: Axis,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ w·v, Σ w)`` with kept dims; over a group, one all-reduce of both."""
    total = _sum(v if w is None else v * w, axis, keepdim=True)
    n = _count(valid, w, axis, v.dtype)
    if group is not None:
        total, n = global_sum(torch.stack([total.reshape(()), n.reshape(())]), group).unbind()
        total, n = total.reshape(n.shape), n
    return total, n


def _moments(
    v: torch.Tensor,
    valid: torch.Tensor,
    w: torch.Tensor | None,
    axis: Axis,
    unbiased: bool,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean (kept dims), variance (kept dims) and the centered values (0 at masked positions)."""
    total, n = _sums(v, valid, w, axis, group)
    mean = _safe_div(total, n)
    centered = torch.where(valid, v - mean, 0)
    square = centered * centered
    sq = _sum(square if w is None else square * w, axis, keepdim=True)
    if group is not None:
        sq = global_sum(sq.reshape(()), group)
    if not unbiased:
        return mean, _safe_div(sq, n), centered
    var = torch.where(n > 1, _safe_div(sq, n - 1), torch.zeros_like(sq))
    return mean, var, centered


def _reduced(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """A kept-dims statistic with the reduced dims dropped."""
    if axis is None:
        return x.reshape(())
    return x.squeeze(axis)


def masked_sum(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    axis: Axis = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``Σ mask·values`` over valid positions (and over the ranks of ``group``).

    Shape: ``values`` and ``mask`` ``(*)`` (same shape); result ``()`` if ``axis``
    is None, else ``values`` reduced over ``axis``. Dtype: fp32 (fp64 for fp64).
    """
    v, valid, w = _prepare(values, mask, axis, group)
    total = _sum(v if w is None else v * w, axis)
    return global_sum(total, group) if group is not None else total


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    axis: Axis = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``Σ mask·values / Σ mask``, and 0 where the mask is empty (over ``group``'s ranks too).

    Shape: ``values`` and ``mask`` ``(*)``; result reduced over ``axis`` (all
    dimensions when None). Dtype: fp32 (fp64 for fp64 inputs).
    """
    v, valid, w = _prepare(values, mask, axis, group)
    if group is None and axis is None:
        if w is None:
            # Floating sum over an integer count: the count is rounded to v's dtype in the division.
            return v.sum() / torch.count_nonzero(valid).clamp_min(1)
        n = w.sum()
        return (v * w).sum() / torch.where(n == 0, torch.ones_like(n), n)
    total, n = _sums(v, valid, w, axis, group)
    return _reduced(_safe_div(total, n), axis)


def masked_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    unbiased: bool = True,
    axis: Axis = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Variance of the valid values, two-pass (mean first) for accuracy.

    With ``unbiased=True`` the result is scaled by ``n / (n - 1)`` (Bessel), and
    where ``n <= 1`` the variance is defined as 0 (verl raises instead).
    Shape: ``values`` and ``mask`` ``(*)``; result reduced over ``axis``.
    Dtype: fp32 (fp64 for fp64 inputs).
    """
    v, valid, w = _prepare(values, mask, axis, group)
    return _reduced(_moments(v, valid, w, axis, unbiased, group)[1], axis)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``(values − mean) / sqrt(var + eps)`` with masked mean and unbiased variance.

    The statistics are over every valid element (of every rank of ``group``).
    ``shift_mean=False`` adds the mean back after scaling (as verl and TRL do).
    Unlike verl, masked positions are exactly 0 in the result.
    Shape: ``values`` and ``mask`` ``(*)``; result ``(*)``.
    Dtype: fp32 (fp64 for fp64 inputs).
    """
    eps = check_in_range("eps", eps, 0.0, None, low_inclusive=False)
    v, valid, w = _prepare(values, mask, None, group)
    mean, var, centered = _moments(v, valid, w, None, True, group)
    # centered is 0 at masked positions, and so is the whitened value.
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = torch.where(valid, whitened + mean, 0)
    return whitened
