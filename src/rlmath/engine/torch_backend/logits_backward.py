"""The backward pass over logits: the gradient of log-probs and entropy, chunk by chunk.

Each chunk is recomputed from the saved per-row log-sum-exp and turned into
its gradient (see :func:`rlmath.engine.stats.grad_coefficients`)::

    grad_j = p_j·(alpha + beta·ls_j) + Σ_k w_k·[j = label_k]

written straight into the gradient buffer: one read of the logits and one
write of the gradient per chunk, no tensor of the logits' size besides the
gradient itself.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from rlmath import _device
from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, Workspace
from rlmath.engine.torch_backend.reductions import scaled_shift
from rlmath.engine.torch_backend.rows import RowSource, real_columns

if TYPE_CHECKING:
    from rlmath.engine.sampling import KeptSet

__all__ = ["chunk_grad", "logits_grad"]

# Floor for log-probabilities in backward products: far below any log-prob whose
# probability is nonzero in fp32 or fp64 (exp(-746) underflows to 0 in fp64).
_LS_FLOOR = -1e4


def chunk_grad(
    src: torch.Tensor,
    ws: Workspace,
    out: torch.Tensor,
    *,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None = None,
    w: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    logp_only: bool = False,
    label_sign: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the gradient of one chunk into ``out``.

    ``p`` and ``ls`` are recomputed from the logits and the saved ``lse``. The
    gradient is formed in the compute dtype and rounded to ``out``'s dtype once,
    at the end. ``out`` may alias ``src`` (the fused head computes the logits
    block into a buffer and turns it into its gradient in place).

    Args:
        src: ``(c, V)`` raw logits, any floating dtype and strides.
        ws: scratch buffers (uses ``"y"`` and, when ``out`` is not in the compute
            dtype, ``"g"``).
        out: ``(c, V)`` destination, any floating dtype.
        lse: ``(c, 1)`` saved log-sum-exp of ``src / T``, compute dtype.
        alpha: ``(c, 1)``; beta: ``(c, 1)`` or ``None``; w: ``(c, K)`` or ``None``.
        labels: ``(c, K)`` int64 column indices, needed with ``w`` or ``logp_only``.
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` compute-dtype tensor.
        logp_only: the caller guarantees ``beta is None``, ``K == 1`` and
            ``w = -alpha`` at the labels this chunk holds; the gradient is then
            ``alpha·(p - onehot)``, formed with one pass fewer.
        label_sign: with ``logp_only``, ``(c, 1)``: ``-1`` where this chunk holds
            the row's label, ``0`` where it does not (another vocabulary shard
            holds it, or it is ignored); ``None``: ``-1`` everywhere.

    Returns:
        ``out``.
    """
    c = src.shape[0]
    direct = out.dtype == ws.dtype
    if logp_only:
        assert labels is not None
        work = out if direct else ws.get("y", c)
        p = scaled_shift(src, temperature, lse, work).exp_()
        # p - 1 at the label is exact (Sterbenz) when p >= 1/2: no cancellation later.
        sign = label_sign if label_sign is not None else _minus_ones(labels, p.dtype)
        p.scatter_add_(1, labels, sign)
        return torch.mul(p, alpha, out=out)
    work = out if direct else ws.get("g", c)
    ls = scaled_shift(src, temperature, lse, ws.get("y", c))
    p = torch.exp(ls, out=work)
    if beta is not None:
        # exp(-1e4) is exactly 0 in fp32 and fp64, so this clamp changes no p
        # but keeps alpha + ls·beta finite (clamping to finfo.min overflowed as
        # soon as |beta| > 1, and 0·inf made NaN at -inf logits).
        ls.clamp_min_(_LS_FLOOR)
        p.mul_(torch.addcmul(alpha, ls, beta, out=ls))
    else:
        p.mul_(alpha)
    if w is not None:
        assert labels is not None
        p.scatter_add_(1, labels, w)
    if not direct:
        out.copy_(p)
    return out


