"""The fused LM head's forward pass: cuBLAS logits blocks, a Triton epilogue for the statistics.

For each vocabulary tile and each chunk of rows, the block ``hidden @
weight_tile.T (+ bias)`` is computed into one reused workspace
(:mod:`.head_blocks`); one Triton program per row then reads its part of the
block once and folds it into the row's running ``(m, s, t)`` (the same
online reduction as the logits kernel, started from the previous tiles'
statistics) and records the logits of the labels the tile holds. Only the
per-row statistics outlive a block. Same signature and results as
:func:`rlmath.engine.torch_backend.head_forward.head_stats`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlmath.engine.torch_backend.head_forward import head_stats as torch_head_stats
from rlmath.engine.triton_backend.head_blocks import (
    block_stride,
    logits_block,
    masked_hidden,
    spans,
    tile_spans,
)
from rlmath.engine.triton_backend.launch import (
    as_u8,
    block_config,
    on_input_device,
    temperature_args,
)
from rlmath.engine.triton_backend.row_math import inv_temperature, row_stats

__all__ = ["head_stats"]


@triton.jit
def _head_stats_kernel(
    Z,
    width,
    ld,
    r0,
    v0,
    M_RUN,
    S_RUN,
    T_RUN,
    Z_LAB,
    LAB,
    OWN,
    K,
    TEMP,
    inv_t_scalar,
    TEMP_MODE: tl.constexpr,
    WANT_T: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = r0 + pid
    zrow = Z + pid * ld  # ld: a multiple of 16 (aligned rows, 128-bit loads)
    inv_t = inv_temperature(TEMP, row, inv_t_scalar, TEMP_MODE)
    t0 = 0.0
    if WANT_T:
        t0 = tl.load(T_RUN + row)
    m, s, t = row_stats(
        zrow,
        1,
        width,
        ld,
        inv_t,
        tl.load(M_RUN + row),
        tl.load(S_RUN + row),
        t0,
        TEMP_MODE,
        WANT_T,
        PAD,
        BLOCK,
    )
    tl.store(M_RUN + row, m)
    tl.store(S_RUN + row, s)
    if WANT_T:
        tl.store(T_RUN + row, t)
    for k in range(0, K):
        lab = tl.load(LAB + row * K + k)
        pos = lab - v0
        inside = tl.where(tl.load(OWN + row * K + k) != 0, pos >= 0, False)
        inside = tl.where(pos < width, inside, False)
        z = tl.load(zrow + pos, mask=inside, other=0.0).to(tl.float32)
        if TEMP_MODE != 0:
            z = z * inv_t
        tl.store(Z_LAB + row * K + k, z, mask=inside)


@on_input_device
def head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    owned: torch.Tensor,
    live: torch.Tensor | None,
    temperature: torch.Tensor | float | None,
    want_entropy: bool,
    *,
    real: int,
    rows: int,
    tile: int,
    dtype: torch.dtype,
    scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(m, s, t, z_labels)`` of every row of the head's logits.

    Args as in :func:`rlmath.engine.torch_backend.head_forward.head_stats`
    (``rows``, ``tile``: the block, from :func:`.head_blocks.head_tiles`). An
    fp64 compute dtype, and scaled or soft-capped logits, run the pure-torch pass.
    """
    if dtype != torch.float32 or scale != 1.0 or softcap is not None:
        return torch_head_stats(
            hidden, weight, bias, labels, owned, live, temperature, want_entropy,
            real=real, rows=rows, tile=tile, dtype=dtype, scale=scale, softcap=softcap,
        )  # fmt: skip
    dev, N = hidden.device, hidden.shape[0]
    m = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    s = torch.zeros(N, dtype=dtype, device=dev)
    t = torch.zeros(N, dtype=dtype, device=dev) if want_entropy else None
    z = torch.zeros(labels.shape, dtype=dtype, device=dev)
    if N == 0 or real == 0:
        return m, s, t, z
    h = masked_hidden(hidden, live)
    lab, own = labels.contiguous(), as_u8(owned)
    K = lab.shape[-1]
    temp, inv_t, mode = temperature_args(temperature, m)
    tiles, chunks = tile_spans(real, tile), spans(N, rows)
    width = max(b - a for a, b in tiles)
    ws = torch.empty(
        max(b - a for a, b in chunks) * block_stride(width), dtype=hidden.dtype, device=dev
    )
    block, warps = block_config(width, hidden.element_size())
    for v0, v1 in tiles:
        for r0, r1 in chunks:
            blk = logits_block(ws, h[r0:r1], weight, bias, v0, v1)
            _head_stats_kernel[(r1 - r0,)](
                blk,
                v1 - v0,
                blk.stride(0),
                r0,
                v0,
                m,
                s,
                t if t is not None else m,
                z,
                lab,
                own,
                K,
                temp,
                inv_t,
                TEMP_MODE=mode,
                WANT_T=want_entropy,
                PAD=blk.stride(0) > v1 - v0,
                BLOCK=block,
                num_warps=warps,
            )
    return m, s, t, z
