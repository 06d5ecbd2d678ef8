"""Row reductions and the scaled shift: the primitives every pure-torch pass is built from.

Notation for one row of raw logits ``x`` at temperature ``T`` (``z = x / T``)::

    m    = max_j z_j                     y_j  = z_j - m        (<= 0)
    s    = Σ_j exp(y_j)                  lse  = m + log s
    ls_j = z_j - lse                     p_j  = exp(ls_j)
    t    = Σ_j exp(y_j)·y_j              H    = -Σ_j p_j ls_j = log s - t / s

Temperature is applied in exactly one place, :func:`scaled_shift`: the chunk
is divided by ``T`` in the compute dtype (bf16 logits are never divided in
bf16) and shifted in the same fused operation, so no scaled copy is stored.

Determinism: a row's result never depends on which chunk holds it or on how
many rows that chunk has. Elementwise kernels are position independent and
:func:`row_sum` reduces each row with the same kernel; the one case where
ATen would split a single row's reduction across threads (a chunk holding
exactly one long row) is routed through a two-row view so that it takes the
same path as every multi-row chunk.
"""

from __future__ import annotations

import torch

__all__ = ["row_nansum", "row_sum", "scaled_max", "scaled_shift", "upcast", "upcasts_first"]

# Below this many elements a reduction never runs multi-threaded (ATen's
# GRAIN_SIZE), so a single short row reduces the same way whatever the thread count.
_ATEN_GRAIN_SIZE = 32768


def _single_long_row(x: torch.Tensor) -> bool:
    # CPU only: the split is a property of ATen's CPU reduction (with more than
    # one intra-op thread; the two-row path is taken whatever the count).
    return x.shape[0] == 1 and x.shape[1] >= _ATEN_GRAIN_SIZE and x.device.type == "cpu"


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of a 2-D tensor, bitwise independent of ``x.shape[0]``.

    For a single row long enough to be split across threads, ATen would sum the
    two halves separately and add them; expanding the row to two (stride-0) rows
    makes it parallelize over rows instead, the path every multi-row chunk takes.

    Shape: ``(c, V)`` → ``(c,)``, dtype of ``x``.
    """
    if _single_long_row(x):
        return x.expand(2, x.shape[1]).sum(-1)[:1]
    return x.sum(-1)


def row_nansum(x: torch.Tensor) -> torch.Tensor:
    """:func:`row_sum` that skips NaN entries (the ``0·(-inf)`` of masked vocabulary)."""
    if _single_long_row(x):
        return x.expand(2, x.shape[1]).nansum(-1)[:1]
    return x.nansum(-1)


def scaled_max(
    src: torch.Tensor, temperature: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``max_j src_j / T`` per row, ``(c, 1)`` in ``dtype``.

    Division by ``T > 0`` is monotonic and so is rounding, hence
    ``fl(max x / T) = max fl(x / T)``: the max of the scaled chunk without
    scaling the chunk.
    """
    m = src.amax(-1, keepdim=True)
    if m.dtype != dtype:
        m = m.to(dtype)
    return m if temperature is None else m / temperature


def scaled_shift(
    src: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out = src / T - shift`` in the dtype of ``out``, in one fused pass.

    ``src`` may be bf16/fp16 (upcast element by element, as the other operands
    are compute-dtype tensors) and may alias ``out``.

    Args:
        src: ``(c, V)`` raw logits, any floating dtype and strides.
        temperature: ``None`` or a ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
        shift: ``(c, 1)`` tensor in the compute dtype.
        out: ``(c, V)`` destination in the compute dtype.

    Returns:
        ``out``.
    """
    if src.dtype != out.dtype and out.device.type == "cpu":
        # Upcast, then shift in place: the same roundings as one mixed-dtype
        # op, in 30 µs instead of 40 for an (8, 32000) bf16 chunk (ATen's CPU
        # kernels convert a mixed-dtype operand element by element). On an
        # accelerator the one fused pass reads memory once.
        src = upcast(src, out)
    if temperature is None:
        return torch.sub(src, shift, out=out)
    # addcdiv rounds src / T first, then adds: the same value as (src / T) - shift.
    return torch.addcdiv(-shift, src, temperature, out=out)


def upcast(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out ← src`` in ``out``'s (compute) dtype, exactly; returns ``out``."""
    return out.copy_(src)


def upcasts_first(src: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a pass upcasts a half-precision chunk into its buffer before reading it (a CPU).

    ATen's CPU reductions and elementwise kernels are slower on bf16/fp16 than
    on fp32 (the max of an (8, 32000) bf16 chunk: 47 µs, of its fp32 copy:
    14 µs, the copy 17 µs); the values are the same either way.
    """
    return src.dtype != dtype and src.device.type == "cpu"
