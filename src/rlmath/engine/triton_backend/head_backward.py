"""The fused LM head's backward pass: recomputed blocks, a Triton kernel for their gradient, cuBLAS.

For each vocabulary tile and each chunk of rows, the logits block is
recomputed by cuBLAS and one Triton program per row overwrites its part of
the block with the gradient ``g`` (from the saved log-sum-exp: a tile needs
nothing from the others; zero on dead rows). Then cuBLAS forms
``grad_hidden[chunk] += g @ weight_tile`` (fp32 accumulation across tiles)
and ``grad_weight[tile] = g.T @ hidden`` (one matmul over all rows when they
fit in one chunk, else an fp32 accumulator of the tile), and
``grad_bias[tile] += Σ_rows g`` in fp32. No atomics: every sum runs in a
fixed order, so the results are deterministic. Same signature and results
as :func:`rlmath.engine.torch_backend.head_backward.head_grad`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.head_backward import head_grad as torch_head_grad
from rlmath.engine.triton_backend.head_blocks import (
    block_stride,
    logits_block,
    masked_hidden,
    matmul_into,
    spans,
    tile_spans,
)
from rlmath.engine.triton_backend.launch import (
    as_u8,
    block_config,
    on_input_device,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import grad_entries, inv_temperature

__all__ = ["head_grad"]


@triton.jit
def _head_grad_kernel(
    G,
    width,
    ld,
    r0,
    v0,
    LSE,
    ALPHA,
    BETA,
    W,
    LAB,
    K,
    TEMP,
    inv_t_scalar,
    LIVE,
    TEMP_MODE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = r0 + pid
    ptr = G + pid * ld  # ld: a multiple of 16 (aligned rows, 128-bit loads and stores)
    inv_t = inv_temperature(TEMP, row, inv_t_scalar, TEMP_MODE)
    lse = tl.load(LSE + row)
    alpha = tl.load(ALPHA + row)
    beta = 0.0
    if HAS_BETA:
        beta = tl.load(BETA + row)
    live = row >= 0
    if HAS_LIVE:
        live = tl.load(LIVE + row) != 0
    cols = tl.arange(0, BLOCK)
    # A dead row reads nothing. The loads and stores cover the ld >= width columns
    # of the row (the columns past width are the workspace's, zeroed here).
    n_read = tl.where(live, ld, 0)
    for start in range(0, width, BLOCK):
        c = start + cols
        inside = c < width
        x = tl.load(ptr + c, mask=c < n_read, other=float("-inf")).to(tl.float32)
        g = grad_entries(
            x, c, lse, alpha, beta, inv_t, LAB + row * K, W + row * K, -1.0, K, v0,
            TEMP_MODE, HAS_BETA, HAS_W, False,
        )  # fmt: skip
        g = tl.where(live & inside, g, 0.0)
        tl.store(ptr + c, g.to(G.dtype.element_ty), mask=c < ld)


@on_input_device
def head_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    owned: torch.Tensor,
    live: torch.Tensor | None,
    *,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    w: torch.Tensor | None,
    temperature: torch.Tensor | float | None,
    need: tuple[bool, bool, bool],
    grad_hidden_in_compute_dtype: bool,
    real: int,
    rows: int,
    tile: int,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden, grad_weight, grad_bias)``, each ``None`` unless ``need`` asks for it.

    Args as in :func:`rlmath.engine.torch_backend.head_backward.head_grad`.
    An fp64 compute dtype, and scaled or soft-capped logits, run the pure-torch pass.
    """
    cdt = lse.dtype
    if cdt != torch.float32 or scale != 1.0 or softcap is not None:
        return torch_head_grad(
            hidden, weight, bias, labels, owned, live, lse=lse, alpha=alpha, beta=beta, w=w,
            temperature=temperature, need=need,
            grad_hidden_in_compute_dtype=grad_hidden_in_compute_dtype, real=real, rows=rows,
            tile=tile, scale=scale, softcap=softcap,
        )  # fmt: skip
    need_h, need_w, need_b = need
    dev, (N, H) = hidden.device, hidden.shape
    tiles, chunks = tile_spans(real, tile), spans(N, rows)
    half = hidden.dtype != cdt
    acc_h = None
    if need_h:
        acc_h = torch.empty((N, H), dtype=cdt, device=dev)
        if not tiles:
            acc_h.zero_()
    grad_w = None
    if need_w:
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
        if not chunks:
            grad_w.zero_()
        elif real < weight.shape[0]:
            grad_w[real:].zero_()
    grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b else None
    if tiles and chunks and (need_h or need_w or need_b):
        h = masked_hidden(hidden, live)
        lab = labels.contiguous()
        K = lab.shape[-1]
        temp, inv_t, mode = temperature_args(temperature, lse)
        width = max(b - a for a, b in tiles)
        ws = torch.empty(
            max(b - a for a, b in chunks) * block_stride(width), dtype=hidden.dtype, device=dev
        )
        # Several row chunks: each weight tile's gradient is summed in fp32 first.
        acc_w = None
        if grad_w is not None and len(chunks) > 1 and weight.dtype != cdt:
            acc_w = torch.empty((width, H), dtype=cdt, device=dev)
        block, warps = block_config(width, hidden.element_size())
        lse_c, alpha_c = lse.contiguous(), alpha.contiguous()
        beta_c = beta.contiguous() if beta is not None else lse_c
        w_c = w.contiguous() if w is not None else lse_c
        live_u8 = as_u8(live) if live is not None else lse_c
        for k, (v0, v1) in enumerate(tiles):
            w_tile = weight[v0:v1]
            for j, (r0, r1) in enumerate(chunks):
                g = logits_block(ws, h[r0:r1], weight, bias, v0, v1)
                _head_grad_kernel[(r1 - r0,)](
                    g, v1 - v0, g.stride(0), r0, v0, lse_c, alpha_c, beta_c, w_c, lab, K, temp, inv_t,
                    live_u8, TEMP_MODE=mode, HAS_BETA=beta is not None, HAS_W=w is not None,
                    HAS_LIVE=live is not None, BLOCK=block, num_warps=warps,
                )  # fmt: skip
                if acc_h is not None:
                    matmul_into(acc_h[r0:r1], g, w_tile, accumulate=k > 0)
                if grad_w is not None:
                    if acc_w is None:
                        matmul_into(grad_w[v0:v1], g.T, h[r0:r1], accumulate=j > 0)
                    else:
                        matmul_into(acc_w[: v1 - v0], g.T, h[r0:r1], accumulate=j > 0)
                if grad_b is not None:
                    grad_b[v0:v1] += g.sum(0, dtype=cdt)
            if acc_w is not None and grad_w is not None:
                grad_w[v0:v1].copy_(acc_w[: v1 - v0])
    grad_h = None
    if acc_h is not None:
        grad_h = acc_h if grad_hidden_in_compute_dtype or not half else acc_h.to(hidden.dtype)
    if grad_b is not None and bias is not None and bias.dtype != cdt:
        grad_b = grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b
