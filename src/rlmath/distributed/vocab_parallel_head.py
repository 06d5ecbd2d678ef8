"""The fused LM head with its weight split over the vocabulary: ``hidden @ W_k.T`` never stored.

Forward computes one block of local logits at a time (a chunk of rows by a
tile of the local vocabulary) into a scratch buffer, reduces it with the same
statistics as the logits version, merges the tiles' statistics per row and
keeps only per-row numbers; backward recomputes each block, turns it into its
gradient in place, and feeds it to the two matmuls of the head. Tiling the
vocabulary as well as the rows keeps the row chunks long (efficient matmuls,
the weight read once per chunk of hundreds of rows) while the scratch stays a
few MiB whatever ``V/tp``. The gradient
of ``hidden`` is the sum over ranks of each shard's ``g_k @ W_k``: it is
accumulated in the compute dtype (fp32 for bf16) and all-reduced once, so
every rank holds the same tensor, the unsharded gradient. The weight (and
bias) gradients are local and accumulated in the compute dtype over chunks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from rlmath.distributed._collectives import ProcessGroup, is_distributed
from rlmath.distributed.vocab_parallel_logits import compute_dtype
from rlmath.distributed.vocab_parallel_stats import (
    ShardSpec,
    combine_shard_stats,
    local_labels,
    shard_chunk_stats,
)
from rlmath.logprobs._blocks import TemperatureColumn, TileWorkspace, merge_tile_stats
from rlmath.logprobs._kernels import chunk_grad, grad_coefficients

__all__ = ["DEFAULT_BLOCK_ELEMENTS", "DEFAULT_ROWS", "VocabParallelHeadFn", "head_tile_sizes"]

DEFAULT_ROWS = 512
"""Rows per chunk by default: matmuls with an inner dimension of hundreds of rows
run at full speed, and the weight is read once per chunk."""

DEFAULT_BLOCK_ELEMENTS = 2 * 1024 * 1024
"""Entries of one ``(rows, vocab tile)`` block by default (8 MiB per fp32 buffer)."""


def head_tile_sizes(
    num_rows: int, width: int, chunk_size: int | None, vocab_chunk_size: int | None
) -> tuple[int, int]:
    """``(rows per chunk, columns per tile)``; a value given by the caller is kept."""
    if chunk_size is None:
        rows = min(DEFAULT_ROWS, max(1, num_rows))
        threads = max(1, torch.get_num_threads())
        if rows > threads:
            rows -= rows % threads
    else:
        rows = chunk_size
    tile = vocab_chunk_size or max(1, min(width, DEFAULT_BLOCK_ELEMENTS // rows))
    return rows, tile


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + step, total)) for lo in range(0, total, step)]


def _tile_labels(
    local: torch.Tensor, owned: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels owned by columns ``[lo, hi)``: ``(index into the tile (0 if not), in-tile mask)``."""
    inside = owned & (local >= lo) & (local < hi)
    return torch.where(inside, local - lo, 0), inside


