"""Masked statistics: sum, mean, variance and whitening over valid positions.

Masks are bool or numeric tensors of the values' shape; nonzero = valid. A
non-binary float mask acts as a weight (a frequency weight: ``n = Σ w``).
A position with mask 0 never influences a result or a gradient, even when it
holds NaN or inf, because values are selected with ``torch.where`` before any
arithmetic. NaN on a valid position propagates.

Results are fp32 (fp64 for fp64 inputs) whatever the input dtype, and an empty
mask gives 0, never NaN, in every dtype. ``values`` may be bool, integer or
floating; complex values raise ``TypeError`` (their imaginary part would be
dropped).
"""

from __future__ import annotations

import torch

from rlmath._validation import check_in_range, check_mask, check_tensor, result_dtype, valid_mask

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]

Axis = int | tuple[int, ...] | None


def _prepare(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid values (0 elsewhere) and weights (0 elsewhere), both in the result dtype."""
    check_tensor("values", values, real=True)
    check_mask("mask", mask, "values", values)
    dtype = result_dtype(values)
    valid = valid_mask(mask)
    weights = torch.where(valid, mask.to(dtype), 0)
    return torch.where(valid, values.to(dtype), 0), weights


def _sum(x: torch.Tensor, axis: Axis, keepdim: bool = False) -> torch.Tensor:
    return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdim)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where den == 0 (num is 0 there too)."""
    return num / torch.where(den == 0, torch.ones_like(den), den)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """Σ mask·values over valid positions.

    Shape: ``values`` and ``mask`` ``(*)`` (same shape); result ``()`` if ``axis``
    is None, else ``values`` reduced over ``axis``. Dtype: fp32 (fp64 for fp64).
    """
    v, w = _prepare(values, mask)
    return _sum(v * w, axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: Axis = None) -> torch.Tensor:
    """Σ mask·values / Σ mask, and 0 where the mask is empty.

    Shape: ``values`` and ``mask`` ``(*)``; result reduced over ``axis`` (all
    dimensions when None). Dtype: fp32 (fp64 for fp64 inputs).
    """
    v, w = _prepare(values, mask)
    return _safe_div(_sum(v * w, axis), _sum(w, axis))


def _moments(
    v: torch.Tensor, w: torch.Tensor, axis: Axis, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean (kept dims) and variance (reduced) of prepared values and weights."""
    n = _sum(w, axis, keepdim=True)
    mean = _safe_div(_sum(v * w, axis, keepdim=True), n)
    centered = torch.where(w != 0, v - mean, 0)
    sq = _sum(centered * centered * w, axis)
    n = n.reshape(sq.shape)
    if not unbiased:
        return mean, _safe_div(sq, n)
    return mean, torch.where(n > 1, _safe_div(sq, n - 1), torch.zeros_like(sq))


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, axis: Axis = None
) -> torch.Tensor:
    """Variance of the valid values, two-pass (mean first) for accuracy.

    With ``unbiased=True`` the result is scaled by ``n / (n - 1)`` (Bessel), and
    where ``n <= 1`` the variance is defined as 0 (verl raises instead).
    Shape: ``values`` and ``mask`` ``(*)``; result reduced over ``axis``.
    Dtype: fp32 (fp64 for fp64 inputs).
    """
    v, w = _prepare(values, mask)
    return _moments(v, w, axis, unbiased)[1]


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    *,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(values − mean) / sqrt(var + eps)`` with masked mean and unbiased variance.

    ``shift_mean=False`` adds the mean back after scaling (as verl and TRL do).
    Unlike verl, masked positions are exactly 0 in the result.
    Shape: ``values`` and ``mask`` ``(*)``; result ``(*)``.
    Dtype: fp32 (fp64 for fp64 inputs).
    """
    eps = check_in_range("eps", eps, 0.0, None, low_inclusive=False)
    v, w = _prepare(values, mask)
    mean, var = _moments(v, w, None, unbiased=True)
    whitened = (v - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(w != 0, whitened, 0)
