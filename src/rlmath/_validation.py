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
    "as_dtype",
    "check_choice",
    "check_finite_scalar",
    "check_in_range",
    "check_index_tensor",
    "check_int",
    "check_label_values",
    "check_labels",
    "check_logits",
    "check_mask",
    "check_optional_int",
    "check_positive_int_or_none",
    "check_same_shape",
    "check_temperature",
    "check_tensor",
    "is_finite",
    "result_dtype",
    "valid_mask",
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


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """The bool "valid" view of a checked mask: ``mask`` itself if bool, else ``mask != 0``.

    As a conversion to bool (the same values, NaN included): on a CPU a comparison
    into a bool tensor costs two to three times the conversion.
    """
    return mask if mask.dtype == torch.bool else mask.to(torch.bool)


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    """Raise ``ValueError`` listing the valid names unless ``value`` is one of them."""
    if isinstance(value, str) and value in choices:
        return value
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
    # Sizes and numbers that torch.compile traces symbolically (dynamic=True).
    if isinstance(value, torch.SymInt):
        return "int"
    if isinstance(value, torch.SymFloat):
        return "real"
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
    if type(value).__module__ == "numpy":  # numpy scalars and 0-d arrays
        return value.item()
    return value  # Python numbers, numbers.Real types, torch.SymInt / torch.SymFloat


def is_finite(v: Any) -> bool:
    """``math.isfinite`` for a Python number, also traceable on a symbolic one.

    NaN fails both comparisons, so this equals ``math.isfinite`` on every float.
    """
    return -math.inf < v < math.inf


def check_finite_scalar(name: str, value: object) -> float:
    """A finite real number, returned as a Python ``float``.

    Accepts Python and numpy scalars (``numbers.Real``, never ``bool``), 0-d
    numpy arrays and one-element real tensors (read with ``.item()``: a host
    sync on an accelerator).
    """
    if type(value) is float or type(value) is int:  # the common case, without the ABC checks
        v = float(value)
    else:
        if not _scalar_kind(value):
            raise TypeError(f"{name} must be a real number, got {_describe(value)}")
        v = float(_scalar_value(name, value))
    if not is_finite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """An integer inside ``[low, high]`` (either end optional), returned as a Python ``int``.

    Accepts Python and numpy integers (``numbers.Integral``, never ``bool``),
    0-d integer numpy arrays and one-element integer tensors (read with
    ``.item()``: a host sync on an accelerator). Floats, even integral ones
    such as ``2.0``, are rejected.
    """
    if type(value) is int:  # the common case, without the ABC checks
        v = value
    else:
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


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the call when ``x`` has that dtype (``to`` is not free)."""
    return x if x.dtype == dtype else x.to(dtype)


def result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the dtype of every rlmath result."""
    for t in tensors:
        if t.dtype == torch.float64:
            return torch.float64
    return torch.float32


# ---------------------------------------------------------------- vocabulary inputs


def check_logits(name: str, logits: object) -> torch.Tensor:
    """A floating tensor with at least one dim and a non-empty last (vocabulary) dim."""
    x = check_tensor(name, logits, floating=True)
    if x.dim() < 1:
        raise ValueError(f"{name} must have shape (..., V), got a 0-d tensor")
    if x.shape[-1] < 1:
        raise ValueError(
            f"{name} must have a non-empty vocabulary dim V, got shape {tuple(x.shape)}"
        )
    return x


def check_index_tensor(name: str, x: object) -> torch.Tensor:
    """An integer tensor (not bool): token ids, labels, indices."""
    t = check_tensor(name, x)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    return t


def check_labels(
    name: str,
    labels: object,
    batch: tuple[int, ...],
    device: torch.device,
    *,
    allow_k: bool = True,
    device_of: str = "logits",
    batch_name: str = "logits.shape[:-1]",
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``labels`` as an ``(N, K)`` int64 tensor, and the shape of the result.

    ``labels`` has shape ``batch`` (one label per row; result of that shape)
    or, with ``allow_k``, ``batch + (K,)`` (K candidates per row; result
    ``batch + (K,)``). Shapes only: values are checked by :func:`check_label_values`.
    """
    lab = check_index_tensor(name, labels)
    if lab.device != device:
        raise ValueError(f"{name} is on {lab.device} but {device_of} is on {device}")
    if tuple(lab.shape) == batch:
        out_shape, k = batch, 1
    elif allow_k and lab.dim() == len(batch) + 1 and tuple(lab.shape[:-1]) == batch:
        out_shape, k = tuple(lab.shape), lab.shape[-1]
    else:
        expected = f"{batch_name} = {batch}" + (f" or {batch} + (K,)" if allow_k else "")
        raise ValueError(f"{name} must have shape {expected}, got {tuple(lab.shape)}")
    return lab.reshape(math.prod(batch), k).long(), out_shape


def check_label_values(
    name: str, labels: torch.Tensor, vocab: int, ignore_index: int | None
) -> None:
    """Every label lies in ``[0, vocab)`` or equals ``ignore_index`` (reads data: a host sync)."""
    if not labels.numel():
        return
    ok = (labels >= 0) & (labels < vocab)
    if ignore_index is not None:
        ok |= labels == ignore_index
    if not bool(ok.all()):
        bad = int(labels[~ok].reshape(-1)[0])
        also = f" or equal ignore_index = {ignore_index}" if ignore_index is not None else ""
        raise ValueError(f"{name} must lie in [0, {vocab}) (the vocabulary){also}, found {bad}")


def check_optional_int(name: str, value: object, low: int | None = None) -> int | None:
    """``None``, or an integer ``>= low`` as :func:`check_int` accepts it."""
    return None if value is None else check_int(name, value, low)


def check_positive_int_or_none(name: str, value: object) -> int | None:
    """``None`` or an integer ``>= 1``."""
    return check_optional_int(name, value, 1)


def check_temperature(
    temperature: object,
    batch: tuple[int, ...],
    device: torch.device,
    *,
    validate: bool,
    shape_name: str = "logits.shape[:-1]",
    device_of: str = "logits",
) -> tuple[torch.Tensor | None, float]:
    """A temperature as ``(tensor or None, scalar)``.

    A number (Python or numpy scalar, 0-d numpy array) must be finite and > 0:
    ``(None, value)``. A tensor must be real and broadcastable to ``batch``
    (called ``shape_name`` in errors); it is returned detached and unchanged
    (``(tensor, 1.0)``; it receives no gradient), and its values are checked
    only with ``validate`` (reading tensor data synchronizes).
    """
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"temperature must be a real tensor, got dtype {t.dtype}")
        if t.device != device:
            raise ValueError(f"temperature is on {t.device} but {device_of} is on {device}")
        try:
            shape = torch.broadcast_shapes(tuple(t.shape), batch)
        except RuntimeError:
            shape = None
        if shape != batch:
            raise ValueError(
                f"temperature must be broadcastable to {shape_name} = {batch}, "
                f"got shape {tuple(t.shape)}"
            )
        if validate and t.numel() and not bool(((t > 0) & torch.isfinite(t)).all()):
            raise ValueError("temperature must be finite and > 0 everywhere")
        return t, 1.0
    if type(temperature) is float or type(temperature) is int:
        value = float(temperature)
    else:
        if not _scalar_kind(temperature):
            raise TypeError(
                f"temperature must be a float or a tensor, got {_describe(temperature)}"
            )
        value = float(_scalar_value("temperature", temperature))
    if not is_finite(value) or value <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    return None, value
