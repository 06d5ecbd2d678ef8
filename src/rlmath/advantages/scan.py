"""Reverse discounted cumulative sums by a pairwise (tree) scan.

Every return-to-go and GAE computation reduces to the right-to-left linear
recurrence ``y[t] = x[t] + c · y[t+1]`` with ``y[T] = 0``. A Python loop over
``t`` is ``T`` dependent steps; this module solves the recurrence with
``O(T)`` total work and ``O(log T)`` sequential depth:

1. pair up neighbours: ``y[2i] = (x[2i] + c·x[2i+1]) + c² · y[2i+2]`` is the
   same recurrence on half the length with coefficient ``c²``;
2. solve it (recursively) for the even positions;
3. fill in the odd positions: ``y[2i+1] = x[2i+1] + c · y[2i+2]``.

Each level touches half as many elements as the one before, so the total work
is at most twice one pass over the data. Only sums and products of ``c`` appear
(no division by powers of ``c``), so the result is exact in structure for
``c = 0`` and ``c = 1`` and never under/overflows for small ``c``: powers of
``c`` below the dtype's smallest normal number are flushed to 0, where they
could not change a sum anyway and would only slow the CPU down. Rounding error
grows like ``log T`` (a tree sum), not like ``T``. Short tails are solved by a
tiny triangular matrix product.
"""

from __future__ import annotations

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_in_range, check_tensor

__all__ = ["reverse_discounted_cumsum"]

# Below this length the recurrence is solved by one small triangular product,
# which saves the Python overhead of the last few halving levels.
_BASE_LENGTH = 32


@threads_per_call
def reverse_discounted_cumsum(values: torch.Tensor, discount: float) -> torch.Tensor:
    """``y[..., t] = Σ_{s ≥ t} discount^(s − t) · values[..., s]`` along the last axis.

    The discounted return-to-go of a reward sequence, computed by a tree scan
    (``O(T)`` work, ``O(log T)`` depth) instead of a loop over ``t``. No
    masking: zero the entries that must not count before calling.

    Args:
        values: Shape ``(*, T)``, floating. Not modified.
        discount: Python number in ``[0, 1]``.

    Returns:
        Shape ``(*, T)``; dtype of ``values`` (floating dtypes other than
        fp32/fp64 are computed in fp32 and returned in fp32).
    """
    check_tensor("values", values, floating=True)
    c = check_in_range("discount", discount, 0.0, 1.0)
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension, got a 0-d tensor")
    x = values if values.dtype in (torch.float32, torch.float64) else values.float()
    return _reverse_scan(x, c)


def _flush(c: float, dtype: torch.dtype) -> float:
    """``c``, or 0 when it is below the smallest normal number of ``dtype``."""
    return c if c >= torch.finfo(dtype).tiny else 0.0


def _base_solve(x: torch.Tensor, c: float) -> torch.Tensor:
    """Exact solution for a short last axis: ``y[t] = Σ_{s ≥ t} c^(s−t) · x[s]``."""
    n = x.shape[-1]
    # Built on x's device from a Python scalar (no host-to-device copy, no sync).
    # Powers are formed in fp64 and flushed to 0 below the smallest normal
    # number of x's dtype, so the matrix holds no denormals; 0^0 = 1 keeps c = 0
    # exact.
    steps = torch.arange(n, device=x.device, dtype=torch.float64)
    lag = steps[None, :] - steps[:, None]
    powers = torch.pow(c, lag.clamp(min=0))
    matrix = torch.where((lag >= 0) & (powers >= torch.finfo(x.dtype).tiny), powers, 0.0)
    # A broadcast product and sum rather than a BLAS matmul, so that fp32 never
    # runs in TF32 (GPU) or bf16 (oneDNN) reduced precision.
    return (x.unsqueeze(-2) * matrix.to(x.dtype)).sum(-1)


def _reverse_scan(x: torch.Tensor, c: float, *, inplace: bool = False) -> torch.Tensor:
    """Solve ``y[t] = x[t] + c·y[t+1]`` (``y[T] = 0``) along the last axis of ``x``.

    ``inplace=True`` overwrites ``x`` (a private buffer of the caller) with ``y``.
    """
    out = x if inplace else torch.empty_like(x)
    if x.shape[-1] > 0:
        _scan_into(x, c, out)
    return out


def _scan_into(x: torch.Tensor, c: float, out: torch.Tensor) -> None:
    """Write the solution for ``x`` into ``out`` (same shape, possibly a strided view).

    ``out`` may be ``x`` itself: every element of ``x`` is read before (or, for
    odd slots, in the same elementwise operation as) its slot is written.

    Even positions ``2i`` form a half-length problem with coefficient ``c²``:
    ``y[2i] = (x[2i] + c·x[2i+1]) + c²·y[2i+2]``; when the length is odd the
    last element ``y[n−1] = x[n−1]`` closes the half problem. Odd positions
    follow from their right neighbour: ``y[2i+1] = x[2i+1] + c·y[2i+2]``.
    """
    n = x.shape[-1]
    if c == 0.0:
        out.copy_(x)
        return
    if n <= _BASE_LENGTH:
        out.copy_(_base_solve(x, c))
        return
    n_even, n_odd = (n + 1) // 2, n // 2
    pairs = x.new_empty((*x.shape[:-1], n_even))
    torch.add(x[..., 0 : 2 * n_odd : 2], x[..., 1 : 2 * n_odd : 2], alpha=c, out=pairs[..., :n_odd])
    if n_even > n_odd:
        pairs[..., n_odd] = x[..., n - 1]
    y_even = out[..., 0::2]
    _scan_into(pairs, _flush(c * c, x.dtype), y_even)
    x_odd, y_odd = x[..., 1::2], out[..., 1::2]
    # Odd slots with an even slot to their right; for even n the last odd slot
    # is the sequence end and has none.
    k = n_odd if n_even > n_odd else n_odd - 1
    torch.add(x_odd[..., :k], y_even[..., 1 : k + 1], alpha=c, out=y_odd[..., :k])
    if k < n_odd:
        y_odd[..., k] = x_odd[..., k]
