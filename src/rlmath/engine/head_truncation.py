"""The LM head's log-probs and entropy under a sampler's kept set, one block of rows at a time.

A sampler's kept set is a threshold on each row's logits (top-k, top-p, min-p:
:mod:`rlmath.engine.sampling`), which needs the whole row. So where the plain
fused head splits the vocabulary into tiles, this path takes a block of rows
whole: their ``(rows, V)`` logits are computed as the head computes them
(``hidden @ weight.T + bias`` in the inputs' dtype, then ``logit_scale`` and
``softcap`` in fp32), handed to the logits operator with the sampler's
arguments, and dropped; backward recomputes each block and accumulates the
weight and bias gradients in place (one fp32 buffer each, as the plain fused
head does). Memory: one block of logits, at most :data:`BLOCK_ENTRIES`
entries (and its gradients in backward), whatever the number of rows.

Over vocabulary shards each rank forms its columns of the block and the
logits operator finds the global kept set and statistics
(:mod:`rlmath.engine.torch_backend.kept_shards`); every rank walks the same
blocks. The gradient of the hidden states, each rank's share through its own
rows of the head, is summed over the group (unless the caller sums it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlmath.engine.groups import all_reduce

__all__ = ["BLOCK_ENTRIES", "truncated_head"]


BLOCK_ENTRIES = 1 << 23
"""Logits per block of rows: 32 MiB in fp32 (the plain fused head's block on a CPU)."""


def _rows(value: Any, batch: tuple[int, ...]) -> Any:
    """A per-row tensor broadcast to ``batch`` and flattened (``(N,)``); anything else as is."""
    if isinstance(value, torch.Tensor):
        return value.expand(batch).reshape(-1)
    return value


@dataclass
class _Spec:
    """The non-tensor arguments of one call, and the per-row tensors cut per block."""

    labels: torch.Tensor
    temperature: Any
    params: dict[str, Any]
    scale: float
    cap: float
    want_entropy: bool
    ignore_index: int | None
    chunk_size: int | None
    backend: object
    shard: dict[str, Any]
    step: int
    group: Any
    reduce_grad_hidden: bool

    def block(self, a: int, e: int) -> dict[str, Any]:
        """The logits operator's keyword arguments for rows ``[a, e)``."""

        def cut(v: Any) -> Any:
            return v[a:e] if isinstance(v, torch.Tensor) else v

        return {
            "temperature": cut(self.temperature),
            "ignore_index": self.ignore_index,
            "chunk_size": self.chunk_size,
            "backend": self.backend,
            "kept_stats": True,
            **{k: cut(v) for k, v in self.params.items()},
            **self.shard,
        }


def _outputs(z: torch.Tensor, labels: torch.Tensor, kw: dict[str, Any]) -> Any:
    from rlmath.log_probs import log_probs_and_entropy_from_logits

    return log_probs_and_entropy_from_logits(z, labels, **kw)


class _TruncatedHead(torch.autograd.Function):
    """Forward: each block's outputs, nothing kept but the inputs. Backward: each block's
    logits again, the gradient of its product ``u``, and from it ``grad_hidden`` (its rows)
    and the weight and bias gradients, accumulated in place in one fp32 buffer each."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, spec: _Spec
    ) -> tuple[torch.Tensor, ...]:
        n = h.shape[0]
        parts = []
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, n, spec.step):
                e = min(n, a + spec.step)
                z = _softmax_logits(torch.nn.functional.linear(h[a:e], w, b), spec.scale, spec.cap)
                out = _outputs(z, spec.labels[a:e], spec.block(a, e))
                ent = out.entropy if spec.want_entropy else z.new_zeros(0)
                parts.append((out.log_probs, ent, out.outside, out.kept_count))
        logp, ent, outside, count = (torch.cat(p) for p in zip(*parts, strict=True))
        ctx.save_for_backward(h, w, b)
        ctx.spec = spec
        ctx.mark_non_differentiable(outside, count)
        ctx.set_materialize_grads(False)  # an unused output: None, and no work for it
        return logp, ent, outside, count

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None, *_: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        h, w, b = ctx.saved_tensors
        spec: _Spec = ctx.spec
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(w.dtype, torch.float32)
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad_b = torch.zeros(b.shape, dtype=acc, device=b.device) if need_b else None
        n = h.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, n, spec.step):
                e = min(n, a + spec.step)
                hb = h[a:e]
                with torch.enable_grad():
                    u = torch.nn.functional.linear(hb, w, b).detach().requires_grad_()
                    z = _softmax_logits(u, spec.scale, spec.cap)
                    out = _outputs(z, spec.labels[a:e], spec.block(a, e))
                    ys, gs = [], []
                    if g_logp is not None:
                        ys.append(out.log_probs)
                        gs.append(g_logp[a:e])
                    if g_ent is not None and spec.want_entropy:
                        ys.append(out.entropy)
                        gs.append(g_ent[a:e])
                    if not ys:
                        continue
                    (gu,) = torch.autograd.grad(ys, [u], gs)
                if grad_h is not None:
                    grad_h[a:e] = gu @ w
                if grad_w is not None:
                    grad_w.addmm_(gu.t().to(acc), hb.to(acc))
                if grad_b is not None:
                    grad_b.add_(gu.sum(0).to(acc))
        if grad_h is not None and spec.group is not None and spec.reduce_grad_hidden:
            grad_h = all_reduce(grad_h, "sum", spec.group)
        return (
            grad_h,
            grad_w.to(w.dtype) if grad_w is not None else None,
            grad_b.to(b.dtype) if grad_b is not None else None,
            None,
        )


def _softmax_logits(u: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """The logits the softmax sees from the head's product ``u = h @ w.T + b`` (in the
    inputs' dtype): ``cap·tanh(scale·u / cap)`` in fp32 (fp64 for fp64 inputs)."""
    z = u.to(torch.promote_types(u.dtype, torch.float32))
    if scale != 1.0:
        z = z * scale
    if cap:
        z = cap * torch.tanh(z / cap)
    return z


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
    backend: object = "auto",
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
    vocabulary's real tokens, as the logits functions take them. ``backend``
    runs each block's logits (their product with the head is PyTorch's).
    """
    batch = tuple(h.shape[:-1])
    n = math.prod(batch)
    shard: dict[str, Any] = {}
    if vocab_parallel is not None:
        shard = {"vocab_parallel": vocab_parallel, "vocab_size": vocab_size}
        real = w.shape[0]  # the logits operator leaves the padding out
    w, b = w[:real], (b[:real] if b is not None else None)
    spec = _Spec(
        labels=labels.reshape(n, *labels.shape[len(batch) :]),
        temperature=_rows(temperature, batch),
        params={k: _rows(v, batch) for k, v in params.items()},
        scale=scale, cap=cap, want_entropy=want_entropy, ignore_index=ignore_index,
        chunk_size=chunk_size, backend=backend, shard=shard, step=max(1, BLOCK_ENTRIES // max(real, 1)),
        group=group if vocab_parallel is not None else None,
        reduce_grad_hidden=reduce_grad_hidden,
    )  # fmt: skip
    flat_h = h.reshape(n, h.shape[-1])
    if n == 0:
        dtype = torch.promote_types(h.dtype, torch.float32)
        logp = torch.zeros(spec.labels.shape, dtype=dtype, device=h.device)
        ent = torch.zeros(n, dtype=dtype, device=h.device)
        outside = torch.zeros(spec.labels.shape, dtype=torch.bool, device=h.device)
        count = torch.zeros(n, dtype=torch.int64, device=h.device)
    else:
        logp, ent, outside, count = _TruncatedHead.apply(flat_h, w, b, spec)
    return (
        logp.view(labels.shape),
        ent.view(batch) if want_entropy else None,
        outside.view(labels.shape),
        count.view(batch),
    )
