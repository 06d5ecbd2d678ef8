"""Small tensor helpers: response masks, element-wise clipping, padding to a length.

These keep verl's names, positional arguments and defaults
(``verl.utils.torch_functional``), so migrating is an import change.
They move or select data and keep the input dtype (no fp32 promotion).
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral, Real

import torch
import torch.nn.functional as F

from rlmath._validation import check_index_tensor, check_int, check_tensor

__all__ = [
    "clip_by_value",
    "get_response_mask",
    "pad_2d_list_to_length",
    "pad_sequence_to_length",
]


def _check_int(name: str, value: object, low: int = 0) -> int:
    return check_int(name, value, low)


def _eos_ids(eos_token: object, device: torch.device) -> torch.Tensor:
    """The EOS ids as a 1-D int64 tensor on ``device``; raises on anything but ints."""
    if isinstance(eos_token, torch.Tensor):
        check_index_tensor("eos_token", eos_token)
        ids = eos_token.reshape(-1).to(device=device, dtype=torch.int64)
    else:
        items = list(eos_token) if isinstance(eos_token, Sequence) else [eos_token]
        values = []
        for item in items:
            if isinstance(item, bool) or not isinstance(item, Integral):
                raise TypeError(f"eos_token must be an int or a list of ints, got {eos_token!r}")
            values.append(int(item))
        ids = torch.tensor(values, dtype=torch.int64, device=device)
    if ids.numel() == 0:
        raise ValueError("eos_token must name at least one token id, got an empty list")
    return ids


def get_response_mask(
    response_id: torch.Tensor,
    eos_token: int | Sequence[int] | torch.Tensor = 2,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Mask of the tokens up to and including the first EOS of each row.

    Every token before the first EOS is valid, the first EOS itself is valid
    (it is part of the response the policy chose), and everything after it is
    masked. A row without any EOS is valid everywhere. With several EOS ids
    (``eos_token=[1, 2]``) the first occurrence of any of them ends the row.

    Vectorized: "no EOS strictly before position t" is
    ``cumsum(is_eos) − is_eos == 0``, one pass with no loop over rows.

    Args:
        response_id: integer token ids (not bool, float or complex). Shape
            ``(..., T)``, time on the last dimension (``(B, T)`` in practice).
        eos_token: an int, a list/tuple of ints, or an integer tensor of ids.
        dtype: dtype of the result (verl's default ``torch.int64``; ``torch.bool``
            works too).

    Returns:
        Shape of ``response_id``, dtype ``dtype``; 1 = valid.
    """
    check_tensor("response_id", response_id)
    if (
        response_id.is_floating_point()
        or response_id.is_complex()
        or response_id.dtype == torch.bool
    ):
        raise TypeError(f"response_id must be an integer tensor, got dtype {response_id.dtype}")
    if response_id.dim() == 0:
        raise ValueError("response_id must have at least one dimension (time), got a 0-d tensor")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    is_eos = torch.isin(response_id, _eos_ids(eos_token, response_id.device)).to(torch.int32)
    eos_before = is_eos.cumsum(dim=-1) - is_eos
    return (eos_before == 0).to(dtype)


