"""The backward pass of the exact KL as one Triton kernel: gradients for both logits.

``∂KL/∂z = g·p·(ls_z - ls_r - KL)`` and ``∂KL/∂r = g·(q - p)`` per entry,
from the saved global log-sum-exps and KL of each row (``g`` the upstream
gradient already divided by ``T``). One read of each logits row, one write
of each gradient asked for (zeros past ``real``). Same signature and results
as :func:`rlmath.engine.torch_backend.kl_backward.kl_grad`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.kl_backward import kl_grad as torch_kl_grad
from rlmath.engine.triton_backend.launch import (
    block_config,
    int32_columns,
    load_width,
    on_input_device,
    row_layout,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import exp_ftz, inv_temperature

__all__ = ["kl_grad"]

# The fp32 floor of log-probabilities in the product (finfo(float32).min).
_FMIN = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _kl_grad_kernel(
    Z,
    Z_OFF,
    z_stride,
    z_col,
    R,
    R_OFF,
    r_stride,
    r_col,
    GZ,
    GR,
    n_real,
    n_load,
    n_cols,
    LSE_Z,
    LSE_R,
    KL,
    GRAD,
    TEMP,
    inv_t_scalar,
    Z_HAS_OFF: tl.constexpr,
    R_HAS_OFF: tl.constexpr,
    NEED_Z: tl.constexpr,
    NEED_R: tl.constexpr,
    TEMP_MODE: tl.constexpr,
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
    lse_z = tl.load(LSE_Z + i)
    lse_r = tl.load(LSE_R + i)
    kl = tl.load(KL + i)
    g = tl.load(GRAD + i)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        inside = c < n_real
        # Loads to n_load (128-bit loads); the entries past n_real are zeroed below.
        z = tl.load(zrow + c * z_col, mask=c < n_load, other=float("-inf")).to(tl.float32)
        r = tl.load(rrow + c * r_col, mask=c < n_load, other=float("-inf")).to(tl.float32)
        if TEMP_MODE != 0:
            z = z * inv_t
            r = r * inv_t
        lz = z - lse_z
        lr = r - lse_r
        p = exp_ftz(lz)
        if NEED_R:
            gr = tl.where(inside, (exp_ftz(lr) - p) * g, 0.0)
            tl.store(GR + i * n_cols + c, gr.to(GR.dtype.element_ty), mask=c < n_cols)
        if NEED_Z:
            # Floors as in the pure-torch pass (NaN stays NaN); p first, so that
            # p = 0 turns a huge finite difference into an exact 0 before g scales it.
            d = tl.where(lz < _FMIN, _FMIN, lz) - tl.where(lr < _FMIN, _FMIN, lr) - kl
            gz = tl.where(inside, (p * d) * g, 0.0)
            tl.store(GZ + i * n_cols + c, gz.to(GZ.dtype.element_ty), mask=c < n_cols)


@on_input_device
def kl_grad(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    lse_z: torch.Tensor,
    lse_r: torch.Tensor,
    kl: torch.Tensor,
    grad: torch.Tensor,
    temperature: torch.Tensor | float | None,
    need_z: bool,
    need_r: bool,
    real: int,
    chunk: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of both logits (their full shapes, contiguous; zero on padding columns).

    Args as in :func:`rlmath.engine.torch_backend.kl_backward.kl_grad`;
    ``chunk`` is not used. An fp64 compute dtype runs the pure-torch pass.
    """
    if kl.dtype != torch.float32:
        return torch_kl_grad(
            logits, ref_logits, lse_z=lse_z, lse_r=lse_r, kl=kl, grad=grad,
            temperature=temperature, need_z=need_z, need_r=need_r, real=real, chunk=chunk,
        )  # fmt: skip
    N, V = kl.shape[0], logits.shape[-1]
    empty = N == 0 or real == 0
    make = torch.zeros if empty else torch.empty
    gz = make(logits.shape, dtype=logits.dtype, device=logits.device) if need_z else None
    gr = make(ref_logits.shape, dtype=ref_logits.dtype, device=logits.device) if need_r else None
    if empty or (gz is None and gr is None):
        return gz, gr
    logits, ref_logits = int32_columns(logits), int32_columns(ref_logits)
    lz, lr = row_layout(logits), row_layout(ref_logits)
    temp, inv_t, mode = temperature_args(temperature, kl)
    elem = max(logits.element_size(), ref_logits.element_size())
    block, warps = block_config(V, elem, streams=2, per_thread=8)
    _kl_grad_kernel[(N,)](
        logits,
        lz.offsets if lz.offsets is not None else kl,
        lz.stride,
        lz.col_stride,
        ref_logits,
        lr.offsets if lr.offsets is not None else kl,
        lr.stride,
        lr.col_stride,
        gz if gz is not None else kl,
        gr if gr is not None else kl,
        real,
        min(load_width(real, V), load_width(real, ref_logits.shape[-1])),
        V,
        lse_z.contiguous(),
        lse_r.contiguous(),
        kl.contiguous(),
        grad.contiguous(),
        temp,
        inv_t,
        Z_HAS_OFF=lz.offsets is not None,
        R_HAS_OFF=lr.offsets is not None,
        NEED_Z=gz is not None,
        NEED_R=gr is not None,
        TEMP_MODE=mode,
        BLOCK=block,
        num_warps=warps,
    )
    return gz, gr
