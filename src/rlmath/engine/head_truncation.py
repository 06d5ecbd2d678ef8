"""The LM head's log-probs and entropy under a sampler's kept set, one block of rows at a time.

A sampler's kept set is a threshold on each row's logits (top-k, top-p, min-p:
:mod:`rlmath.engine.sampling`), which needs the whole row. So where the plain
fused head splits the vocabulary into tiles, this path takes a block of rows
whole: their ``(rows, V)`` logits are computed as the head computes them
(``hidden @ weight.T + bias`` in the inputs' dtype, then ``logit_scale`` and
``softcap`` in fp32), handed to the logits operator with the sampler's
arguments, and dropped; backward recomputes each block
(:func:`torch.utils.checkpoint.checkpoint`). Memory: one block of logits, at
most :data:`BLOCK_ENTRIES` entries (and its gradient in backward), whatever
the number of rows.

Over vocabulary shards each rank forms its columns of the block and the
logits operator finds the global kept set and statistics
(:mod:`rlmath.engine.torch_backend.kept_shards`); every rank walks the same
blocks. The gradient of the hidden states, each rank's share through its own
rows of the head, is summed over the group (unless the caller sums it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from rlmath.engine.groups import all_reduce

__all__ = ["BLOCK_ENTRIES", "truncated_head"]


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the incoming gradient over the group's ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.contiguous(), "sum", ctx.group), None


BLOCK_ENTRIES = 1 << 24
"""Logits per block of rows: 64 MiB in fp32."""


def _rows(value: Any, batch: tuple[int, ...]) -> Any:
    """A per-row tensor broadcast to ``batch`` and flattened (``(N,)``); anything else as is."""
    if isinstance(value, torch.Tensor):
        return value.expand(batch).reshape(-1)
    return value


def _block(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: Any,
    params: dict[str, Any],
    scale: float,
    cap: float,
    want_entropy: bool,
    ignore_index: int | None,
    chunk_size: int | None,
    shard: dict[str, Any],
) -> tuple[torch.Tensor, ...]:
    from rlmath.log_probs import log_probs_and_entropy_from_logits

    logits = torch.nn.functional.linear(h, w, b)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if scale != 1.0:
        z = z * scale
    if cap:
        z = cap * torch.tanh(z / cap)
    out = log_probs_and_entropy_from_logits(
        z, labels, temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size,
        backend="torch", kept_stats=True, **params, **shard,
    )  # fmt: skip
    entropy = out.entropy if want_entropy and out.entropy is not None else z.new_zeros(0)
    return out.log_probs, entropy, out.outside, out.kept_count


def truncated_head(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    temperature: Any,
    params: dict[str, Any],
    scale: float,
    cap: float,
    real: int,
    want_entropy: bool,
    ignore_index: int | None,
    chunk_size: int | None,
    vocab_parallel: Any = None,
    vocab_size: object = None,
    group: Any = None,
    reduce_grad_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(log_probs, entropy or None, outside, kept_count)`` of every row of ``h``.

    ``h``: ``(..., H)`` and ``w``/``b`` in one dtype (checked by the caller);
    ``labels``: ``h.shape[:-1]`` or ``h.shape[:-1] + (K,)``; ``temperature`` and
    the sampler's ``params`` (``top_k``, ``top_p``, ``min_p``, ``sampler``)
    scalars or tensors broadcastable to ``h.shape[:-1]``; ``real``: the rows of
    ``w`` that are tokens. With ``vocab_parallel`` (and the resolved process
    ``group``), ``w`` holds this rank's rows and ``vocab_size`` is the whole
    vocabulary's real tokens, as the logits functions take them.
    """
    batch = tuple(h.shape[:-1])
    n = math.prod(batch)
    shard: dict[str, Any] = {}
    if vocab_parallel is not None:
        shard = {"vocab_parallel": vocab_parallel, "vocab_size": vocab_size}
        real = w.shape[0]  # the logits operator leaves the padding out
        if group is not None and reduce_grad_hidden:
            h = _SumGradOverGroup.apply(h, group)
    w, b = w[:real], (b[:real] if b is not None else None)
    flat_h = h.reshape(n, h.shape[-1])
    flat_labels = labels.reshape(n, *labels.shape[len(batch) :])
    flat_temp = _rows(temperature, batch)
    flat_params = {k: _rows(v, batch) for k, v in params.items()}
    step = max(1, BLOCK_ENTRIES // max(real, 1))
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (flat_h, w, b)
    )
    parts = []
    for a in range(0, n, step):
        e = min(n, a + step)

        def cut(v: Any, a: int = a, e: int = e) -> Any:
            return v[a:e] if isinstance(v, torch.Tensor) else v

        args = (
            flat_h[a:e], w, b, flat_labels[a:e], cut(flat_temp),
            {k: cut(v) for k, v in flat_params.items()}, scale, cap, want_entropy,
            ignore_index, chunk_size, shard,
        )  # fmt: skip
        if grads:
            parts.append(checkpoint(_block, *args, use_reentrant=False))
        else:
            parts.append(_block(*args))
    if parts:
        logp, ent, outside, count = (torch.cat(p) for p in zip(*parts, strict=True))
    else:
        dtype = torch.promote_types(h.dtype, torch.float32)
        logp = torch.zeros(flat_labels.shape, dtype=dtype, device=h.device)
        ent = torch.zeros(0 if not want_entropy else n, dtype=dtype, device=h.device)
        outside = torch.zeros(flat_labels.shape, dtype=torch.bool, device=h.device)
        count = torch.zeros(n, dtype=torch.int64, device=h.device)
    return (
        logp.view(labels.shape),
        ent.view(batch) if want_entropy else None,
        outside.view(labels.shape),
        count.view(batch),
    )
