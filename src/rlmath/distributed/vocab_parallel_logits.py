"""Autograd functions for log-probs, entropy and the exact KL on vocabulary-sharded logits.

Forward: one chunked pass over the local columns (the chunk primitives of
:mod:`rlmath.logprobs._kernels`), then a few small per-row collectives that
turn the shard statistics into global ones. Backward needs no collective: the
gradient of a local logit depends only on that logit and the global per-row
statistics saved by forward (log-sum-exp, entropy, KL), so each rank writes
its own columns of the single-process gradient, chunk by chunk. Like the
single-process functions, only the inputs and a few numbers per row are saved.

Every rank must pass the same rows (and labels), as tensor-parallel ranks do,
and receives the same upstream gradient for the (replicated) outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from rlmath.distributed._collectives import ProcessGroup, all_reduce
from rlmath.distributed.vocab_parallel_stats import (
    ShardSpec,
    combine_shard_stats,
    local_labels,
    shard_chunk_stats,
)
from rlmath.logprobs._blocks import TemperatureColumn
from rlmath.logprobs._functions import RowBlocks, chunk_ranges
from rlmath.logprobs._kernels import (
    Workspace,
    chunk_grad,
    chunk_kl_grad,
    grad_coefficients,
    row_nansum,
    row_sum,
    scaled_max,
    scaled_shift,
)

__all__ = ["VocabParallelKLFn", "VocabParallelLogProbsEntropyFn", "compute_dtype", "real_columns"]

NEG_INF = float("-inf")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def real_columns(x: torch.Tensor, real: int) -> torch.Tensor:
    """The first ``real`` columns of ``x`` (a view)."""
    return x if real == x.shape[-1] else x.narrow(-1, 0, real)


def _empty_grad(x: torch.Tensor, real: int) -> tuple[torch.Tensor, RowBlocks]:
    """A gradient buffer of ``x``'s shape, zero on padding columns, and its real-column rows."""
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if real < x.shape[-1]:
        grad.narrow(-1, real, x.shape[-1] - real).zero_()
    return grad, RowBlocks(real_columns(grad, real))


