"""Chunked autograd functions (the pure-torch backend).

Each function loops over chunks of rows, upcasting one chunk at a time, saves
only its inputs plus an fp32 log-sum-exp (and entropy) per row, and in
backward recomputes each chunk and writes its gradient straight into the
gradient buffer. No tensor of the logits' size is allocated besides that
gradient.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from rlmath.logprobs._blocks import TemperatureColumn
from rlmath.logprobs._kernels import (
    Workspace,
    chunk_grad,
    chunk_kl_forward,
    chunk_kl_grad,
    chunk_stats,
    finish_stats,
    grad_coefficients,
)

__all__ = ["KLFromLogitsFn", "LogProbsEntropyFn", "RowBlocks", "chunk_ranges"]

Temperature = torch.Tensor | float | None


class RowBlocks:
    """The rows of a ``(..., V)`` tensor as 2-D views, without copying.

    A tensor whose leading dims cannot be merged into one (say
    ``logits[:, -R - 1 : -1]`` of a ``(B, S, V)`` tensor) is split into the
    fewest 2-D views that can; ``get(start, end)`` returns flat rows
    ``[start, end)`` as a view, provided they lie in one block (see
    :func:`chunk_ranges`).
    """

    def __init__(self, x: torch.Tensor):
        self.blocks = _blocks(x) if x.numel() else []
        self.starts: list[int] = []
        n = 0
        for b in self.blocks:
            self.starts.append(n)
            n += b.shape[0]
        self.num_rows = n

    def get(self, start: int, end: int) -> torch.Tensor:
        if len(self.blocks) == 1:
            return self.blocks[0][start:end]
        i = bisect.bisect_right(self.starts, start) - 1
        off = self.starts[i]
        return self.blocks[i][start - off : end - off]


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:
        return [b for i in range(x.shape[0]) for b in _blocks(x[i])]


def chunk_ranges(num_rows: int, chunk: int, *layouts: RowBlocks) -> Iterator[tuple[int, int]]:
    """``(start, end)`` row ranges of at most ``chunk`` rows, never crossing a block boundary."""
    cuts = sorted({0, num_rows, *(s for lay in layouts for s in lay.starts)})
    for lo, hi in itertools.pairwise(cuts):
        for start in range(lo, hi, chunk):
            yield start, min(start + chunk, hi)


Rows = torch.Tensor | tuple[int, int, int] | None
"""Which rows of the logits to use: all (``None``), ``(dim, start, length)`` (a
``narrow`` of a batch dim), or an int64 index tensor into the rows of 2-D logits."""


class _Source:
    """Where chunk rows come from, and where their gradient goes."""

    def __init__(self, logits: torch.Tensor, rows: Rows):
        self.logits = logits
        self.index = rows if isinstance(rows, torch.Tensor) else None
        self.narrow = rows if isinstance(rows, tuple) else None
        self.view = logits.narrow(*self.narrow) if self.narrow is not None else logits
        self.layout = RowBlocks(self.view) if self.index is None else None
        self.num_rows = self.index.numel() if self.index is not None else self.layout.num_rows  # type: ignore[union-attr]

    def ranges(self, chunk: int, *others: RowBlocks) -> Iterator[tuple[int, int]]:
        layouts = (self.layout, *others) if self.layout is not None else others
        return chunk_ranges(self.num_rows, chunk, *layouts)

    def rows(self, start: int, end: int, ws: Workspace) -> torch.Tensor:
        if self.index is None:
            return self.layout.get(start, end)  # type: ignore[union-attr]
        buf = ws.get("src", end - start, dtype=self.logits.dtype)
        return torch.index_select(self.logits, 0, self.index[start:end], out=buf)

    def empty_grad(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of the whole logits and the part of it the rows map to.

        Rows that are not used get zeros; the used part is left uninitialized
        (every chunk writes its rows), except with an index, which accumulates.
        """
        x = self.logits
        if self.index is not None:
            grad = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
            return grad, grad
        grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if self.narrow is None:
            return grad, grad
        dim, start, length = self.narrow
        grad.narrow(dim, 0, start).zero_()
        grad.narrow(dim, start + length, x.shape[dim] - start - length).zero_()
        return grad, grad.narrow(dim, start, length)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class LogProbsEntropyFn(torch.autograd.Function):
    """Label log-probs and/or entropy of ``logits / T``, chunked over rows.

    Inputs (positional, as ``apply`` needs them):
        logits: ``(..., V)`` any floating dtype and strides.
        labels: ``(M, K)`` int64 or ``None`` (no log-probs).
        temperature: ``None``, float or ``(M,)`` tensor in the compute dtype.
        want_entropy: bool.
        chunk: rows per chunk.
        rows: ``None`` (every row of ``logits``, in order), ``(dim, start, length)``
            (the rows of ``logits.narrow(dim, start, length)``, a batch dim) or an
            ``(M,)`` int64 tensor of rows of 2-D ``logits``. The gradient always
            has the shape of ``logits`` (zeros on unused rows), so a caller never
            slices the logits outside (a slice's backward would allocate a second
            full-size gradient).

    Outputs: ``(logp (M, K), entropy (M,))`` in the compute dtype (fp64 for fp64
    logits, else fp32); an output that was not asked for is an empty tensor.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        temperature: Temperature,
        want_entropy: bool,
        chunk: int,
        rows: Rows,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        cdt = _compute_dtype(logits)
        dev, V = logits.device, logits.shape[-1]
        src = _Source(logits, rows)
        M = src.num_rows
        temp = TemperatureColumn(temperature, cdt, dev)
        ws = Workspace(min(chunk, max(M, 1)), V, cdt, dev)
        m = torch.empty(M, dtype=cdt, device=dev)
        s = torch.empty(M, dtype=cdt, device=dev)
        t = torch.empty(M, dtype=cdt, device=dev) if want_entropy else None
        y_lab = (
            torch.empty(M, labels.shape[-1], dtype=cdt, device=dev) if labels is not None else None
        )
        for start, end in src.ranges(chunk):
            cm, cs, ct, cy = chunk_stats(
                src.rows(start, end, ws),
                ws,
                temperature=temp.rows(start, end),
                labels=labels[start:end] if labels is not None else None,
                entropy=want_entropy,
            )
            m[start:end] = cm
            s[start:end] = cs
            if t is not None and ct is not None:
                t[start:end] = ct
            if y_lab is not None and cy is not None:
                y_lab[start:end] = cy
        lse, logp, ent = finish_stats(m, s, t, y_lab)
        ctx.save_for_backward(logits, labels, src.index, lse, ent)
        ctx.narrow = src.narrow
        ctx.temperature = temperature
        ctx.chunk = chunk
        if logp is None:
            logp = torch.empty(0, dtype=cdt, device=dev)
            ctx.mark_non_differentiable(logp)
        if ent is None:
            ent = torch.empty(0, dtype=cdt, device=dev)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):  # type: ignore[override]
        logits, labels, index, lse, ent = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_ent is None):
            return None, None, None, None, None, None
        cdt, V, dev = lse.dtype, logits.shape[-1], logits.device
        if labels is None:
            grad_logp = None
        if ent is None:
            grad_ent = None
        temp = TemperatureColumn(ctx.temperature, cdt, dev)
        alpha, beta, w = grad_coefficients(grad_logp, grad_ent, ent, temp.inv)
        logp_only = beta is None and labels is not None and labels.shape[-1] == 1
        lse_col = lse.unsqueeze(-1)
        src = _Source(logits, index if index is not None else ctx.narrow)
        ws = Workspace(min(ctx.chunk, max(src.num_rows, 1)), V, cdt, dev)
        grad, target = src.empty_grad()
        dst = RowBlocks(target) if index is None else None
        for start, end in src.ranges(ctx.chunk, *((dst,) if dst is not None else ())):
            if dst is not None:
                out = dst.get(start, end)
            else:
                out = ws.get("gi", end - start, dtype=logits.dtype)
            chunk_grad(
                src.rows(start, end, ws),
                ws,
                out,
                lse=lse_col[start:end],
                alpha=alpha[start:end],  # type: ignore[index]
                beta=beta[start:end] if beta is not None else None,
                w=w[start:end] if w is not None else None,
                labels=labels[start:end] if labels is not None else None,
                temperature=temp.rows(start, end),
                logp_only=logp_only,
            )
            if index is not None:
                grad.index_add_(0, index[start:end], out)
        return grad, None, None, None, None, None


class KLFromLogitsFn(torch.autograd.Function):
    """Exact per-row ``KL(softmax(logits/T) ‖ softmax(ref_logits/T))``, chunked over rows.

    Inputs: ``logits`` and ``ref_logits`` of the same ``(..., V)`` shape (any
    floating dtypes and strides), ``temperature`` (``None``, float or a flat
    ``(N,)`` tensor in the compute dtype) and ``chunk`` rows per chunk.
    Output: ``(N,)`` in the compute dtype (fp64 if either input is fp64).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        ref_logits: torch.Tensor,
        temperature: Temperature,
        chunk: int,
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        cdt = _compute_dtype(logits, ref_logits)
        dev, V = logits.device, logits.shape[-1]
        lay_z, lay_r = RowBlocks(logits), RowBlocks(ref_logits)
        N = lay_z.num_rows
        temp = TemperatureColumn(temperature, cdt, dev)
        ws = Workspace(min(chunk, max(N, 1)), V, cdt, dev)
        kl = torch.empty(N, dtype=cdt, device=dev)
        lse_z = torch.empty(N, dtype=cdt, device=dev)
        lse_r = torch.empty(N, dtype=cdt, device=dev)
        for start, end in chunk_ranges(N, chunk, lay_z, lay_r):
            kl[start:end], lse_z[start:end], lse_r[start:end] = chunk_kl_forward(
                lay_z.get(start, end), lay_r.get(start, end), ws, temperature=temp.rows(start, end)
            )
        ctx.save_for_backward(logits, ref_logits, lse_z, lse_r, kl)
        ctx.temperature = temperature
        ctx.chunk = chunk
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_kl: torch.Tensor | None):  # type: ignore[override]
        logits, ref_logits, lse_z, lse_r, kl = ctx.saved_tensors
        need_z, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_kl is None or not (need_z or need_r):
            return None, None, None, None
        cdt, V, dev = kl.dtype, logits.shape[-1], logits.device
        temp = TemperatureColumn(ctx.temperature, cdt, dev)
        g = grad_kl if temp.inv is None else grad_kl * temp.inv
        g, lse_z, lse_r, kl = (
            g.unsqueeze(-1),
            lse_z.unsqueeze(-1),
            lse_r.unsqueeze(-1),
            kl.unsqueeze(-1),
        )
        lay_z, lay_r = RowBlocks(logits), RowBlocks(ref_logits)
        N = lay_z.num_rows
        ws = Workspace(min(ctx.chunk, max(N, 1)), V, cdt, dev)
        gz = torch.empty(logits.shape, dtype=logits.dtype, device=dev) if need_z else None
        gr = torch.empty(ref_logits.shape, dtype=ref_logits.dtype, device=dev) if need_r else None
        gz2 = gz.view(-1, V) if gz is not None else None
        gr2 = gr.view(-1, V) if gr is not None else None
        for start, end in chunk_ranges(N, ctx.chunk, lay_z, lay_r):
            chunk_kl_grad(
                lay_z.get(start, end),
                lay_r.get(start, end),
                ws,
                lse_z=lse_z[start:end],
                lse_r=lse_r[start:end],
                kl=kl[start:end],
                grad=g[start:end],
                out_z=gz2[start:end] if gz2 is not None else None,
                out_r=gr2[start:end] if gr2 is not None else None,
                temperature=temp.rows(start, end),
            )
        return gz, gr, None, None
