"""The fused LM head with its weight split over the vocabulary: ``hidden @ W_k.T`` never stored.

Forward computes one chunk of local logits at a time into a scratch buffer,
reduces it with the same shard statistics as the logits version, and keeps
only per-row numbers; backward recomputes each chunk, turns it into its
gradient in place, and feeds it to the two matmuls of the head. The gradient
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
    Temperature,
    combine_shard_stats,
    local_labels,
    shard_chunk_grad,
    shard_chunk_stats,
)
from rlmath.logprobs._kernels import Workspace, grad_coefficients

__all__ = ["VocabParallelHeadFn"]


def _chunk_logits(
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
        chunk: rows per chunk.
        shard: :class:`ShardSpec`.
        group: the tensor-parallel group.

    Outputs: ``(logp (N, K), entropy (N,))`` in the compute dtype (entropy empty
    when not asked for), identical on every rank.
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
        chunk: int,
        shard: ShardSpec,
        group: ProcessGroup | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        cdt, dev = compute_dtype(hidden), hidden.device
        n = hidden.shape[0]
        temp = Temperature(temperature, cdt, dev)
        local, owned, valid = local_labels(labels, shard)
        m = torch.full((n,), float("-inf"), dtype=cdt, device=dev)
        s = torch.zeros(n, dtype=cdt, device=dev)
        t = torch.zeros(n, dtype=cdt, device=dev) if want_entropy else None
        z = torch.zeros(labels.shape, dtype=cdt, device=dev)
        if shard.real > 0 and n > 0:
            w_real = weight[: shard.real]
            b_real = bias[: shard.real] if bias is not None else None
            ws = Workspace(min(chunk, n), shard.real, cdt, dev)
            for a in range(0, n, chunk):
                b = min(a + chunk, n)
                buf = _chunk_logits(
                    hidden[a:b], w_real, b_real, ws.get("logits", b - a, dtype=hidden.dtype)
                )
                cm, cs, ct, cz = shard_chunk_stats(
                    buf, ws, temperature=temp.rows(a, b), labels=local[a:b], entropy=want_entropy
                )
                m[a:b], s[a:b] = cm, cs
                if t is not None and ct is not None:
                    t[a:b] = ct
                if cz is not None:
                    z[a:b] = cz
        lse, ent, z_all = combine_shard_stats(m, s, t, z, owned, group)
        assert z_all is not None
        logp = torch.where(valid, z_all - lse.unsqueeze(-1), 0)
        ctx.save_for_backward(hidden, weight, bias, local, owned, valid, lse, ent)
        ctx.temperature, ctx.chunk, ctx.shard, ctx.group = temperature, chunk, shard, group
        if ent is None:
            ent = torch.empty(0, dtype=cdt, device=dev)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, bias, local, owned, valid, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 6
        if not (need_h or need_w or need_b) or (grad_logp is None and grad_ent is None):
            return None, None, None, *none
        if ent is None:
            grad_ent = None
        if grad_logp is not None:
            grad_logp = torch.where(valid, grad_logp, 0)
        shard: ShardSpec = ctx.shard
        cdt, dev = lse.dtype, hidden.device
        n, real = hidden.shape[0], shard.real
        temp = Temperature(ctx.temperature, cdt, dev)
        alpha, beta, w = grad_coefficients(grad_logp, grad_ent, ent, temp.inv)
        if w is not None:
            w = torch.where(owned, w, 0)
        # Accumulators in the compute dtype; zero rows for padding columns.
        gh = torch.zeros(hidden.shape, dtype=cdt, device=dev) if need_h else None
        gw = torch.zeros(weight.shape, dtype=cdt, device=dev) if need_w else None
        gb = torch.zeros(bias.shape, dtype=cdt, device=dev) if need_b else None
        if real > 0 and n > 0:
            w_real = weight[:real]
            b_real = bias[:real] if bias is not None else None
            ws = Workspace(min(ctx.chunk, n), real, cdt, dev)
            lse_col = lse.unsqueeze(-1)
            direct = hidden.dtype == cdt
            for a in range(0, n, ctx.chunk):
                b = min(a + ctx.chunk, n)
                h = hidden[a:b]
                buf = _chunk_logits(h, w_real, b_real, ws.get("logits", b - a, dtype=hidden.dtype))
                g = shard_chunk_grad(
                    buf,
                    ws,
                    buf,
                    lse=lse_col[a:b],
                    alpha=alpha[a:b],  # type: ignore[index]
                    beta=beta[a:b] if beta is not None else None,
                    w=w[a:b] if w is not None else None,
                    labels=local[a:b] if w is not None else None,
                    temperature=temp.rows(a, b),
                )
                if gh is not None:
                    if direct:
                        torch.mm(g, w_real, out=gh[a:b])
                    else:
                        gh[a:b] = g @ w_real
                if gw is not None:
                    if direct:
                        gw[:real].addmm_(g.t(), h)
                    else:
                        gw[:real] += g.t() @ h
                if gb is not None:
                    gb[:real] += g.sum(0, dtype=cdt)
        if gh is not None and is_distributed(ctx.group):
            # Σ over shards of g_k @ W_k; every rank gets the same buffer back.
            dist.all_reduce(gh, group=ctx.group)
        return (
            gh.to(hidden.dtype) if gh is not None else None,
            gw.to(weight.dtype) if gw is not None else None,
            gb.to(bias.dtype) if gb is not None else None,
            *none,
        )