class VocabParallelLogProbsEntropyFn(torch.autograd.Function):
    """Label log-probs and/or entropy of ``softmax(logits / T)`` over the whole sharded vocabulary.

    Inputs (positional, for ``apply``):
        logits: ``(..., V/tp)`` this rank's columns, any floating dtype and strides.
        labels: ``(N, K)`` int64 global token ids, or ``None`` (no log-probs).
        temperature: ``None``, float or ``(N,)`` compute-dtype tensor.
        want_entropy: bool.
        chunk: rows per chunk.
        shard: :class:`ShardSpec` of this rank.
        group: the tensor-parallel process group (``None``: world).

    Outputs: ``(logp (N, K), entropy (N,))`` in the compute dtype, identical on
    every rank; ignored labels give 0. An output not asked for is empty.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        temperature: torch.Tensor | float | None,
        want_entropy: bool,
        chunk: int,
        shard: ShardSpec,
        group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        cdt, dev = compute_dtype(logits), logits.device
        n = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
        temp = TemperatureColumn(temperature, cdt, dev)
        m = torch.full((n,), NEG_INF, dtype=cdt, device=dev)
        s = torch.zeros(n, dtype=cdt, device=dev)
        t = torch.zeros(n, dtype=cdt, device=dev) if want_entropy else None
        local = owned = valid = z = None
        if labels is not None:
            local, owned, valid = local_labels(labels, shard)
            z = torch.zeros(labels.shape, dtype=cdt, device=dev)
        if shard.real > 0 and n > 0:
            lay = RowBlocks(real_columns(logits, shard.real))
            ws = Workspace(min(chunk, n), shard.real, cdt, dev)
            for a, b in chunk_ranges(n, chunk, lay):
                cm, cs, ct, cz = shard_chunk_stats(
                    lay.get(a, b),
                    ws,
                    temperature=temp.rows(a, b),
                    labels=local[a:b] if local is not None else None,
                    entropy=want_entropy,
                )
                m[a:b], s[a:b] = cm, cs
                if t is not None and ct is not None:
                    t[a:b] = ct
                if z is not None and cz is not None:
                    z[a:b] = cz
        lse, ent, z_all = combine_shard_stats(m, s, t, z, owned, group)
        logp = None
        if z_all is not None:
            assert valid is not None
            logp = torch.where(valid, z_all - lse.unsqueeze(-1), 0)
        ctx.save_for_backward(logits, local, owned, valid, lse, ent)
        ctx.temperature, ctx.chunk, ctx.shard = temperature, chunk, shard
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
        logits, local, owned, valid, lse, ent = ctx.saved_tensors
        none = (None,) * 6
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_ent is None):
            return None, *none
        if local is None:
            grad_logp = None
        if ent is None:
            grad_ent = None
        if grad_logp is not None:
            grad_logp = torch.where(valid, grad_logp, 0)  # an ignored label is a constant 0
        shard: ShardSpec = ctx.shard
        cdt, dev = lse.dtype, logits.device
        temp = TemperatureColumn(ctx.temperature, cdt, dev)
        alpha, beta, w = grad_coefficients(grad_logp, grad_ent, ent, temp.inv)
        if w is not None:
            # The one-hot part of ∂logp/∂z lives on the owner's columns only.
            w = torch.where(owned, w, 0)
        grad, dst = _empty_grad(logits, shard.real)
        n = lse.shape[0]
        if shard.real > 0 and n > 0:
            src = RowBlocks(real_columns(logits, shard.real))
            ws = Workspace(min(ctx.chunk, n), shard.real, cdt, dev)
            lse_col = lse.unsqueeze(-1)
            for a, b in chunk_ranges(n, ctx.chunk, src, dst):
                chunk_grad(
                    src.get(a, b),
                    ws,
                    dst.get(a, b),
                    lse=lse_col[a:b],
                    alpha=alpha[a:b],  # type: ignore[index]
                    beta=beta[a:b] if beta is not None else None,
                    w=w[a:b] if w is not None else None,
                    labels=local[a:b] if w is not None else None,
                    temperature=temp.rows(a, b),
                )
        return grad, *none


def _shard_kl_chunk(
    src_z: torch.Tensor,
    src_r: torch.Tensor,
    ws: Workspace,
    temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(KL_k, lse_z_k, lse_r_k)`` of one chunk: the KL of the two distributions
    restricted to this shard's columns and their local log-sum-exps.

    ``KL_k = Σ_j p_j·(ls^z_j - ls^r_j)`` (local normalization), a weighted sum
    of small per-entry differences rather than a difference of large sums. A
    row whose shard logits are all ``-inf`` gives ``lse = -inf`` (shifted by 0
    instead of ``-inf``, which would give NaN) and ``KL_k = 0``.
    """
    c = src_z.shape[0]
    e = ws.get("e", c)
    mz = scaled_max(src_z, temperature, ws.dtype)
    mr = scaled_max(src_r, temperature, ws.dtype)
    dead_z, dead_r = mz == NEG_INF, mr == NEG_INF
    mz, mr = torch.where(dead_z, 0, mz), torch.where(dead_r, 0, mr)
    yr = scaled_shift(src_r, temperature, mr, ws.get("yr", c))
    log_sr = row_sum(torch.exp(yr, out=e)).log()
    yz = scaled_shift(src_z, temperature, mz, ws.get("y", c))
    sz = row_sum(torch.exp(yz, out=e))
    log_sz = sz.log()
    # d = (local ls_z) - (local ls_r); NaN where both logits are -inf (then p = 0: skipped).
    d = yz.sub_(yr).sub_((log_sz - log_sr).unsqueeze(-1))
    kl = row_nansum(e.mul_(d)).div_(sz).clamp_min_(0)
    dead_z, dead_r = dead_z.squeeze(-1), dead_r.squeeze(-1)
    # Mass where the reference has none: infinite KL, as in one process.
    kl = torch.where(dead_r & ~dead_z, float("inf"), kl)
    kl = torch.where(dead_z, 0, kl)
    # A NaN reference logit only reaches log_sr (the NaN-skipping sum drops it): keep it visible.
    kl = torch.where(torch.isnan(log_sr), log_sr, kl)
    return kl, mz.squeeze(-1) + log_sz, mr.squeeze(-1) + log_sr


