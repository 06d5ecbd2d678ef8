"""Sums over 128-column tiles for a vocabulary shard on the tile grid, as Triton kernels.

Over shards whose columns start on the 128-column grid the engine adds every
sum over the vocabulary in one fixed tree over the tiles
(:mod:`rlmath.engine.tree`), shifted by the rows' global max ``M``. These
kernels give the tree's leaves: each tile summed on its own, from its 128
logits and ``M`` alone, by programs of :data:`TILES` tiles whatever the
shard's width, so that a tile's sums are the same bits on every number of
shards. ``z = x / T`` correctly rounded, as the pure-torch passes and the
global max scale; ``exp`` is :func:`~.row_math.exp_ftz`, as in every Triton
pass. A row whose max is ``-inf`` (no finite logit) is shifted by 0: its
sums are 0.

- :func:`tile_sums`: ``Σ e^{z - M}`` and, as asked, ``Σ e^{z - M}·(z - M)``
  (the entropy) or ``Σ e^{2(z - M)}`` (``Σ π²``);
- :func:`kl_tile_sums`: the KL's second phase, ``Σ e^{z - M_z}·(ls^z - ls^r)``
  given the global log-sum-exps (terms with ``e = 0`` add nothing, as the
  pure-torch pass's NaN-skipping sum).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from rlmath.engine.tree import TILE, tile_count
from rlmath.engine.triton_backend.kept_math import (
    KEEP_IDS,
    kept_args,
    kept_block,
    scaled,
    temperature_value,
)
from rlmath.engine.triton_backend.launch import (
    int32_columns,
    load_width,
    row_layout,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import LS_FLOOR, exp_ftz

if TYPE_CHECKING:
    from rlmath.engine.sampling import KeptSet

__all__ = ["ENTROPY", "SQUARES", "TILES", "kl_tile_sums", "tile_sums"]

TILES = 8
"""Tiles one program sums: a constant, so a tile is summed alike in a shard of any width."""

NONE, ENTROPY, SQUARES = 0, 1, 2
"""The second sum of :func:`tile_sums`: none, ``Σ e·(z - M)``, ``Σ e²``."""


@triton.jit
def _row_start(OFF, i, row_stride, HAS_OFF: tl.constexpr):
    """The offset of row ``i``: ``OFF[i]`` rows in (rows picked by index), else ``i``."""
    if HAS_OFF:
        start = tl.load(OFF + i).to(tl.int64) * row_stride
    else:
        start = i * row_stride
    return start


@triton.jit
def _row_temperature(TEMP, i, t_scalar, TEMP_MODE: tl.constexpr):
    """Row ``i``'s temperature: its entry of ``TEMP`` (mode 2), else the scalar."""
    T = t_scalar
    if TEMP_MODE == 2:
        T = tl.load(TEMP + i).to(tl.float32)
    return T