def clip_by_value(
    x: torch.Tensor,
    tensor_min: torch.Tensor | float,
    tensor_max: torch.Tensor | float,
) -> torch.Tensor:
    """Element-wise ``max(min(x, tensor_max), tensor_min)`` with tensor bounds.

    ``torch.clamp`` with tensor bounds behaves the same whenever
    ``tensor_min <= tensor_max``; where a bound pair is inverted this function
    returns ``tensor_min`` (as verl's does) whereas ``torch.clamp`` returns
    ``tensor_max``. Bounds are not checked against each other, because that
    would read tensor data. NaN in ``x`` propagates. The gradient flows to
    whichever of ``x`` / bound is selected (shared equally on exact ties, as
    ``torch.minimum``/``torch.maximum`` do).

    Args:
        x: Shape ``(*)``, any real dtype.
        tensor_min, tensor_max: tensors broadcastable to ``x``, or Python numbers.

    Returns:
        The broadcast shape; dtype by torch's type promotion of the three inputs.
    """
    check_tensor("x", x)

    def as_bound(name: str, bound: object) -> torch.Tensor:
        if isinstance(bound, torch.Tensor):
            return bound
        if isinstance(bound, bool) or not isinstance(bound, Real):
            raise TypeError(f"{name} must be a tensor or a real number, got {type(bound).__name__}")
        return torch.tensor(bound, dtype=x.dtype, device=x.device)

    low = as_bound("tensor_min", tensor_min)
    high = as_bound("tensor_max", tensor_max)
    for name, bound in (("tensor_min", low), ("tensor_max", high)):
        try:
            torch.broadcast_shapes(bound.shape, x.shape)
        except RuntimeError:
            raise ValueError(
                f"{name} of shape {tuple(bound.shape)} does not broadcast to x's shape "
                f"{tuple(x.shape)}"
            ) from None
    return torch.maximum(torch.minimum(x, high), low)


def pad_sequence_to_length(
    tensors: torch.Tensor,
    max_seq_len: int,
    pad_token_id: float,
    left_pad: bool = False,
) -> torch.Tensor:
    """Pad the last dimension with ``pad_token_id`` up to ``max_seq_len``.

    Never truncates: a tensor whose last dimension is already
    ``>= max_seq_len`` is returned as is (the same object, as in verl).
    ``left_pad=True`` puts the padding before the data (left-padded prompts).

    Args:
        tensors: Shape ``(..., T)``, any dtype (e.g. ``(B, T)`` token ids or log-probs).
        max_seq_len: target length of the last dimension, ``>= 0``.
        pad_token_id: the fill value.
        left_pad: pad on the left instead of the right.

    Returns:
        Shape ``(..., max(T, max_seq_len))``, dtype of ``tensors``.
    """
    check_tensor("tensors", tensors)
    if tensors.dim() == 0:
        raise ValueError("tensors must have at least one dimension, got a 0-d tensor")
    max_seq_len = _check_int("max_seq_len", max_seq_len)
    if isinstance(pad_token_id, torch.Tensor) or not isinstance(pad_token_id, Real):
        raise TypeError(f"pad_token_id must be a Python number, got {type(pad_token_id).__name__}")
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    return F.pad(tensors, (missing, 0) if left_pad else (0, missing), "constant", pad_token_id)


def pad_2d_list_to_length(
    response: Sequence[Sequence[float]],
    pad_token_id: float,
    max_length: int | None = None,
) -> torch.Tensor:
    """Right-pad a list of rows (token ids, log-probs, ...) into one 2-D tensor.

    The width is the longest row, or ``max_length`` if that is larger (rows
    are never truncated, as in verl).

    Args:
        response: a non-empty list of rows (lists, tuples, 1-D arrays or tensors).
        pad_token_id: the fill value.
        max_length: minimum width, or None.

    Returns:
        Shape ``(len(response), width)``; dtype inferred by ``torch.tensor``
        (int64 for int rows and pad, float32 as soon as a float appears).
    """
    if isinstance(response, (str, bytes, torch.Tensor)) or not hasattr(response, "__len__"):
        raise TypeError(f"response must be a list of sequences, got {type(response).__name__}")
    if len(response) == 0:
        raise ValueError("response must contain at least one row, got an empty list")
    rows = []
    for i, row in enumerate(response):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
            raise TypeError(f"response[{i}] must be a sequence, got {type(row).__name__}")
        rows.append(list(row))
    if isinstance(pad_token_id, torch.Tensor) or not isinstance(pad_token_id, Real):
        raise TypeError(f"pad_token_id must be a Python number, got {type(pad_token_id).__name__}")
    width = max(len(row) for row in rows)
    if max_length is not None:
        width = max(width, _check_int("max_length", max_length))
    return torch.tensor([row + [pad_token_id] * (width - len(row)) for row in rows])
