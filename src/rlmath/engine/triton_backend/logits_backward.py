"""The backward pass over logits as one Triton kernel: one read of the logits, one write of the gradient.

Each program recomputes ``p`` and ``ls`` of one row from the saved
log-sum-exp and writes the row's gradient
(:func:`~.row_math.grad_entries`), zeros on the padding columns past
``real``; a dead row (an ignored position) reads nothing and gets exact
zeros whatever its logits hold. Same signature and results as
:func:`rlmath.engine.torch_backend.logits_backward.logits_grad`.

Rows picked by ``row_index`` (the packed response functions) may repeat or
be left out: the picks are sorted by row on the device, and one program per
row of the logits sums the gradients of that row's picks in a fixed order
and writes the row once (zeros for a row nobody picks, without reading it),
so the result is deterministic, needs no atomics, and the gradient is
written once, never zero-filled first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.logits_backward import logits_grad as torch_logits_grad
from rlmath.engine.triton_backend.kept_math import (
    kept_args,
    kept_block,
    scaled,
    temperature_value,
)
from rlmath.engine.triton_backend.launch import (
    as_u8,
    block_config,
    int32_columns,
    load_width,
    on_input_device,
    row_layout,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import (
    exp_ftz,
    grad_entries,
    grad_of_block,
    inv_temperature,
)

if TYPE_CHECKING:
    from rlmath.engine.sampling import KeptSet

__all__ = ["logits_grad"]


@triton.jit
def _member_grad(
    x,
    cols,
    idx,
    LSE,
    ALPHA,
    BETA,
    W,
    LAB,
    K,
    SIGN,
    TEMP,
    inv_t_scalar,
    t_scalar,
    n_real,
    block_index,
    TAU,
    MASK,
    mask_stride,
    IDS,
    ids_stride,
    BOUNDS,
    bounds_stride,
    ADD,
    K_ADD,
    TEMP_MODE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_W: tl.constexpr,
    LOGP_ONLY: tl.constexpr,
    HAS_SIGN: tl.constexpr,
    KEEP_MODE: tl.constexpr,
):
    beta = 0.0
    if HAS_BETA:
        beta = tl.load(BETA + idx)
    sign = -1.0
    if HAS_SIGN:
        sign = tl.load(SIGN + idx)
    if KEEP_MODE != 0:
        # A sampler's kept set: probabilities 0 outside it, the logits scaled by the
        # division its threshold search used.
        T = t_scalar
        if TEMP_MODE == 2:
            T = tl.load(TEMP + idx).to(tl.float32)
        z = scaled(x, T, TEMP_MODE)
        keep = kept_block(
            z, cols, idx, TAU, MASK, mask_stride, IDS, ids_stride, BOUNDS, bounds_stride,
            block_index, ADD, K_ADD, n_real, KEEP_MODE,
        )  # fmt: skip
        ls = z - tl.load(LSE + idx)
        p = tl.where(keep, exp_ftz(ls), 0.0)
        return grad_of_block(
            p, ls, cols, tl.load(ALPHA + idx), beta, LAB + idx * K, W + idx * K, sign, K, 0,
            HAS_BETA, HAS_W, LOGP_ONLY,
        )  # fmt: skip
    inv_t = inv_temperature(TEMP, idx, inv_t_scalar, TEMP_MODE)
    return grad_entries(
        x,
        cols,
        tl.load(LSE + idx),
        tl.load(ALPHA + idx),
        beta,
        inv_t,
        LAB + idx * K,
        W + idx * K,
        sign,
        K,
        0,
        TEMP_MODE,
        HAS_BETA,
        HAS_W,
        LOGP_ONLY,
    )


@triton.jit
def _logits_grad_kernel(
    X,
    SRC,
    src_stride,
    col_stride,
    G,
    DST,
    dst_stride,
    n_real,
    n_load,
    n_cols,
    LSE,
    ALPHA,
    BETA,
    W,
    LAB,
    K,
    SIGN,
    TEMP,
    inv_t_scalar,
    t_scalar,
    DEAD,
    ORDER,
    START,
    END,
    TAU,
    MASK,
    mask_stride,
    IDS,
    ids_stride,
    BOUNDS,
    bounds_stride,
    ADD,
    K_ADD,
    HAS_SRC: tl.constexpr,
    HAS_DST: tl.constexpr,
    GROUPED: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_W: tl.constexpr,
    LOGP_ONLY: tl.constexpr,
    HAS_SIGN: tl.constexpr,
    HAS_DEAD: tl.constexpr,
    KEEP_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if GROUPED:
        # Row i of the logits: its picks are ORDER[START[i]:END[i]] (none: a row of zeros).
        j0 = tl.load(START + i)
        j_end = tl.load(END + i)
        src = i * src_stride
        dst = i * dst_stride
        live = j_end > j0
    else:
        if HAS_SRC:
            src = tl.load(SRC + i).to(tl.int64) * src_stride
        else:
            src = i * src_stride
        if HAS_DST:
            dst = tl.load(DST + i).to(tl.int64) * dst_stride
        else:
            dst = i * dst_stride
        live = i >= 0
        if HAS_DEAD:
            live = tl.load(DEAD + i) == 0
    # A dead row (or one nobody picks) reads nothing (an empty column range): its
    # gradient is an exact 0 whatever its logits hold. The loads cover n_load >= n_real
    # columns (a multiple of 16 where the row has them: 128-bit loads); the entries
    # past n_real are zeroed below whatever was read there.
    n_read = tl.where(live, n_load, 0)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        inside = c < n_real
        x = tl.load(X + src + c * col_stride, mask=c < n_read, other=float("-inf"))
        x = x.to(tl.float32)
        if GROUPED:
            g = tl.zeros([BLOCK], tl.float32)
            for j in range(j0, j_end):
                idx = tl.load(ORDER + j).to(tl.int64)
                gj = _member_grad(
                    x, c, idx, LSE, ALPHA, BETA, W, LAB, K, SIGN, TEMP, inv_t_scalar,
                    t_scalar, n_real, start // BLOCK, TAU, MASK, mask_stride, IDS, ids_stride,
                    BOUNDS, bounds_stride, ADD, K_ADD,
                    TEMP_MODE, HAS_BETA, HAS_W, LOGP_ONLY, HAS_SIGN, KEEP_MODE,
                )  # fmt: skip
                if HAS_DEAD:
                    gj = tl.where(tl.load(DEAD + idx) != 0, 0.0, gj)
                g += gj
        else:
            g = _member_grad(
                x, c, i, LSE, ALPHA, BETA, W, LAB, K, SIGN, TEMP, inv_t_scalar,
                t_scalar, n_real, start // BLOCK, TAU, MASK, mask_stride, IDS, ids_stride,
                BOUNDS, bounds_stride, ADD, K_ADD,
                TEMP_MODE, HAS_BETA, HAS_W, LOGP_ONLY, HAS_SIGN, KEEP_MODE,
            )  # fmt: skip
            g = tl.where(live, g, 0.0)
        g = tl.where(inside, g, 0.0)
        tl.store(G + dst + c, g.to(G.dtype.element_ty), mask=c < n_cols)


@on_input_device
def logits_grad(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    *,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    w: torch.Tensor | None,
    labels: torch.Tensor | None,
    temperature: torch.Tensor | float | None,
    dead: torch.Tensor | None,
    logp_only: bool,
    label_sign: torch.Tensor | None,
    real: int,
    chunk: int | None,
    restrict: KeptSet | None = None,
) -> torch.Tensor:
    """The gradient of the logits (their shape and dtype; zero on unused rows and padding columns).

    Args as in :func:`rlmath.engine.torch_backend.logits_backward.logits_grad`
    (``restrict``: a kept set with its thresholds found in forward);
    ``chunk`` is not used. An fp64 compute dtype runs the pure-torch pass.
    """
    if lse.dtype != torch.float32:
        return torch_logits_grad(
            logits, row_index, narrow, lse=lse, alpha=alpha, beta=beta, w=w, labels=labels,
            temperature=temperature, dead=dead, logp_only=logp_only, label_sign=label_sign,
            real=real, chunk=chunk, restrict=restrict,
        )  # fmt: skip
    V = logits.shape[-1]
    M = lse.shape[0]
    grouped = row_index is not None
    if M == 0 or real == 0:
        return torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    # The kernel writes every row it covers in full (zeros past `real`, and on
    # unpicked rows of a packed selection): no zero-fill of those rows first.
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if not grouped and narrow is not None:
        dim, start, length = narrow
        grad.narrow(dim, 0, start).zero_()
        grad.narrow(dim, start + length, logits.shape[dim] - start - length).zero_()
    lse = lse.contiguous()
    source = int32_columns(logits)
    lab = labels.contiguous() if labels is not None else None
    K = lab.shape[-1] if lab is not None else 0
    temp, inv_t, mode = temperature_args(temperature, lse)
    dummy = lse
    order = first = end = dummy
    src: torch.Tensor | None
    dst: torch.Tensor | None
    programs = M
    if grouped:
        assert row_index is not None
        order = torch.argsort(row_index, stable=True)
        rows = row_index[order]
        programs = logits.shape[0]
        every = torch.arange(programs, device=rows.device, dtype=rows.dtype)
        # The run of row r in the sorted picks: [first[r], end[r]) (empty when unpicked).
        first = torch.searchsorted(rows, every)
        end = torch.searchsorted(rows, every, right=True)
        src, src_stride, col_stride = None, source.stride(0), source.stride(1)
        dst, dst_stride = None, grad.stride(0)
        x_base, g_base = source, grad
    else:
        view = source.narrow(*narrow) if narrow is not None else source
        gview = grad.narrow(*narrow) if narrow is not None else grad
        src_lay, dst_lay = row_layout(view), row_layout(gview)
        src, src_stride, col_stride = src_lay.offsets, src_lay.stride, src_lay.col_stride
        dst, dst_stride = dst_lay.offsets, dst_lay.stride
        x_base, g_base = view, gview  # the offsets count from the views' first elements
    if grouped:  # the summed gradient is one more value per column: half the block
        block, warps = block_config(V, logits.element_size(), streams=2, per_thread=8)
    else:
        block, warps = block_config(V, logits.element_size())
    ka = kept_args(restrict, lse, block, V)
    _logits_grad_kernel[(programs,)](
        x_base,
        src if src is not None else dummy,
        src_stride,
        col_stride,
        g_base,
        dst if dst is not None else dummy,
        dst_stride,
        real,
        load_width(real, V),
        V,
        lse,
        alpha.contiguous(),
        beta.contiguous() if beta is not None else dummy,
        w.contiguous() if w is not None else dummy,
        lab if lab is not None else dummy,
        K,
        label_sign.contiguous() if label_sign is not None else dummy,
        temp,
        inv_t,
        temperature_value(temperature),
        as_u8(dead) if dead is not None else dummy,
        order,
        first,
        end,
        *ka.kernel_args(),
        HAS_SRC=src is not None,
        HAS_DST=dst is not None,
        GROUPED=grouped,
        TEMP_MODE=mode,
        HAS_BETA=beta is not None,
        HAS_W=w is not None,
        LOGP_ONLY=bool(logp_only) and lab is not None,
        HAS_SIGN=label_sign is not None,
        HAS_DEAD=dead is not None,
        KEEP_MODE=ka.mode,
        BLOCK=block,
        num_warps=warps,
    )
    return grad
