"""The per-row math every Triton pass shares, as ``@triton.jit`` helpers.

Notation as in :mod:`rlmath.engine.torch_backend.reductions`: for one row of
raw logits ``x`` at temperature ``T`` (``z = x / T``, formed here as
``x · (1/T)`` in fp32), ``m = max z``, ``s = Σ exp(z - m)`` and
``t = Σ exp(z - m)·(z - m)``.

:func:`row_stats` is an *online* reduction: one pass over the row in blocks,
a running max ``m`` shared by the block's lanes and per-lane sums ``s``, ``t``
rescaled when ``m`` rises (``t' = e^{m - m'}·(t + (m - m')·s)``), so every
logit is read once and exponentiated once. The identity of the max is
``-inf``: a row (or the part read so far) without a finite logit has
``m = -inf`` and ``s = t = 0``, and no ``-inf - (-inf)`` is ever formed.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "exp_ftz",
    "grad_entries",
    "grad_of_block",
    "inv_temperature",
    "merge_block",
    "row_stats",
]

# exp(-1e4) is 0 in fp32: a floor for shifted logits and log-probs in products
# with their own exponential, so that 0·(-inf) never makes a NaN.
LS_FLOOR = tl.constexpr(-1e4)

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp_ftz(y):
    """``e^y`` as ``2^(y·log2 e)``, results below ``2^-126`` flushed to zero.

    ``tl.exp`` lowers to the same ``ex2.approx`` without flush-to-zero, which
    ptxas wraps in a range fix-up (a compare, two multiplies and a select):
    five instructions where ``tl.math.exp2`` (``ex2.approx.ftz.f32``) takes
    two with the multiply. The kernels are instruction-bound at HBM speed,
    so this matters; the lost subnormal results are below ``1.2e-38`` of a
    sum whose largest term is 1 (a softmax), far under the fp32 rounding.
    """
    return tl.math.exp2(y * LOG2E)


@triton.jit
def inv_temperature(TEMP, idx, inv_t, TEMP_MODE: tl.constexpr):
    """``1/T`` of row ``idx``: from the per-row tensor (mode 2), else the scalar ``inv_t``.

    Correctly rounded (``div_rn``, once per row), as the host's ``1.0 / T`` is.
    """
    if TEMP_MODE == 2:
        r = tl.math.div_rn(1.0, tl.load(TEMP + idx).to(tl.float32))
    else:
        r = inv_t
    return r


@triton.jit
def row_stats(
    ptr,
    col_stride,
    n,
    n_load,
    inv_t,
    m0,
    s0,
    t0,
    TEMP_MODE: tl.constexpr,
    WANT_T: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``(m, s, t)`` of the ``n`` columns at ``ptr`` merged into the running ``(m0, s0, t0)``.

    Start from ``(-inf, 0, 0)`` for a whole row; the fused head passes the
    statistics of the previous vocabulary tiles. ``t`` is 0 unless ``WANT_T``.
    The loads cover ``n_load >= n`` columns, all readable (``n`` rounded up to
    a multiple of 16 within the row: a mask at a multiple of 16 lets Triton
    read the row 128 bits at a time, one at ``n = 151665`` would not); with
    ``PAD`` (``n_load > n``) the columns past ``n`` are set to ``-inf`` after
    the load, whatever they hold.
    """
    cols = tl.arange(0, BLOCK)
    m = m0
    first = cols == 0
    s_vec = tl.where(first, s0, 0.0)
    t_vec = tl.where(first, t0, 0.0)
    for start in range(0, n, BLOCK):
        c = start + cols
        x = tl.load(ptr + c * col_stride, mask=c < n_load, other=float("-inf")).to(tl.float32)
        if PAD:
            x = tl.where(c < n, x, float("-inf"))
        if TEMP_MODE != 0:
            x = x * inv_t
        m, s_vec, t_vec = merge_block(x, m, s_vec, t_vec, WANT_T)
    return m, tl.sum(s_vec, 0), tl.sum(t_vec, 0)


@triton.jit
def merge_block(x, m, s_vec, t_vec, WANT_T: tl.constexpr):
    """The running ``(m, s_vec, t_vec)`` of :func:`row_stats` with one block ``x`` of scaled logits."""
    m_new = tl.maximum(m, tl.max(x, 0))
    if m_new > m:
        # The lanes' sums are relative to m: move them to m_new (a zero
        # scale where nothing was seen yet, m = -inf).
        scale = exp_ftz(m - m_new)
        if WANT_T:
            d = tl.where(m == float("-inf"), 0.0, m - m_new)
            t_vec = scale * (t_vec + d * s_vec)
        s_vec = s_vec * scale
        m = m_new
    y = x - tl.where(m == float("-inf"), 0.0, m)
    e = exp_ftz(y)
    s_vec += e
    if WANT_T:
        t_vec += e * tl.maximum(y, LS_FLOOR)
    return m, s_vec, t_vec


@triton.jit
def grad_entries(
    x,
    cols,
    lse,
    alpha,
    beta,
    inv_t,
    LAB,
    W,
    sign,
    K,
    col0,
    TEMP_MODE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_W: tl.constexpr,
    LOGP_ONLY: tl.constexpr,
):
    """The gradient entries of one block of a row, in fp32 (see :func:`rlmath.engine.stats.grad_coefficients`).

    ``grad_j = p_j·(alpha + beta·ls_j) + Σ_k w_k·[j = label_k]`` with
    ``p = exp(ls)``, ``ls = z - lse``; with ``LOGP_ONLY`` (one label, no
    entropy term, ``w = -alpha``) ``grad_j = alpha·(p_j + sign·[j = label])``.
    ``cols`` are the block's column indices, ``col0`` the global column of
    local column 0 (a fused-head tile), ``LAB`` and ``W`` point at the row's
    ``K`` labels and weights. A label this shard does not hold has weight 0
    (the engine's coefficients) and ``sign`` 0, so it adds nothing wherever
    its index points.
    """
    if TEMP_MODE != 0:
        x = x * inv_t
    ls = x - lse
    p = exp_ftz(ls)
    return grad_of_block(
        p, ls, cols, alpha, beta, LAB, W, sign, K, col0, HAS_BETA, HAS_W, LOGP_ONLY
    )


@triton.jit
def grad_of_block(
    p,
    ls,
    cols,
    alpha,
    beta,
    LAB,
    W,
    sign,
    K,
    col0,
    HAS_BETA: tl.constexpr,
    HAS_W: tl.constexpr,
    LOGP_ONLY: tl.constexpr,
):
    """:func:`grad_entries` from a block's probabilities ``p`` and log-probs ``ls``."""
    g_cols = cols + col0
    if LOGP_ONLY:
        lab = tl.load(LAB)
        # p - 1 at the label is exact (Sterbenz) when p >= 1/2.
        g = tl.where(g_cols == lab, p + sign, p) * alpha
    else:
        if HAS_BETA:
            g = p * (alpha + beta * tl.maximum(ls, LS_FLOOR))
        else:
            g = p * alpha
        if HAS_W:
            for k in range(0, K):
                g = tl.where(g_cols == tl.load(LAB + k), g + tl.load(W + k), g)
    return g