def _combine_kl(
    kl: torch.Tensor, lse_z: torch.Tensor, lse_r: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``(KL, lse_z, lse_r)`` from the shards' by the chain rule of the KL.

    With ``π_k``, ``ρ_k`` the probability mass of shard ``k`` under the policy
    and the reference, ``KL(p‖q) = Σ_k π_k·KL_k + Σ_k π_k·log(π_k/ρ_k)``: both
    terms are sums of non-negative-on-average small numbers, never a large
    difference, so a small KL keeps its relative accuracy.
    """
    big = all_reduce(torch.stack([lse_z, lse_r], -1), "max", group)
    dead = torch.stack([lse_z == NEG_INF, lse_r == NEG_INF], -1)
    local = torch.stack([lse_z, lse_r], -1)
    sums = all_reduce(torch.where(dead, 0, torch.exp(local - big)), "sum", group)
    glob = big + sums.log()
    log_mass = local - glob  # log π_k, log ρ_k
    pi = log_mass[:, 0].exp()
    part = pi * (kl + log_mass[:, 0] - log_mass[:, 1])
    part = torch.where(dead[:, 0], 0, part)
    total = all_reduce(part, "sum", group).clamp_min_(0)
    return total, glob[:, 0], glob[:, 1]


class VocabParallelKLFn(torch.autograd.Function):
    """Exact per-row ``KL(softmax(z/T) ‖ softmax(r/T))`` over the whole sharded vocabulary.

    Inputs: ``logits`` and ``ref_logits`` ``(..., V/tp)`` (this rank's columns),
    ``temperature`` (``None``, float or ``(N,)`` tensor), ``chunk``, ``shard``
    (:class:`ShardSpec`; only ``real`` is used) and ``group``.
    Output: ``(N,)`` in the compute dtype, identical on every rank.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        ref_logits: torch.Tensor,
        temperature: torch.Tensor | float | None,
        chunk: int,
        shard: ShardSpec,
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        cdt, dev = compute_dtype(logits, ref_logits), logits.device
        n = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
        temp = TemperatureColumn(temperature, cdt, dev)
        kl = torch.zeros(n, dtype=cdt, device=dev)
        lse_z = torch.full((n,), NEG_INF, dtype=cdt, device=dev)
        lse_r = torch.full((n,), NEG_INF, dtype=cdt, device=dev)
        if shard.real > 0 and n > 0:
            lay_z = RowBlocks(real_columns(logits, shard.real))
            lay_r = RowBlocks(real_columns(ref_logits, shard.real))
            ws = Workspace(min(chunk, n), shard.real, cdt, dev)
            for a, b in chunk_ranges(n, chunk, lay_z, lay_r):
                kl[a:b], lse_z[a:b], lse_r[a:b] = _shard_kl_chunk(
                    lay_z.get(a, b), lay_r.get(a, b), ws, temp.rows(a, b)
                )
        kl, lse_z, lse_r = _combine_kl(kl, lse_z, lse_r, group)
        ctx.save_for_backward(logits, ref_logits, lse_z, lse_r, kl)
        ctx.temperature, ctx.chunk, ctx.shard = temperature, chunk, shard
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_kl: torch.Tensor | None):  # type: ignore[override]
        logits, ref_logits, lse_z, lse_r, kl = ctx.saved_tensors
        need_z, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 4
        if grad_kl is None or not (need_z or need_r):
            return None, None, *none
        shard: ShardSpec = ctx.shard
        cdt, dev = kl.dtype, logits.device
        temp = TemperatureColumn(ctx.temperature, cdt, dev)
        g = grad_kl if temp.inv is None else grad_kl * temp.inv
        gz, dz = _empty_grad(logits, shard.real) if need_z else (None, None)
        gr, dr = _empty_grad(ref_logits, shard.real) if need_r else (None, None)
        n = kl.shape[0]
        if shard.real > 0 and n > 0:
            lay_z = RowBlocks(real_columns(logits, shard.real))
            lay_r = RowBlocks(real_columns(ref_logits, shard.real))
            ws = Workspace(min(ctx.chunk, n), shard.real, cdt, dev)
            cols = [x.unsqueeze(-1) for x in (g, lse_z, lse_r, kl)]
            layouts = [x for x in (lay_z, lay_r, dz, dr) if x is not None]
            for a, b in chunk_ranges(n, ctx.chunk, *layouts):
                chunk_kl_grad(
                    lay_z.get(a, b),
                    lay_r.get(a, b),
                    ws,
                    lse_z=cols[1][a:b],
                    lse_r=cols[2][a:b],
                    kl=cols[3][a:b],
                    grad=cols[0][a:b],
                    out_z=dz.get(a, b) if dz is not None else None,
                    out_r=dr.get(a, b) if dr is not None else None,
                    temperature=temp.rows(a, b),
                )
        return gz, gr, *none
