"""The pure-torch fused LM head: a custom autograd function over blocks of the logits.

Forward, for each chunk of ``rows`` tokens and each tile of ``vocab_tile``
vocabulary entries, computes the block of logits ``hidden_chunk @ weight_tile.T
(+ bias_tile)`` into one reused buffer (in the inputs' dtype, as
``hidden @ weight.T`` would) and reduces it with the shared chunk primitives
of :mod:`rlmath.logprobs._kernels` (upcast to the compute dtype element by
element; on a CPU in L2-sized row slices of the block, see
:func:`rlmath.fused_head.chunking.elementwise_rows`). The per-tile statistics
are merged into the row's log-sum-exp and entropy
(:func:`rlmath.logprobs._blocks.merge_tile_stats`). Only the inputs and an
fp32 log-sum-exp and entropy per row are saved.

Backward recomputes each block, turns it into ``grad_logits`` with the shared
:func:`~rlmath.logprobs._kernels.chunk_grad` (from the saved log-sum-exp, so a
tile needs nothing from the others) and feeds it to three compute-dtype
matmuls: ``grad_hidden[chunk] += g @ weight_tile``,
``grad_weight[tile] += g.T @ hidden_chunk`` and ``grad_bias[tile] += Σ g``.
For half-precision inputs on a CPU the weight tile and hidden chunk are
upcast for these matmuls; on an accelerator ``g`` is rounded to the inputs'
dtype and the matmuls run in half precision (tensor cores), each product
added to fp32 accumulators. Either way ``grad_weight`` accumulates in one
fp32 buffer of the weight's shape, rounded once at the end (as
``grad_hidden`` is per chunk).

Rows whose label is ``ignore_index`` are computed with a zero hidden state
(so NaN or inf there cannot reach anything), return 0 and get a zero
gradient; no host sync is needed to find them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from rlmath.fused_head._tiles import TileWorkspace, merge_tile_stats, spans
from rlmath.fused_head.chunking import elementwise_rows
from rlmath.logprobs._blocks import TemperatureColumn
from rlmath.logprobs._inputs import compute_dtype
from rlmath.logprobs._kernels import (
    chunk_grad,
    chunk_stats,
    finish_stats,
    grad_coefficients,
    scaled_shift,
)

__all__ = ["FusedLinearLogProbsFn"]

Temperature = torch.Tensor | float | None


class _Blocks:
    """Computes blocks of logits and locates each row's label in the vocabulary tiles."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        valid: torch.Tensor,
        rows: int,
        tile: int,
    ):
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.labels, self.valid = labels, valid
        self.row_spans = spans(hidden.shape[0], rows)
        self.tile_spans = spans(weight.shape[0], tile)
        c_max, w_max = min(rows, max(1, hidden.shape[0])), min(tile, weight.shape[0])
        cdt = compute_dtype(hidden, weight)
        # Block-sized buffers (the logits block, the gradient block, matmul operands)...
        self.ws = TileWorkspace(c_max, w_max, cdt, hidden.device)
        # ...and slice-sized scratch for the elementwise passes (see elementwise_rows).
        self.sub = elementwise_rows(c_max, w_max, hidden.device)
        self.small = TileWorkspace(self.sub, w_max, cdt, hidden.device)

    def hidden_rows(self, r0: int, r1: int) -> torch.Tensor:
        """``hidden[r0:r1]`` with the rows of ignored labels replaced by zeros."""
        return torch.where(self.valid[r0:r1, None], self.hidden[r0:r1], 0.0)

    def logits(self, h: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """The ``(c, v1 - v0)`` block ``h @ weight[v0:v1].T + bias[v0:v1]`` in the inputs' dtype."""
        self.ws.width = v1 - v0
        out = self.ws.get("z", h.shape[0], dtype=h.dtype)
        w = self.weight[v0:v1].T
        if self.bias is None:
            return torch.mm(h, w, out=out)
        return torch.addmm(self.bias[v0:v1], h, w, out=out)

    def slices(self, c: int, v0: int, v1: int) -> list[tuple[int, int]]:
        """Row slices of a ``(c, v1 - v0)`` block for the elementwise passes."""
        self.small.width = v1 - v0
        return spans(c, self.sub)

    def local_labels(self, r0: int, r1: int, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index (c, 1) into the tile, in-tile mask (c, 1))`` of each row's label."""
        local = self.labels[r0:r1, None] - v0
        inside = (local >= 0) & (local < v1 - v0)
        return local.clamp(0, v1 - v0 - 1), inside


class FusedLinearLogProbsFn(torch.autograd.Function):
    """Label log-probs and entropy of ``(hidden @ weight.T + bias) / T``, block by block.

    Inputs (positional, as ``apply`` needs them):
        hidden: ``(N, H)`` floating.
        weight: ``(V, H)``, the dtype of ``hidden``.
        bias: ``(V,)`` of that dtype, or ``None``.
        labels: ``(N,)`` int64 in ``[0, V)`` (ignored rows hold any valid index).
        valid: ``(N,)`` bool, ``False`` where the label was ``ignore_index``.
        temperature: ``None``, float or an ``(N,)`` tensor in the compute dtype.
        want_entropy: bool.
        rows: tokens per chunk.
        tile: vocabulary entries per tile.

    Outputs: ``(logp (N,), entropy (N,))`` in the compute dtype (fp64 for fp64
    inputs, else fp32), 0 on ignored rows; the entropy is an empty,
    non-differentiable tensor when not asked for.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        valid: torch.Tensor,
        temperature: Temperature,
        want_entropy: bool,
        rows: int,
        tile: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        blocks = _Blocks(hidden, weight, bias, labels, valid, rows, tile)
        ws = blocks.ws
        cdt, dev, N = ws.dtype, hidden.device, hidden.shape[0]
        temp = TemperatureColumn(temperature, cdt, dev)
        big = torch.empty(N, dtype=cdt, device=dev)
        total_s = torch.empty(N, dtype=cdt, device=dev)
        total_t = torch.empty(N, dtype=cdt, device=dev) if want_entropy else None
        z_label = torch.zeros(N, 1, dtype=cdt, device=dev)
        for r0, r1 in blocks.row_spans:
            h = blocks.hidden_rows(r0, r1)
            c = r1 - r0
            neg_inf = torch.full((c,), float("-inf"), dtype=cdt, device=dev)
            zero = torch.zeros(c, dtype=cdt, device=dev)
            stats = (neg_inf, zero, zero if want_entropy else None)
            tm, ts = torch.empty_like(zero), torch.empty_like(zero)
            tt = torch.empty_like(zero) if want_entropy else None
            for v0, v1 in blocks.tile_spans:
                z = blocks.logits(h, v0, v1)
                idx, inside = blocks.local_labels(r0, r1, v0, v1)
                z_label[r0:r1] = torch.where(inside, z.gather(1, idx), z_label[r0:r1])
                for a, b in blocks.slices(c, v0, v1):
                    cm, cs, ct, _ = chunk_stats(
                        z[a:b],
                        blocks.small,
                        temperature=temp.rows(r0 + a, r0 + b),
                        entropy=want_entropy,
                    )
                    tm[a:b], ts[a:b] = cm, cs
                    if tt is not None and ct is not None:
                        tt[a:b] = ct
                stats = merge_tile_stats(stats, (tm, ts, tt))
            big[r0:r1], total_s[r0:r1] = stats[0], stats[1]
            if total_t is not None and stats[2] is not None:
                total_t[r0:r1] = stats[2]
        y_label = scaled_shift(z_label, temp.col, big.unsqueeze(-1), torch.empty_like(z_label))
        lse, logp, ent = finish_stats(big, total_s, total_t, y_label)
        assert logp is not None
        ctx.save_for_backward(hidden, weight, bias, labels, valid, lse, ent)
        ctx.temperature = temperature
        ctx.sizes = (rows, tile)
        logp = torch.where(valid, logp.squeeze(-1), 0.0)
        if ent is None:
            out_ent = torch.empty(0, dtype=cdt, device=dev)
            ctx.mark_non_differentiable(out_ent)
        else:
            out_ent = torch.where(valid, ent, 0.0)
        return logp, out_ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, bias, labels, valid, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        nones = (None,) * 6
        if ent is None:
            grad_ent = None
        if not (need_h or need_w or need_b) or (grad_logp is None and grad_ent is None):
            return None, None, None, *nones
        blocks = _Blocks(hidden, weight, bias, labels, valid, *ctx.sizes)
        ws = blocks.ws
        cdt, dev = ws.dtype, hidden.device
        H = hidden.shape[1]
        temp = TemperatureColumn(ctx.temperature, cdt, dev)
        # Ignored rows get zero coefficients (a NaN upstream gradient there stays out).
        g_logp = torch.where(valid, grad_logp, 0.0).unsqueeze(-1) if grad_logp is not None else None
        g_ent = torch.where(valid, grad_ent, 0.0) if grad_ent is not None else None
        alpha, beta, w_label = grad_coefficients(g_logp, g_ent, ent, temp.inv)
        assert alpha is not None
        lse_col = lse.unsqueeze(-1)
        half_h, half_w = hidden.dtype != cdt, weight.dtype != cdt
        # On an accelerator a half-precision matmul runs on tensor cores, an order of
        # magnitude faster than fp32 (measured on an H200: the fp32 backward made the
        # bf16 head 8x slower than the unfused path). There the block gradient is
        # rounded to the inputs' dtype once, as the unfused path rounds grad_logits,
        # and each block's product is accumulated in fp32. On a CPU the fp32
        # matmuls are as fast and keep the gradient unrounded.
        lowp = (half_h or half_w) and _half_matmuls_pay(hidden.device)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_h else None
        # The first row chunk writes each weight-gradient tile, later ones accumulate:
        # no separate pass to zero V·H entries.
        new = torch.empty if blocks.row_spans else torch.zeros  # no rows: nothing writes it
        grad_w = new(weight.shape, dtype=cdt, device=dev) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b else None
        for j, (r0, r1) in enumerate(blocks.row_spans):
            c = r1 - r0
            h = blocks.hidden_rows(r0, r1)
            h_c = ws.scratch("h32", (c, H), cdt).copy_(h) if half_h and need_w and not lowp else h
            if grad_h is not None:
                acc = ws.scratch("gh32", (c, H), cdt) if half_h else grad_h[r0:r1]
            for k, (v0, v1) in enumerate(blocks.tile_spans):
                z = blocks.logits(h, v0, v1)
                idx, inside = blocks.local_labels(r0, r1, v0, v1)
                g = z if z.dtype == cdt else ws.get("g", c)
                w_in = torch.where(inside, w_label[r0:r1], 0.0) if w_label is not None else None
                for a, b in blocks.slices(c, v0, v1):
                    chunk_grad(
                        z[a:b],
                        blocks.small,
                        g[a:b],
                        lse=lse_col[r0 + a : r0 + b],
                        alpha=alpha[r0 + a : r0 + b],
                        beta=beta[r0 + a : r0 + b] if beta is not None else None,
                        w=w_in[a:b] if w_in is not None else None,
                        labels=idx[a:b],
                        temperature=temp.rows(r0 + a, r0 + b),
                    )
                if lowp:
                    _lowp_matmuls(
                        g,
                        h,
                        weight[v0:v1],
                        ws,
                        acc if grad_h is not None else None,
                        grad_w[v0:v1] if grad_w is not None else None,
                        first_h=k == 0,
                        first_w=j == 0,
                    )
                else:
                    if grad_h is not None:
                        w_tile = weight[v0:v1]
                        if half_w:
                            w_tile = ws.scratch("w32", (v1 - v0, H), cdt).copy_(w_tile)
                        if k == 0:
                            torch.mm(g, w_tile, out=acc)
                        else:
                            acc.addmm_(g, w_tile)
                    if grad_w is not None:
                        if j == 0:
                            torch.mm(g.T, h_c, out=grad_w[v0:v1])
                        else:
                            grad_w[v0:v1].addmm_(g.T, h_c)
                if grad_b is not None:
                    grad_b[v0:v1] += g.sum(0)
            if grad_h is not None and half_h:
                grad_h[r0:r1].copy_(acc)
        if grad_w is not None and half_w:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and bias.dtype != cdt:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, *nones


def _half_matmuls_pay(device: torch.device) -> bool:
    """Whether half-precision matmuls beat fp32 ones on ``device`` (every accelerator, not a CPU)."""
    return device.type != "cpu"


def _lowp_matmuls(
    g: torch.Tensor,
    h: torch.Tensor,
    w_tile: torch.Tensor,
    ws: TileWorkspace,
    acc_h: torch.Tensor | None,
    acc_w: torch.Tensor | None,
    *,
    first_h: bool,
    first_w: bool,
) -> None:
    """``acc_h (+)= g @ w_tile`` and ``acc_w += g.T @ h`` as half-precision matmuls.

    ``g`` ``(c, tile)`` is the block gradient in the compute dtype; it is rounded
    to the dtype of ``h`` ``(c, H)`` and ``w_tile`` ``(tile, H)`` once, each
    product is formed by a half-precision matmul (fp32 accumulation inside the
    GEMM) and added to the fp32 accumulators ``acc_h`` ``(c, H)`` and
    ``acc_w`` ``(tile, H)``; ``first_h`` / ``first_w`` overwrite them instead.
    """
    c, tile, H = g.shape[0], g.shape[1], h.shape[1]
    g_half = ws.get("g_half", c, dtype=h.dtype).copy_(g)
    if acc_h is not None:
        part = torch.mm(g_half, w_tile, out=ws.scratch("gh_part", (c, H), h.dtype))
        if first_h:
            acc_h.copy_(part)
        else:
            acc_h.add_(part)
    if acc_w is not None:
        part = torch.mm(g_half.T, h, out=ws.scratch("gw_part", (tile, H), h.dtype))
        if first_w:
            acc_w.copy_(part)
        else:
            acc_w.add_(part)
