"""Argument checks shared by every public function.

Each check raises ``TypeError`` or ``ValueError`` with a message that names the
argument, what was expected and what was received. Checks look at shapes,
dtypes and Python scalars only: none of them reads tensor data, so none of them
synchronizes with an accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "check_choice",
    "check_finite_scalar",
    "check_in_range",
    "check_mask",
    "check_same_shape",
    "check_tensor",
    "result_dtype",
]


def check_tensor(name: str, x: object, *, floating: bool = False) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is a tensor (a floating one if asked)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
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


def check_finite_scalar(name: str, value: object) -> float:
    """A Python (or 0-d tensor-free) real number that is finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


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
