"""Host-side helpers shared by the Triton passes: block sizes, rows, temperatures, flags.

Nothing here reads device data on the host: row offsets, temperatures and
masks stay tensors, and every launch parameter is a shape, a stride or a
Python scalar. Block sizes depend on the vocabulary width and the dtype only,
never on the number of rows, so a row is reduced the same way whatever the
batch it comes in.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = [
    "MAX_BLOCK_BYTES",
    "MAX_BLOCK_ELEMENTS",
    "RowLayout",
    "as_u8",
    "block_config",
    "int32_columns",
    "load_width",
    "next_pow2",
    "on_input_device",
    "row_layout",
    "temperature_args",
]

MAX_BLOCK_ELEMENTS = 8192
"""Most columns one program reads per step of its loop over a row."""

MAX_BLOCK_BYTES = 16384
"""Most bytes of one input row that one step reads (8192 bf16 or 4096 fp32 columns)."""

# Temperature modes of the kernels (a constexpr; the value itself is never one).
TEMP_NONE, TEMP_SCALAR, TEMP_ROWS = 0, 1, 2


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= max(n, 1)``."""
    return 1 << max(0, int(n) - 1).bit_length()


def block_config(
    width: int, elem_bytes: int, *, streams: int = 1, per_thread: int = 16
) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for a loop over rows of ``width`` columns.

    ``streams`` is the number of input rows read together (2 for the KL); the
    block shrinks so that one step reads at most :data:`MAX_BLOCK_BYTES` per
    stream. The warps give each thread at most ``per_thread`` columns of a
    step (16; 8 for the kernels that keep several per-column values: the
    KL's three running sums, the summed gradient of repeated packed rows),
    between 4 and 16 warps. Depends on the width and dtype only (batch
    invariance).
    """
    cap = min(MAX_BLOCK_ELEMENTS, MAX_BLOCK_BYTES // max(1, elem_bytes * streams))
    cap = 1 << (max(16, cap).bit_length() - 1)  # a power of two
    block = min(next_pow2(max(width, 16)), cap)
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    warps = min(16, max(warps, block // (32 * per_thread)))
    return block, warps


ALIGN = 16
"""Columns a load width or a fused-head tile is rounded to (16 elements: a multiple of 16 bytes)."""


def load_width(n: int, readable: int) -> int:
    """How many columns of each row to load when ``n`` are used and ``readable`` exist.

    ``n`` rounded up to a multiple of :data:`ALIGN` when the row has that
    many columns (a shard with padding columns: ``vocab_size`` 151665 in a
    151936-wide shard loads 151680), else ``n``. Triton specializes an
    integer that is a multiple of 16, so a mask ``c < load_width`` keeps
    128-bit loads where ``c < n`` would force 16-bit ones; the kernels mask
    the extra columns with a ``where`` after the load.
    """
    up = -(-n // ALIGN) * ALIGN
    return up if up <= readable else n


def as_u8(mask: torch.Tensor) -> torch.Tensor:
    """A contiguous bool tensor viewed as uint8 (no copy when already contiguous)."""
    return mask.contiguous().view(torch.uint8)


class RowLayout:
    """Where each of ``M`` rows of a ``(..., V)`` tensor starts: row ``i`` at ``offset_i · stride``.

    ``offsets`` is ``None`` when row ``i`` starts at ``i · stride`` (the batch
    dims merge into one); otherwise an ``(M,)`` int64 tensor counting in
    units of ``stride``, the greatest common divisor of the batch dims'
    strides. A kernel multiplies the offset it loads by ``stride``, so when
    ``stride`` is a multiple of 16 Triton sees every row start as 16-byte
    aligned (``x[:, :-1]`` of ``V = 151936`` logits: a stride of ``V``) and
    reads the rows 128 bits at a time; with element offsets (a stride of 1)
    it could not. ``col_stride`` is the stride of the last dim.
    """

    def __init__(self, offsets: torch.Tensor | None, stride: int, col_stride: int, rows: int):
        self.offsets, self.stride, self.col_stride, self.rows = offsets, stride, col_stride, rows


def row_layout(x: torch.Tensor) -> RowLayout:
    """The :class:`RowLayout` of the rows of ``x`` (``(..., V)``, any strides, a view is fine)."""
    V = x.shape[-1]
    col = x.stride(-1)
    if x.dim() == 1:
        return RowLayout(None, 0, col, 1)
    rows = x.numel() // V if V else 0
    try:
        flat = x.view(-1, V)  # succeeds exactly when the batch dims merge into one
    except RuntimeError:
        nb = x.dim() - 1
        unit = 0
        for d in range(nb):
            if x.shape[d] > 1:
                unit = math.gcd(unit, x.stride(d))
        unit = max(unit, 1)
        offsets = torch.zeros((), dtype=torch.int64, device=x.device)
        for d in range(nb):
            shape = [1] * nb
            shape[d] = x.shape[d]
            step = torch.arange(x.shape[d], device=x.device, dtype=torch.int64) * (
                x.stride(d) // unit
            )
            offsets = offsets + step.view(shape)
        return RowLayout(offsets.reshape(-1), unit, col, rows)
    return RowLayout(None, flat.stride(0), flat.stride(1), rows)


def int32_columns(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where the offset of its last column overflows int32.

    The kernels step along a row with 32-bit column offsets (the row's start is
    64-bit); only a last-dim stride above 1 (a transposed view) can overflow them.
    """
    if x.dim() and x.stride(-1) > 1 and (x.shape[-1] - 1) * x.stride(-1) >= 2**31:
        return x.contiguous()
    return x


def temperature_args(
    temperature: torch.Tensor | float | None, like: torch.Tensor
) -> tuple[torch.Tensor, float, int]:
    """``(tensor, inverse scalar, mode)`` for a kernel: no temperature, a scalar, or one per row.

    A per-row temperature is passed as a tensor (its values never become
    compile-time constants, so a new temperature never recompiles a kernel);
    a scalar as its Python inverse; ``like`` stands in for an unused pointer.
    """
    if isinstance(temperature, torch.Tensor):
        return temperature.contiguous(), 1.0, TEMP_ROWS
    if temperature is None or temperature == 1.0:
        return like, 1.0, TEMP_NONE
    return like, 1.0 / float(temperature), TEMP_SCALAR


P = ParamSpec("P")
T = TypeVar("T")


def on_input_device(fn: Callable[P, T]) -> Callable[P, T]:
    """Run a pass with its first argument's CUDA device current.

    Triton launches on the current device; a tensor on another GPU (``cuda:1``
    while ``cuda:0`` is current) must not be read from the wrong one.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        first = args[0]
        if isinstance(first, torch.Tensor) and first.device.type == "cuda":
            with torch.cuda.device(first.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper
