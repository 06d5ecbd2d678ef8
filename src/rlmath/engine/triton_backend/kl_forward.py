"""The forward pass of the exact KL as one Triton kernel: one read of each logits row.

One program per row reads the policy and reference logits together in
blocks, with a running max for each (shared by the block's lanes) and
per-lane sums ``s_z = Σ e^{z-m_z}``, ``s_r = Σ e^{r-m_r}`` and
``a = Σ e^{z-m_z}·((z - m_z) - (r - m_r))``, rescaled when a max rises. Then
``KL = a / s_z - (log s_z - log s_r)``: the sum ``Σ p·(ls_z - ls_r)`` with the
normalizations applied once per row, whose cancellation costs at most a few
ulps of ``log V`` (``|log s_z - log s_r| <= log V``). Same signature,
results and edge cases as :func:`rlmath.engine.torch_backend.kl_forward.kl_stats`
(``KL = +inf`` where the policy has mass the reference lacks, ``0`` for a
row without policy mass, NaN for a NaN logit, clamped at 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.kl_forward import kl_stats as torch_kl_stats
from rlmath.engine.triton_backend.launch import (
    block_config,
    int32_columns,
    load_width,
    on_input_device,
    row_layout,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import exp_ftz, inv_temperature
from rlmath.engine.triton_backend.tile_sums import NONE, kl_tile_sums, tile_sums

__all__ = ["kl_stats"]


@triton.jit
def _kl_stats_kernel(
    Z,
    Z_OFF,
    z_stride,
    z_col,
    R,
    R_OFF,
    r_stride,
    r_col,
    n,
    n_load,
    TEMP,
    inv_t_scalar,
    KL_OUT,
    LSE_Z,
    LSE_R,
    Z_HAS_OFF: tl.constexpr,
    R_HAS_OFF: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    if Z_HAS_OFF:
        zrow = Z + tl.load(Z_OFF + i).to(tl.int64) * z_stride
    else:
        zrow = Z + i * z_stride
    if R_HAS_OFF:
        rrow = R + tl.load(R_OFF + i).to(tl.int64) * r_stride
    else:
        rrow = R + i * r_stride
    inv_t = inv_temperature(TEMP, i, inv_t_scalar, TEMP_MODE)
    cols = tl.arange(0, BLOCK)
    neg_inf = tl.max(tl.full([1], float("-inf"), tl.float32), 0)
    mz = neg_inf
    mr = neg_inf
    sz = tl.zeros([BLOCK], tl.float32)
    sr = tl.zeros([BLOCK], tl.float32)
    a = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        c = start + cols
        # Loads to n_load (a multiple of 16 where the rows have it: 128-bit loads).
        z = tl.load(zrow + c * z_col, mask=c < n_load, other=float("-inf")).to(tl.float32)
        r = tl.load(rrow + c * r_col, mask=c < n_load, other=float("-inf")).to(tl.float32)
        if PAD:
            z = tl.where(c < n, z, float("-inf"))
            r = tl.where(c < n, r, float("-inf"))
        if TEMP_MODE != 0:
            z = z * inv_t
            r = r * inv_t
        mz_new = tl.maximum(mz, tl.max(z, 0))
        mr_new = tl.maximum(mr, tl.max(r, 0))
        if (mz_new > mz) | (mr_new > mr):
            # a is relative to (mz, mr): a' = e^{dz}·(a + s_z·(dz - dr)), d = m - m_new
            # (0 where nothing was seen yet: s_z and a are 0 there).
            dz = tl.where(mz == float("-inf"), 0.0, mz - mz_new)
            dr = tl.where(mr == float("-inf"), 0.0, mr - mr_new)
            scale_z = exp_ftz(mz - mz_new)
            scale_r = tl.where(mr_new > mr, exp_ftz(mr - mr_new), 1.0)
            scale_z = tl.where(mz_new > mz, scale_z, 1.0)
            a = scale_z * (a + sz * (dz - dr))
            sz = sz * scale_z
            sr = sr * scale_r
            mz = mz_new
            mr = mr_new
        yz = z - tl.where(mz == float("-inf"), 0.0, mz)
        yr = r - tl.where(mr == float("-inf"), 0.0, mr)
        ez = exp_ftz(yz)
        sz += ez
        sr += exp_ftz(yr)
        # p = 0 contributes 0 even where both logits are -inf (no 0·inf or inf - inf).
        a += tl.where(ez == 0.0, 0.0, ez * (yz - yr))
    s_z = tl.sum(sz, 0)
    s_r = tl.sum(sr, 0)
    log_sz = tl.log(s_z)
    log_sr = tl.log(s_r)
    shift = log_sz - log_sr
    kl = tl.math.div_rn(tl.sum(a, 0), s_z) - shift
    kl = tl.where(kl < 0.0, 0.0, kl)  # rounding can leave a hair below 0 (NaN stays NaN)
    dead_z = mz == float("-inf")
    dead_r = mr == float("-inf")
    kl = tl.where(dead_r & (mz > float("-inf")), float("inf"), kl)
    kl = tl.where(dead_z, 0.0, kl)
    # A NaN logit only reaches a log-sum: keep it visible.
    kl = tl.where(shift != shift, shift, kl)
    tl.store(KL_OUT + i, kl)
    tl.store(LSE_Z + i, tl.where(dead_z, float("-inf"), mz + log_sz))
    tl.store(LSE_R + i, tl.where(dead_r, float("-inf"), mr + log_sr))


@on_input_device
def kl_stats(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: torch.Tensor | float | None,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    *,
    shift: tuple[torch.Tensor, torch.Tensor] | None = None,
    log_sums: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(KL, lse_z, lse_r)`` of every row (only the first ``real`` columns), ``(N,)`` each.

    Args as in :func:`rlmath.engine.torch_backend.kl_forward.kl_stats`;
    ``chunk`` is not used. An fp64 compute dtype (an fp64 input) runs the
    pure-torch pass. ``shift``, ``log_sums``: the two phases of a shard on the
    tile grid, with sums per 128-column tile (:mod:`.tile_sums`).
    """
    if shift is not None and dtype == torch.float32:
        if log_sums is None:
            s_z, _ = tile_sums(logits, None, None, temperature, real, shift[0], NONE)
            s_r, _ = tile_sums(ref_logits, None, None, temperature, real, shift[1], NONE)
            return s_z, s_r
        return (kl_tile_sums(logits, ref_logits, temperature, real, shift, log_sums),)
    if shift is not None:
        return torch_kl_stats(
            logits, ref_logits, temperature, real, chunk, dtype, shift=shift, log_sums=log_sums
        )
    if dtype != torch.float32:
        kl, lse_z, lse_r = torch_kl_stats(logits, ref_logits, temperature, real, chunk, dtype)
        return kl, lse_z, lse_r
    dev = logits.device
    logits, ref_logits = int32_columns(logits), int32_columns(ref_logits)
    lz, lr = row_layout(logits), row_layout(ref_logits)
    N = lz.rows
    kl = torch.zeros(N, dtype=dtype, device=dev)
    lse_z = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    lse_r = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    if N == 0 or real == 0:
        return kl, lse_z, lse_r
    temp, inv_t, mode = temperature_args(temperature, kl)
    elem = max(logits.element_size(), ref_logits.element_size())
    block, warps = block_config(real, elem, streams=2, per_thread=8)
    n_load = min(load_width(real, logits.shape[-1]), load_width(real, ref_logits.shape[-1]))
    _kl_stats_kernel[(N,)](
        logits,
        lz.offsets if lz.offsets is not None else kl,
        lz.stride,
        lz.col_stride,
        ref_logits,
        lr.offsets if lr.offsets is not None else kl,
        lr.stride,
        lr.col_stride,
        real,
        n_load,
        temp,
        inv_t,
        kl,
        lse_z,
        lse_r,
        Z_HAS_OFF=lz.offsets is not None,
        R_HAS_OFF=lr.offsets is not None,
        TEMP_MODE=mode,
        PAD=n_load > real,
        BLOCK=block,
        num_warps=warps,
    )
    return kl, lse_z, lse_r
