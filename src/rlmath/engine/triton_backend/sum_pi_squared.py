"""``Σ_v π_v²`` statistics as one Triton kernel (no gradient).

One read of each row: the running max ``m``, per-lane ``s = Σ e^{z-m}`` and
``u = Σ e^{2(z-m)}`` (rescaled by ``e^{m-m'}`` and its square when the max
rises). Same signature and results as
:func:`rlmath.engine.torch_backend.sum_pi_squared.pi_squared_stats`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.sum_pi_squared import pi_squared_stats as torch_pi_squared
from rlmath.engine.triton_backend.launch import (
    block_config,
    int32_columns,
    load_width,
    on_input_device,
    row_layout,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import exp_ftz, inv_temperature
from rlmath.engine.triton_backend.tile_sums import SQUARES, tile_sums

__all__ = ["pi_squared_stats"]


@triton.jit
def _pi_squared_kernel(
    X,
    OFF,
    row_stride,
    col_stride,
    n,
    n_load,
    TEMP,
    inv_t_scalar,
    M_OUT,
    S_OUT,
    U_OUT,
    HAS_OFF: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if HAS_OFF:
        row = X + tl.load(OFF + i).to(tl.int64) * row_stride
    else:
        row = X + i * row_stride
    inv_t = inv_temperature(TEMP, i, inv_t_scalar, TEMP_MODE)
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([1], float("-inf"), tl.float32), 0)
    s = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        c = start + cols
        # Loads to n_load (a multiple of 16 where the row has it: 128-bit loads).
        x = tl.load(row + c * col_stride, mask=c < n_load, other=float("-inf")).to(tl.float32)
        if PAD:
            x = tl.where(c < n, x, float("-inf"))
        if TEMP_MODE != 0:
            x = x * inv_t
        m_new = tl.maximum(m, tl.max(x, 0))
        if m_new > m:
            scale = exp_ftz(m - m_new)
            s = s * scale
            u = u * (scale * scale)
            m = m_new
        e = exp_ftz(x - tl.where(m == float("-inf"), 0.0, m))
        s += e
        u += e * e
    tl.store(M_OUT + i, m)
    tl.store(S_OUT + i, tl.sum(s, 0))
    tl.store(U_OUT + i, tl.sum(u, 0))


@on_input_device
def pi_squared_stats(
    logits: torch.Tensor,
    temperature: torch.Tensor | float | None,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, s, u)`` per row; ``Σ π² = u / s²`` (``m = -inf, s = u = 0`` without a finite logit).

    ``chunk`` is not used. An fp64 compute dtype runs the pure-torch pass.
    ``shift``: ``(N,)`` the rows' max over every vocabulary shard; ``s`` and
    ``u`` then come per 128-column tile (:func:`.tile_sums.tile_sums`).
    """
    if dtype != torch.float32:
        return torch_pi_squared(logits, temperature, real, chunk, dtype, shift=shift)
    if shift is not None:
        s_tiles, u_tiles = tile_sums(logits, None, None, temperature, real, shift, SQUARES)
        assert u_tiles is not None
        return shift.to(dtype).clone(), s_tiles, u_tiles
    dev = logits.device
    logits = int32_columns(logits)
    lay = row_layout(logits)
    N = lay.rows
    m = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    s = torch.zeros(N, dtype=dtype, device=dev)
    u = torch.zeros(N, dtype=dtype, device=dev)
    if N == 0 or real == 0:
        return m, s, u
    temp, inv_t, mode = temperature_args(temperature, m)
    block, warps = block_config(real, logits.element_size())
    n_load = load_width(real, logits.shape[-1])
    _pi_squared_kernel[(N,)](
        logits,
        lay.offsets if lay.offsets is not None else m,
        lay.stride,
        lay.col_stride,
        real,
        n_load,
        temp,
        inv_t,
        m,
        s,
        u,
        HAS_OFF=lay.offsets is not None,
        TEMP_MODE=mode,
        PAD=n_load > real,
        BLOCK=block,
        num_warps=warps,
    )
    return m, s, u
