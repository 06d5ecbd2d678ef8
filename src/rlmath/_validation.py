"""Argument checks shared by every public function.

Each check raises ``TypeError`` or ``ValueError`` with a message that names the
argument, what was expected and what was received. Tensor checks look at
shapes and dtypes only: none of them reads tensor data, so none of them
synchronizes with an accelerator.

**Scalars.** Wherever a real number is expected, :func:`check_finite_scalar`
(and :func:`check_in_range` on top of it) accepts a Python ``int``/``float``,
any ``numbers.Real`` (numpy scalars such as ``np.float32``), a 0-d numpy
array, or a one-element real tensor; :func:`check_int` does the same for
integers (``numbers.Integral``: ``np.int64``, ...; one-element integer
tensors). ``bool`` is never a number here. The value is returned as a Python
``float``/``int``: a tensor is read once with ``.item()``, which for a tensor
on an accelerator is a host sync. Functions that can keep a tensor scalar on
the device (``compute_rewards``' ``kl_coef``, ``agg_loss``'s global counts)
do so instead and say it in their docstrings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from numbers import Integral, Real
from typing import Any

import torch

__all__ = [
    "check_choice",
    "check_finite_scalar",
    "check_in_range",
    "check_int",
    "check_mask",
    "check_same_shape",
    "check_tensor",
    "result_dtype",
]


def check_tensor(
    name: str, x: object, *, floating: bool = False, real: bool = False
) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is a tensor (floating, or real = not complex, if asked)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if real and x.is_complex():
        raise TypeError(
            f"{name} must be a real (bool, integer or floating) tensor, got dtype {x.dtype}"
        )
    return x


def check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` has exactly the shape of ``ref``."""
    if x.shape != ref.shape:
        raise ValueError(
            f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(x.shape)}"
        )


def check_mask(name: str, mask: object, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """A mask is a bool, integer or floating tensor of exactly ``ref``'s shape."""
    mask = check_tensor(name, mask)
    if mask.is_complex():
        raise TypeError(f"{name} must be bool, integer or floating, got dtype {mask.dtype}")
    check_same_shape(name, mask, ref_name, ref)
    if mask.device != ref.device:
        raise ValueError(f"{name} is on {mask.device} but {ref_name} is on {ref.device}")
    return mask


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    """Raise ``ValueError`` listing the valid names unless ``value`` is one of them."""
    valid: Sequence[str] = sorted(choices)
    if not isinstance(value, str) or value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid values are: {', '.join(valid)}")
    return value


def _scalar_kind(value: object) -> str:
    """``"int"``, ``"real"`` or ``""`` (not a number) for a scalar-like ``value``.

    Python and numpy scalars by their ``numbers`` ABC (``bool`` and
    ``np.bool_`` are not numbers here), 0-d numpy arrays and one-element
    tensors by their dtype.
    """
    if isinstance(value, bool):
        return ""
    if isinstance(value, Integral):
        return "int"
    if isinstance(value, Real):
        return "real"
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            return ""
        return "real" if value.is_floating_point() else "int"
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        kind = getattr(getattr(value, "dtype", None), "kind", "")
        return "int" if kind in "iu" else "real" if kind == "f" else ""
    return ""


def _scalar_value(name: str, value: Any) -> Any:
    """The number held by a scalar-like ``value`` (a tensor is read: a host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a number or a one-element tensor, got a tensor of shape "
                f"{tuple(value.shape)}"
            )
        return value.item()  # a host sync for a tensor on an accelerator
    item = getattr(value, "item", None)  # numpy scalars and 0-d arrays
    return item() if callable(item) else value


def check_finite_scalar(name: str, value: object) -> float:
    """A finite real number, returned as a Python ``float``.

    Accepts Python and numpy scalars (``numbers.Real``, never ``bool``), 0-d
    numpy arrays and one-element real tensors (read with ``.item()``: a host
    sync on an accelerator).
    """
    if not _scalar_kind(value):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    v = float(_scalar_value(name, value))
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """An integer inside ``[low, high]`` (either end optional), returned as a Python ``int``.

    Accepts Python and numpy integers (``numbers.Integral``, never ``bool``),
    0-d integer numpy arrays and one-element integer tensors (read with
    ``.item()``: a host sync on an accelerator). Floats, even integral ones
    such as ``2.0``, are rejected.
    """
    if _scalar_kind(value) != "int":
        raise TypeError(f"{name} must be an int, got {_describe(value)}")
    v = int(_scalar_value(name, value))
    if (low is not None and v < low) or (high is not None and v > high):
        if high is None:
            raise ValueError(f"{name} must be >= {low}, got {v}")
        if low is None:
            raise ValueError(f"{name} must be <= {high}, got {v}")
        raise ValueError(f"{name} must be in [{low}, {high}], got {v}")
    return v


def _describe(value: object) -> str:
    """The type of a rejected value, with the dtype for tensors and arrays."""
    dtype = getattr(value, "dtype", None)
    if isinstance(value, torch.Tensor) or (type(value).__module__ == "numpy" and dtype is not None):
        return f"{type(value).__name__} of dtype {dtype}"
    return type(value).__name__


def check_in_range(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """A finite real number inside ``[low, high]`` (open ends on request)."""
    v = check_finite_scalar(name, value)
    too_low = low is not None and (v < low if low_inclusive else v <= low)
    too_high = high is not None and (v > high if high_inclusive else v >= high)
    if too_low or too_high:
        lo = "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + ("]" if high_inclusive else ")")
        raise ValueError(f"{name} must be in {lo}, {hi}, got {v:g}")
    return v


def result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the dtype of every rlmath result."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