@triton.jit
def _shifted_block(
    X,
    start,
    col_stride,
    n,
    n_load,
    T,
    big,
    j,
    TEMP_MODE: tl.constexpr,
    PAD: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """``z - M`` of one program's columns ``[j·WIDTH, (j + 1)·WIDTH)``, ``-inf`` past ``n``."""
    z = _scaled_block(X, start, col_stride, n, n_load, T, j, TEMP_MODE, PAD, WIDTH)
    return z - tl.where(big == float("-inf"), 0.0, big)


@triton.jit
def _scaled_block(
    X,
    start,
    col_stride,
    n,
    n_load,
    T,
    j,
    TEMP_MODE: tl.constexpr,
    PAD: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """``z = x / T`` of one program's columns ``[j·WIDTH, (j + 1)·WIDTH)``, ``-inf`` past ``n``
    (the kept-set search's rounding)."""
    cols = j * WIDTH + tl.arange(0, WIDTH)
    x = tl.load(X + start + cols * col_stride, mask=cols < n_load, other=float("-inf"))
    x = x.to(tl.float32)
    if PAD:
        x = tl.where(cols < n, x, float("-inf"))
    return scaled(x, T, TEMP_MODE)


@triton.jit
def _tile_sums_kernel(
    X,
    OFF,
    row_stride,
    col_stride,
    n,
    n_load,
    TEMP,
    t_scalar,
    SHIFT,
    S_OUT,
    B_OUT,
    n_tiles,
    TAU,
    MASK,
    mask_stride,
    IDS,
    ids_stride,
    BOUNDS,
    bounds_stride,
    ADD,
    K,
    HAS_OFF: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    SECOND: tl.constexpr,
    KEEP_MODE: tl.constexpr,
    PAD: tl.constexpr,
    TILE_W: tl.constexpr,
    N_TILES: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    start = _row_start(OFF, i, row_stride, HAS_OFF)
    T = _row_temperature(TEMP, i, t_scalar, TEMP_MODE)
    big = tl.load(SHIFT + i)
    z = _scaled_block(X, start, col_stride, n, n_load, T, j, TEMP_MODE, PAD, N_TILES * TILE_W)
    y = z - tl.where(big == float("-inf"), 0.0, big)
    e = exp_ftz(y)
    if KEEP_MODE != 0:  # a sampler's kept set: the other columns add nothing
        cols = j * (N_TILES * TILE_W) + tl.arange(0, N_TILES * TILE_W)
        keep = kept_block(
            z, cols, i, TAU, MASK, mask_stride, IDS, ids_stride, BOUNDS, bounds_stride,
            j, ADD, K, n, KEEP_MODE,
        )  # fmt: skip
        e = tl.where(keep, e, 0.0)
    tiles = j * N_TILES + tl.arange(0, N_TILES)
    real = tiles < n_tiles
    tl.store(S_OUT + i * n_tiles + tiles, tl.sum(tl.reshape(e, (N_TILES, TILE_W)), 1), mask=real)
    if SECOND == 1:
        b = tl.reshape(e * tl.maximum(y, LS_FLOOR), (N_TILES, TILE_W))
        tl.store(B_OUT + i * n_tiles + tiles, tl.sum(b, 1), mask=real)
    if SECOND == 2:
        tl.store(
            B_OUT + i * n_tiles + tiles, tl.sum(tl.reshape(e * e, (N_TILES, TILE_W)), 1), mask=real
        )


@triton.jit
def _kl_tile_kernel(
    XZ,
    Z_OFF,
    z_row_stride,
    z_col_stride,
    XR,
    R_OFF,
    r_row_stride,
    r_col_stride,
    n,
    n_load,
    TEMP,
    t_scalar,
    SHIFT_Z,
    SHIFT_R,
    LOG_SZ,
    LOG_SR,
    OUT,
    n_tiles,
    Z_HAS_OFF: tl.constexpr,
    R_HAS_OFF: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    PAD: tl.constexpr,
    TILE_W: tl.constexpr,
    N_TILES: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    z_start = _row_start(Z_OFF, i, z_row_stride, Z_HAS_OFF)
    r_start = _row_start(R_OFF, i, r_row_stride, R_HAS_OFF)
    T = _row_temperature(TEMP, i, t_scalar, TEMP_MODE)
    yz = _shifted_block(XZ, z_start, z_col_stride, n, n_load, T, tl.load(SHIFT_Z + i), j,
                        TEMP_MODE, PAD, N_TILES * TILE_W)  # fmt: skip
    yr = _shifted_block(XR, r_start, r_col_stride, n, n_load, T, tl.load(SHIFT_R + i), j,
                        TEMP_MODE, PAD, N_TILES * TILE_W)  # fmt: skip
    e = exp_ftz(yz)
    # One scalar load a line (the compile check reads two on a line as a narrow row stream).
    log_sz = tl.load(LOG_SZ + i)
    log_sr = tl.load(LOG_SR + i)
    d = (yz - yr) - (log_sz - log_sr)
    w = tl.where(e > 0.0, e * d, 0.0)
    tiles = j * N_TILES + tl.arange(0, N_TILES)
    tl.store(OUT + i * n_tiles + tiles, tl.sum(tl.reshape(w, (N_TILES, TILE_W)), 1),
             mask=tiles < n_tiles)  # fmt: skip


class _Rows:
    """The rows a kernel reads: base tensor, row offsets (or ``None``), strides, count."""

    def __init__(
        self,
        logits: torch.Tensor,
        row_index: torch.Tensor | None = None,
        narrow: tuple[int, int, int] | None = None,
    ):
        logits = int32_columns(logits)
        self.width = logits.shape[-1]
        self.off: torch.Tensor | None
        if row_index is not None:
            self.base, self.off = logits, row_index
            self.stride, self.col_stride = logits.stride(0), logits.stride(1)
            self.rows = row_index.numel()
        else:
            view = logits.narrow(*narrow) if narrow is not None else logits
            lay = row_layout(view)
            self.base, self.off = view, lay.offsets
            self.stride, self.col_stride, self.rows = lay.stride, lay.col_stride, lay.rows


def tile_sums(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    temperature: torch.Tensor | float | None,
    real: int,
    shift: torch.Tensor,
    second: int,
    restrict: KeptSet | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-tile ``Σ e^{z - M}`` and the ``second`` sum (``None`` for :data:`NONE`), ``(M, n)`` fp32.

    Rows as the logits passes select them (``row_index``, ``narrow``);
    ``shift``: ``(M,)`` fp32, the rows' global max of ``z``; ``real``: the
    columns that count. ``restrict``: a sampler's kept set, its thresholds
    found (:mod:`.kept_math`): the columns outside it add nothing.
    """
    rows = _Rows(logits, row_index, narrow)
    M, n, dev = rows.rows, tile_count(real), logits.device
    s = torch.zeros(M, n, dtype=torch.float32, device=dev)
    b = torch.zeros(M, n, dtype=torch.float32, device=dev) if second != NONE else None
    if M == 0 or real == 0:
        return s, b
    temp, _, mode = temperature_args(temperature, s)
    n_load = load_width(real, rows.width)
    shift = shift.to(torch.float32).contiguous()
    ka = kept_args(restrict, s, TILES * TILE, real)
    _tile_sums_kernel[(M, triton.cdiv(n, TILES))](
        rows.base,
        rows.off if rows.off is not None else s,
        rows.stride,
        rows.col_stride,
        real,
        n_load,
        temp,
        temperature_value(temperature),
        shift,
        s,
        b if b is not None else s,
        n,
        *ka.kernel_args(),
        HAS_OFF=rows.off is not None,
        TEMP_MODE=mode,
        SECOND=second,
        KEEP_MODE=ka.mode,
        PAD=n_load > real,
        TILE_W=TILE,
        N_TILES=TILES,
        # Replayed ids loop over each block's ids: on 4 warps (8 columns a thread) sm_90
        # spills there, on 8 it does not.
        num_warps=8 if ka.mode == KEEP_IDS else 4,
    )
    return s, b


def kl_tile_sums(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: torch.Tensor | float | None,
    real: int,
    shift: tuple[torch.Tensor, torch.Tensor],
    log_sums: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Per-tile ``Σ e^{z - M_z}·((z - M_z - log s_z) - (r - M_r - log s_r))``, ``(N, n)`` fp32.

    ``shift = (M_z, M_r)`` and ``log_sums = (log s_z, log s_r)``: ``(N,)``
    fp32 each, over the whole vocabulary.
    """
    zr, rr = _Rows(logits), _Rows(ref_logits)
    N, n, dev = zr.rows, tile_count(real), logits.device
    out = torch.zeros(N, n, dtype=torch.float32, device=dev)
    if N == 0 or real == 0:
        return out
    temp, _, mode = temperature_args(temperature, out)
    n_load = min(load_width(real, zr.width), load_width(real, rr.width))
    mz, mr, lz, lr = (v.to(torch.float32).contiguous() for v in (*shift, *log_sums))
    _kl_tile_kernel[(N, triton.cdiv(n, TILES))](
        zr.base,
        zr.off if zr.off is not None else out,
        zr.stride,
        zr.col_stride,
        rr.base,
        rr.off if rr.off is not None else out,
        rr.stride,
        rr.col_stride,
        real,
        n_load,
        temp,
        temperature_value(temperature),
        mz,
        mr,
        lz,
        lr,
        out,
        n,
        Z_HAS_OFF=zr.off is not None,
        R_HAS_OFF=rr.off is not None,
        TEMP_MODE=mode,
        PAD=n_load > real,
        TILE_W=TILE,
        N_TILES=TILES,
        num_warps=4,
    )
    return out
