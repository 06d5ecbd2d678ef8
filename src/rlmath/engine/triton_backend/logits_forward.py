"""The forward pass over logits as one Triton kernel: per-row statistics in one read.

One program per selected row (a 1-D grid, so any number of rows) walks the
row's ``real`` columns once in blocks (:func:`~.row_math.row_stats`: online
max and sum-exp in fp32, and for the entropy ``Σ e^{z-m}·(z - m)``), and
reads each label's logit. Reads ``M × real`` logits (any float dtype and
strides), writes ``3·M + M·K`` fp32 numbers; same signature and results as
:func:`rlmath.engine.torch_backend.logits_forward.logits_stats`.

With ``shift`` (a vocabulary shard on the tile grid) the sums come per
128-column tile instead (:mod:`.tile_sums`), for the engine's fixed tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.buffers import TemperatureColumn
from rlmath.engine.torch_backend.logits_forward import kept_thresholds, label_logits
from rlmath.engine.torch_backend.logits_forward import logits_stats as torch_logits_stats
from rlmath.engine.torch_backend.rows import RowSource
from rlmath.engine.triton_backend.kept_math import (
    kept_args,
    kept_row_stats,
    scaled,
    temperature_value,
)
from rlmath.engine.triton_backend.launch import (
    block_config,
    int32_columns,
    load_width,
    on_input_device,
    row_layout,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import inv_temperature, row_stats
from rlmath.engine.triton_backend.tile_sums import ENTROPY, NONE, tile_sums

if TYPE_CHECKING:
    from rlmath.engine.sampling import KeptSet

__all__ = ["logits_stats"]

Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@triton.jit
def _logits_stats_kernel(
    X,
    OFF,
    row_stride,
    col_stride,
    n,
    n_load,
    TEMP,
    inv_t_scalar,
    t_scalar,
    LAB,
    K,
    M_OUT,
    S_OUT,
    T_OUT,
    Z_OUT,
    TAU,
    MASK,
    mask_stride,
    IDS,
    ids_stride,
    BOUNDS,
    bounds_stride,
    ADD,
    K_ADD,
    HAS_OFF: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    KEEP_MODE: tl.constexpr,
    WANT_T: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if HAS_OFF:
        start = tl.load(OFF + i).to(tl.int64) * row_stride
    else:
        start = i * row_stride
    row = X + start
    inv_t = inv_temperature(TEMP, i, inv_t_scalar, TEMP_MODE)
    if KEEP_MODE == 0:
        neg_inf = tl.max(tl.full([1], float("-inf"), tl.float32), 0)
        m, s, t = row_stats(
            row, col_stride, n, n_load, inv_t, neg_inf, 0.0, 0.0, TEMP_MODE, WANT_T, PAD, BLOCK
        )
    else:
        # A sampler's kept set: the logits scaled by a division, as its threshold search did.
        T = t_scalar
        if TEMP_MODE == 2:
            T = tl.load(TEMP + i).to(tl.float32)
        m, s, t = kept_row_stats(
            row, col_stride, n, n_load, T, i, TAU, MASK, mask_stride, IDS, ids_stride,
            BOUNDS, bounds_stride, ADD, K_ADD, TEMP_MODE, KEEP_MODE, WANT_T, PAD, BLOCK,
        )  # fmt: skip
    tl.store(M_OUT + i, m)
    tl.store(S_OUT + i, s)
    if WANT_T:
        tl.store(T_OUT + i, t)
    if HAS_LABELS:
        for k in range(0, K):
            lab = tl.load(LAB + i * K + k)
            # An out-of-range label reads nothing and gives NaN (its log-prob is NaN).
            ok = tl.where(lab >= 0, lab < n, False)
            z = tl.load(row + lab * col_stride, mask=ok, other=float("nan")).to(tl.float32)
            if KEEP_MODE != 0:
                z = scaled(z, T, TEMP_MODE)
            elif TEMP_MODE != 0:
                z = z * inv_t
            tl.store(Z_OUT + i * K + k, z)


@on_input_device
def logits_stats(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    labels: torch.Tensor | None,
    temperature: torch.Tensor | float | None,
    want_entropy: bool,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    restrict: KeptSet | None = None,
    shift: torch.Tensor | None = None,
) -> Stats:
    """``(m, s, t, z_labels)`` of every selected row of ``logits`` (one kernel launch).

    Args as in :func:`rlmath.engine.torch_backend.logits_forward.logits_stats`;
    ``chunk`` is not used (one program per row, no chunks) but by the
    threshold search of a kept set (``restrict``: pure torch, chunk by chunk,
    before the kernel; :mod:`.kept_math`). An fp64 compute dtype runs the
    pure-torch pass. ``shift``: ``(M,)`` the rows' max over every vocabulary
    shard; the sums come back per 128-column tile (:func:`.tile_sums.tile_sums`,
    a kept set's too; from the pure-torch pass for an fp64 pass, or a kept set
    whose sizes are counted).
    """
    # A kept set's sums per tile take the kernel unless its sizes are counted (kept_stats),
    # which the pure-torch pass does as it goes.
    counted = restrict is not None and restrict.count is not None
    if dtype != torch.float32 or (shift is not None and counted):
        return torch_logits_stats(
            logits, row_index, narrow, labels, temperature, want_entropy, real, chunk, dtype,
            restrict=restrict, shift=shift,
        )  # fmt: skip
    if shift is not None:  # the label logits as the pure-torch pass reads them
        src = RowSource(logits, real, row_index, narrow)
        temp_col = TemperatureColumn(temperature, dtype, logits.device)
        z = label_logits(src, labels, temp_col, dtype) if labels is not None else None
        second = ENTROPY if want_entropy else NONE
        s, t = tile_sums(logits, row_index, narrow, temperature, real, shift, second, restrict)
        return shift.to(dtype).clone(), s, t, z
    if restrict is not None and (
        (restrict.kept is None and restrict.forward) or restrict.count is not None
    ):
        kept_thresholds(logits, row_index, narrow, temperature, real, chunk, dtype, restrict)
    dev = logits.device
    logits = int32_columns(logits)
    off: torch.Tensor | None
    if row_index is not None:
        M = row_index.numel()
        base, off, row_stride, col_stride = logits, row_index, logits.stride(0), logits.stride(1)
    else:
        view = logits.narrow(*narrow) if narrow is not None else logits
        lay = row_layout(view)
        M, base, off = lay.rows, view, lay.offsets
        row_stride, col_stride = lay.stride, lay.col_stride
    m = torch.full((M,), float("-inf"), dtype=dtype, device=dev)
    s = torch.zeros(M, dtype=dtype, device=dev)
    t = torch.zeros(M, dtype=dtype, device=dev) if want_entropy else None
    K = labels.shape[-1] if labels is not None else 0
    z = torch.zeros((M, K), dtype=dtype, device=dev) if labels is not None else None
    if M == 0 or real == 0:
        return m, s, t, z
    temp, inv_t, mode = temperature_args(temperature, m)
    lab = labels.contiguous() if labels is not None else m
    block, warps = block_config(real, logits.element_size())
    n_load = load_width(real, logits.shape[-1])
    ka = kept_args(restrict, m, block, real)
    _logits_stats_kernel[(M,)](
        base,
        off if off is not None else m,
        row_stride,
        col_stride,
        real,
        n_load,
        temp,
        inv_t,
        temperature_value(temperature),
        lab,
        K,
        m,
        s,
        t if t is not None else m,
        z if z is not None else m,
        *ka.kernel_args(),
        HAS_OFF=off is not None,
        TEMP_MODE=mode,
        KEEP_MODE=ka.mode,
        WANT_T=want_entropy,
        HAS_LABELS=labels is not None,
        PAD=n_load > real,
        BLOCK=block,
        num_warps=warps,
    )
    return m, s, t, z
