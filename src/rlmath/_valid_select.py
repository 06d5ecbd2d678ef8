"""``torch.where(valid, x, 0)`` for floating ``x``, bit for bit, by integer arithmetic on a CPU.

On a CPU torch's ``where`` is an element-by-element loop (it is not
vectorized): on ``(8192, 128)`` fp32 it took 0.75 ms on one core of a 2-core
AMD EPYC VM, more than twice a vectorized op of the same size, and an outcome
estimator runs two of them per call (the masked rewards for the scores, the
advantages). For a floating ``x`` the same result is the mask as integers
0 / 1 times ``x`` read as integers of its width: a valid position keeps
``x``'s bits (NaN, inf and -0.0 included), a masked one gets 0, the bits of
+0.0, exactly what ``where(valid, x, 0)`` gives. torch's integer conversion
and multiply are vectorized (0.33 ms for the same tensor).

On other devices (:func:`rlmath._device.selects_by_bits`) the functions call
``torch.where``, one bandwidth-bound kernel there.
"""

from __future__ import annotations

import torch

from rlmath import _device

__all__ = [
    "BITS_MIN_ELEMENTS",
    "MAX_ROW_SUM_CHUNKS",
    "ROW_SUM_CHUNK_ELEMENTS",
    "ROW_SUM_WHERE_ELEMENTS",
    "row_sum_rows",
    "select_valid",
    "valid_row_sums",
    "where_valid",
]

#: Elements per chunk of :func:`valid_row_sums` on a CPU: a chunk's
#: selected values (256 KiB in fp32) are still in the caches when summed.
ROW_SUM_CHUNK_ELEMENTS = 64 * 1024
#: At most this many chunks per call: each costs three op dispatches.
MAX_ROW_SUM_CHUNKS = 32

#: Elements from which :func:`where_valid` selects by bits (where no gradient is recorded).
BITS_MIN_ELEMENTS = 8 * 1024
#: At most this many elements, :func:`valid_row_sums` takes ``where`` and one sum (three
#: ops, 15 µs for 8192 fp32 on one core) rather than its chunks (a dozen ops, 34 µs).
ROW_SUM_WHERE_ELEMENTS = 16 * 1024

_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_mask(valid: torch.Tensor) -> None:
    # A bool mask converts to a new integer tensor, which is then written in place.
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")


def _int_of(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype whose bits a ``dtype`` value is read as."""
    if not dtype.is_floating_point or dtype.itemsize not in _SAME_WIDTH_INT:
        raise TypeError(f"selects by bits need a 16-, 32- or 64-bit floating dtype, got {dtype}")
    return _SAME_WIDTH_INT[dtype.itemsize]


def row_sum_rows(rows: int, width: int) -> int:
    """Rows per chunk of :func:`valid_row_sums`: about 64 Ki elements, at most 32 chunks."""
    return max(1, ROW_SUM_CHUNK_ELEMENTS // max(1, width), -(-rows // MAX_ROW_SUM_CHUNKS))


def select_valid(valid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.where(valid, x, 0)`` bit for bit, of ``valid``'s shape and ``x``'s dtype.

    On a CPU: the mask as integers 0 / 1 of ``x``'s width, multiplied in
    place by ``x``'s bits (``1 · b = b``, ``0 · b = 0``, the bits of +0.0).

    Shape: ``valid`` any shape, ``bool``; ``x`` floating, broadcastable to it.
    """
    _check_mask(valid)
    if not _device.selects_by_bits(valid.device):
        return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    int_dtype = _int_of(x.dtype)
    return valid.to(int_dtype).mul_(x.view(int_dtype)).view(x.dtype)


def where_valid(valid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.where(valid, x, 0)`` bit for bit: :func:`select_valid` unless autograd records ``x``.

    For the masked inputs of the losses and statistics. ``torch.where`` where
    a gradient must flow through ``x`` (its backward selects the gradient the
    same way) or ``x`` is small (below :data:`BITS_MIN_ELEMENTS`: one op
    against the two of the bits, which cost as much at that size); otherwise
    the selection by bits, faster on a CPU from about 8 Ki elements on
    (``(1024, 1024)`` fp32 on one core: 0.28 ms against 2.9 ms for ``where``
    and 3.5 ms for ``masked_fill(~valid, 0)``).

    Shape: ``valid`` bool, ``x`` floating of ``valid``'s shape.
    """
    if (x.requires_grad and torch.is_grad_enabled()) or x.numel() < BITS_MIN_ELEMENTS:
        return torch.where(valid, x, 0)
    return select_valid(valid, x)


def valid_row_sums(valid: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``torch.where(valid, x.to(dtype), 0).sum(-1)`` for a 2-D mask, bit for bit.

    On a CPU without a full-size temporary: rows go in chunks of
    :func:`row_sum_rows` through one small buffer (the chunk's mask as
    integers 0 / 1, multiplied by the chunk's bits), summed while in the
    caches. Each row is summed on its own, as by the whole-tensor sum.

    Shape: ``valid`` and ``x`` ``(B, T)`` → ``(B,)`` in ``dtype``.
    """
    _check_mask(valid)
    int_dtype = _int_of(dtype)
    if not _device.selects_by_bits(valid.device) or valid.numel() <= ROW_SUM_WHERE_ELEMENTS:
        # Elsewhere, and for a small batch (three ops against a dozen), the plain form.
        zero = torch.zeros((), dtype=dtype, device=x.device)
        return torch.where(valid, x.to(dtype), zero).sum(-1)
    rows, width = valid.shape
    step = row_sum_rows(rows, width)
    out = torch.empty(rows, dtype=dtype, device=x.device)
    buf = torch.empty((min(step, rows), width), dtype=int_dtype, device=x.device)
    convert = x.dtype != dtype
    for a in range(0, rows, step):
        b = min(rows, a + step)
        chunk = buf[: b - a]
        values = x[a:b].to(dtype) if convert else x[a:b]
        chunk.copy_(valid[a:b]).mul_(values.view(int_dtype))
        torch.sum(chunk.view(dtype), -1, out=out[a:b])
    return out