def _rows(hidden: torch.Tensor, live: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """``hidden[a:b]`` with the rows whose labels are all ignored replaced by zeros.

    Those rows give 0 and no gradient, so their hidden states (padding, maybe
    NaN) must not reach a matmul, where ``0 · NaN`` would spread to ``grad_weight``.
    """
    return torch.where(live[a:b, None], hidden[a:b], 0)


def _block_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> torch.Tensor:
    """``out = h @ weight.T (+ bias)`` in the inputs' dtype."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


class VocabParallelHeadFn(torch.autograd.Function):
    """Label log-probs (and entropy) of ``softmax((hidden @ W.T + b) / T)`` over the sharded vocabulary.

    Inputs (positional, for ``apply``):
        hidden: ``(N, H)`` floating, replicated over the group.
        weight: ``(V/tp, H)`` this rank's rows of the head, dtype of ``hidden``.
        bias: ``(V/tp,)`` or ``None``.
        labels: ``(N, K)`` int64 global token ids.
        temperature: ``None``, float or ``(N,)`` compute-dtype tensor.
        want_entropy: bool.
        tiles: ``(rows per chunk, columns per tile)``.
        shard: :class:`ShardSpec`.
        group: the tensor-parallel group.
        reduce_grad_hidden: all-reduce the gradient of ``hidden`` over ``group``
            (else each rank returns its shard's part ``g_k @ W_k``).

    Outputs: ``(logp (N, K), entropy (N,))`` in the compute dtype (entropy empty
    when not asked for), identical on every rank. A row whose labels are all
    ``ignore_index`` gives 0 for both and no gradient, like
    :func:`rlmath.fused_head.log_probs_and_entropy_from_hidden`.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        temperature: torch.Tensor | float | None,
        want_entropy: bool,
        tiles: tuple[int, int],
        shard: ShardSpec,
        group: ProcessGroup | None,
        reduce_grad_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        cdt, dev = compute_dtype(hidden), hidden.device
        n, real = hidden.shape[0], shard.real
        rows, tile = tiles
        temp = TemperatureColumn(temperature, cdt, dev)
        local, owned, valid = local_labels(labels, shard)
        live = valid.any(-1)
        m = torch.full((n,), float("-inf"), dtype=cdt, device=dev)
        s = torch.zeros(n, dtype=cdt, device=dev)
        t = torch.zeros(n, dtype=cdt, device=dev) if want_entropy else None
        z = torch.zeros(labels.shape, dtype=cdt, device=dev)
        if real > 0 and n > 0:
            ws = TileWorkspace(min(rows, n), min(tile, real), cdt, dev)
            for a, b in _spans(n, rows):
                h, temp_c = _rows(hidden, live, a, b), temp.rows(a, b)
                for lo, hi in _spans(real, tile):
                    ws.width = hi - lo
                    buf = _block_logits(
                        h,
                        weight[lo:hi],
                        bias[lo:hi] if bias is not None else None,
                        ws.get("logits", b - a, dtype=hidden.dtype),
                    )
                    lab, inside = _tile_labels(local[a:b], owned[a:b], lo, hi)
                    cm, cs, ct, cz = shard_chunk_stats(
                        buf, ws, temperature=temp_c, labels=lab, entropy=want_entropy
                    )
                    tc = t[a:b] if t is not None else None
                    m[a:b], s[a:b], tc = merge_tile_stats((m[a:b], s[a:b], tc), (cm, cs, ct))
                    if t is not None and tc is not None:
                        t[a:b] = tc
                    assert cz is not None
                    z[a:b] = torch.where(inside, cz, z[a:b])
        lse, ent, z_all = combine_shard_stats(m, s, t, z, owned, group)
        assert z_all is not None
        logp = torch.where(valid, z_all - lse.unsqueeze(-1), 0)
        ctx.save_for_backward(hidden, weight, bias, local, owned, valid, lse, ent)
        ctx.temperature, ctx.tiles, ctx.shard, ctx.group = temperature, tiles, shard, group
        ctx.reduce_grad_hidden = reduce_grad_hidden
        if ent is None:
            out_ent = torch.empty(0, dtype=cdt, device=dev)
            ctx.mark_non_differentiable(out_ent)
        else:
            out_ent = torch.where(live, ent, 0)
        return logp, out_ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, bias, local, owned, valid, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 7
        if not (need_h or need_w or need_b) or (grad_logp is None and grad_ent is None):
            return None, None, None, *none
        live = valid.any(-1)
        if ent is None:
            grad_ent = None
        if grad_ent is not None:
            grad_ent = torch.where(live, grad_ent, 0)
        if grad_logp is not None:
            grad_logp = torch.where(valid, grad_logp, 0)
        shard: ShardSpec = ctx.shard
        cdt, dev = lse.dtype, hidden.device
        n, real = hidden.shape[0], shard.real
        rows, tile = ctx.tiles
        temp = TemperatureColumn(ctx.temperature, cdt, dev)
        alpha, beta, w = grad_coefficients(grad_logp, grad_ent, ent, temp.inv)
        # Accumulators in the compute dtype; zero rows for padding columns.
        gh = torch.zeros(hidden.shape, dtype=cdt, device=dev) if need_h else None
        gw = torch.zeros(weight.shape, dtype=cdt, device=dev) if need_w else None
        gb = torch.zeros(bias.shape, dtype=cdt, device=dev) if need_b else None
        if real > 0 and n > 0:
            ws = TileWorkspace(min(rows, n), min(tile, real), cdt, dev)
            lse_col = lse.unsqueeze(-1)
            direct = hidden.dtype == cdt
            for a, b in _spans(n, rows):
                h = _rows(hidden, live, a, b)
                for lo, hi in _spans(real, tile):
                    ws.width = hi - lo
                    w_tile = weight[lo:hi]
                    buf = _block_logits(
                        h,
                        w_tile,
                        bias[lo:hi] if bias is not None else None,
                        ws.get("logits", b - a, dtype=hidden.dtype),
                    )
                    lab = coef = None
                    if w is not None:
                        # The one-hot part of ∂logp/∂z: only on the columns holding the label.
                        lab, inside = _tile_labels(local[a:b], owned[a:b], lo, hi)
                        coef = torch.where(inside, w[a:b], 0)
                    g = chunk_grad(
                        buf,
                        ws,
                        buf,
                        lse=lse_col[a:b],
                        alpha=alpha[a:b],  # type: ignore[index]
                        beta=beta[a:b] if beta is not None else None,
                        w=coef,
                        labels=lab,
                        temperature=temp.rows(a, b),
                    )
                    if gh is not None:
                        if direct:
                            gh[a:b].addmm_(g, w_tile)
                        else:
                            gh[a:b] += g @ w_tile
                    if gw is not None:
                        if direct:
                            gw[lo:hi].addmm_(g.t(), h)
                        else:
                            gw[lo:hi] += g.t() @ h
                    if gb is not None:
                        gb[lo:hi] += g.sum(0, dtype=cdt)
        if gh is not None and ctx.reduce_grad_hidden and is_distributed(ctx.group):
            # Σ over shards of g_k @ W_k; every rank gets the same buffer back.
            dist.all_reduce(gh, group=ctx.group)
        return (
            gh.to(hidden.dtype) if gh is not None else None,
            gw.to(weight.dtype) if gw is not None else None,
            gb.to(bias.dtype) if gb is not None else None,
            *none,
        )