def _minus_ones(labels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((1, 1), -1.0, dtype=dtype, device=labels.device).expand(labels.shape)


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
    temperature: Temperature,
    dead: torch.Tensor | None,
    logp_only: bool,
    label_sign: torch.Tensor | None,
    real: int,
    chunk: int | None,
    restrict: KeptSet | None = None,
) -> torch.Tensor:
    """The gradient of the logits (their full shape; zero on unused rows and padding columns).

    Args:
        logits: ``(..., V)`` the saved raw logits.
        row_index, narrow: which rows were used (see :class:`RowSource`).
        lse: ``(M,)`` saved log-sum-exp; alpha ``(M, 1)``, beta ``(M, 1)`` or
            ``None``, w ``(M, K)`` or ``None``: the gradient coefficients.
        labels: ``(M, K)`` int64 column indices (with ``w`` or ``logp_only``).
        temperature: ``None``, a float or an ``(M,)`` compute-dtype tensor.
        dead: ``(M,)`` bool, rows whose gradient must be exactly 0 whatever their
            logits hold (ignored positions), or ``None``.
        logp_only, label_sign: see :func:`chunk_grad`.
        real: columns of ``logits`` that are real tokens.
        chunk: rows per chunk (``None``: the policy).
        restrict: the kept set of a truncating sampler (its saved thresholds):
            logits outside it count as ``-inf`` and get a zero gradient.
    """
    cdt, dev = lse.dtype, logits.device
    src = RowSource(logits, real, row_index, narrow)
    M = src.num_rows
    grad, dst = src.empty_grad()
    if M == 0 or real == 0:
        if dst is not None:
            for blk in dst.blocks:
                blk.zero_()
        return grad
    chunk = chunk or auto_chunk_size(real, M, device=dev)
    temp = TemperatureColumn(temperature, cdt, dev)
    lse_col = lse.unsqueeze(-1)
    # On a CPU only the chunks holding ignored rows are masked (reading `dead` on
    # the host costs nothing there); elsewhere every chunk is, without a host read.
    dead_col = dead.unsqueeze(-1) if dead is not None else None
    dead_rows = None
    if dead is not None and _device.reads_host(dev):
        dead_rows = torch.nonzero(dead).flatten().tolist()
    ranges = list(src.ranges(chunk, *((dst,) if dst is not None else ())))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        out = dst.get(a, b) if dst is not None else ws.get("gi", b - a, dtype=logits.dtype)
        rows, col = src.rows(a, b, ws), temp.rows(a, b)
        keep = None
        if restrict is not None:
            rows, keep, _, _ = restrict.chunk(a, b, rows, col, ws)
            col = None
        chunk_grad(
            rows,
            ws,
            out,
            lse=lse_col[a:b],
            alpha=alpha[a:b],
            beta=beta[a:b] if beta is not None else None,
            w=w[a:b] if w is not None else None,
            labels=labels[a:b] if labels is not None else None,
            temperature=col,
            logp_only=logp_only,
            label_sign=label_sign[a:b] if label_sign is not None else None,
        )
        if keep is not None:
            # Outside the kept set the probability is 0: so is the gradient. (Inside it the
            # probabilities use the kept set's log-sum-exp, at most 1, so the terms
            # computed outside before this zeroing are finite.)
            out.mul_(keep)  # keep: 1 / 0 (faster than masked_fill_ on CPUs)
        if dead_col is not None and (dead_rows is None or _any_in(dead_rows, a, b)):
            # An ignored row may hold NaN or inf logits: its gradient is an exact 0.
            out.masked_fill_(dead_col[a:b], 0)
        if src.index is not None:
            assert row_index is not None
            real_columns(grad, real).index_add_(0, row_index[a:b], out)

    # Rows may repeat in row_index: their sums must run in chunk order.
    scratch = lambda: Workspace(min(chunk, M), real, cdt, dev)  # noqa: E731
    run_chunks(ranges, one_chunk, scratch, dev, in_order=src.index is not None)
    return grad


def _any_in(sorted_rows: list[int], start: int, end: int) -> bool:
    i = bisect.bisect_left(sorted_rows, start)
    return i < len(sorted_rows) and sorted_rows[i] < end
