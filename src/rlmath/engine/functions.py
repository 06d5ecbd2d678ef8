"""The engine's autograd functions: one per operation, for one process and vocabulary shards alike.

Each function's forward calls a forward operator of :mod:`rlmath.engine.ops`
and saves its inputs with ``save_for_backward`` (so an input modified in place
before backward, a temperature tensor included, raises as it would for
torch's own operations); its backward calls the matching backward operator
through a second autograd function. Both are written in the ``setup_context``
style with generated ``vmap`` rules, so ``torch.func.grad``, ``vmap`` and
``jacrev`` apply, and ``torch.compile`` traces them as two opaque operators.

Gradients are first order: the gradient these functions return carries a
graph node that raises :class:`DoubleBackwardError` if it is differentiated
again (``create_graph=True`` followed by a second backward, Hessian-vector
products, gradient penalties through the log-probs), instead of silently
contributing zero.
"""

from __future__ import annotations

from typing import Any

import torch

from rlmath.engine import impl, ops
from rlmath.engine.config import OpConfig

__all__ = [
    "DoubleBackwardError",
    "FusedHeadFunction",
    "KLFunction",
    "LogProbsEntropyFunction",
]


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


class _Function(torch.autograd.Function):
    """``torch.autograd.Function`` whose ``apply`` skips the binding of default arguments.

    ``Function.apply`` binds its arguments to ``forward``'s signature through
    :mod:`inspect` on every call (tens of microseconds); the engine passes
    every argument positionally, so outside functorch transforms (and without
    a tensor a finished transform left wrapped) the call goes straight to the
    C++ ``apply``. A compiler sees the usual ``apply``.
    """

    @classmethod
    def apply(cls, *args: Any) -> Any:  # type: ignore[override]
        if torch._C._are_functorch_transforms_active() or any(
            isinstance(a, torch.Tensor) and _is_wrapped(a) for a in args
        ):
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)  # type: ignore[misc]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct(x: torch.Tensor) -> bool:
    """Run an operator's Python body directly instead of through the dispatcher.

    The operators exist for compilers, ``torch.func`` transforms and dispatch
    modes (which see one opaque op); a plain eager call of a plain tensor
    gets the same result from the body without the dispatch (and the packing
    of the configuration into the operator's arguments).
    """
    return (
        type(x) in _PLAIN
        and not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
        and x.device.type in ("cpu", "cuda")
    )


def _run(x: torch.Tensor, body: Any, *args: Any) -> Any:
    """``body(*args)`` under the device guard the dispatcher sets (CUDA: ``x``'s device current)."""
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            return body(*args)
    return body(*args)


class DoubleBackwardError(RuntimeError):
    """Raised when a gradient of an rlmath vocabulary function is differentiated again."""


def _nan_where_unheld(grad_logp: Any, logp: torch.Tensor) -> Any:
    """The upstream gradient with NaN where a used log-prob is NaN.

    A label that is not a token id has log-prob NaN; where the loss uses it
    (a nonzero upstream gradient) the gradient becomes NaN too, instead of a
    finite value computed as if the label did not exist. A masked-out use
    (upstream gradient exactly 0) contributes nothing, as for any other label.
    """
    if grad_logp is None:
        return None
    return torch.where(torch.isnan(logp) & (grad_logp != 0), float("nan"), grad_logp)


def _no_double_backward(name: str) -> DoubleBackwardError:
    return DoubleBackwardError(
        f"{name}: rlmath's vocabulary functions have first-order gradients only; "
        "differentiating their gradient again (double backward, Hessian-vector "
        "products, gradient penalties) is not supported. Compute those terms from "
        "plain torch.log_softmax on the logits instead."
    )


class LogProbsEntropyFunction(_Function):
    """Label log-probs and/or entropy of ``softmax(logits / T)`` (any vocabulary shard).

    ``apply(logits, labels, temperature, row_index, sampling, kept, config)``:

    - ``logits``: ``(..., V)`` raw logits (this process's columns), any floating dtype.
    - ``labels``: ``(M, K)`` int64 global token ids, or ``None`` (no log-probs).
    - ``temperature``: a tensor broadcastable to ``logits.shape[:-1]``, or
      ``None`` (``config.temperature`` applies).
    - ``row_index``: ``(M,)`` int64 rows of 2-D ``logits`` to use, or ``None``
      (every row, or ``config.narrow``).
    - ``sampling``: ``logits.shape[:-1] + (3,)`` float64 per-row top-k, top-p
      and min-p of a truncating sampler (``config.sampler``), or ``None``.
    - ``kept``: a replayed kept set, ``(M, V)`` bool or ``(M, K')`` int64 ids
      padded with -1, or ``None``.
    - ``config``: :class:`~rlmath.engine.config.OpConfig`.

    Returns ``(logp (M, K), entropy (M,), lse (M,), aux, outside)`` in the
    compute dtype (fp64 for fp64 logits, else fp32); outputs not asked for are
    empty. With a truncating sampler the softmax is over each row's kept set:
    ``aux`` ``(M, 2)`` holds each row's threshold and kept-set size, and
    ``outside`` ``(M, K)`` bool the labels the rule leaves out (see
    :func:`rlmath.engine.impl.logits_forward`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        temperature: torch.Tensor | None,
        row_index: torch.Tensor | None,
        sampling: torch.Tensor | None,
        kept: torch.Tensor | None,
        config: OpConfig,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if _direct(logits):
            return _run(
                logits, impl.logits_forward,
                logits, labels, temperature, row_index, config, sampling, kept,
            )  # fmt: skip
        return ops.logits_forward(
            logits, labels, temperature, row_index, sampling, kept, *config.op_args()
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        logits, labels, temperature, row_index, sampling, kept, config = inputs
        logp, ent, lse, aux, outside = output
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(
            logits, labels, temperature, row_index, sampling, kept, lse, ent, logp, aux
        )
        ctx.config = config
        ctx.mark_non_differentiable(lse, aux, outside)
        if labels is None:
            ctx.mark_non_differentiable(logp)
        if not config.want_entropy:
            ctx.mark_non_differentiable(ent)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Any, grad_ent: Any, grad_lse: Any, grad_aux: Any, grad_out: Any
    ) -> tuple[Any, ...]:
        logits, labels, temperature, row_index, sampling, kept, lse, ent, logp, aux = (
            ctx.saved_tensors
        )
        nones = (None,) * 6
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_ent is None):
            return None, *nones
        if labels is not None:
            grad_logp = _nan_where_unheld(grad_logp, logp)
        grad = _LogProbsEntropyGrad.apply(
            grad_logp, grad_ent, logits, labels, temperature, row_index, sampling, kept, aux,
            lse, ent, ctx.config,
        )  # fmt: skip
        return grad, *nones


class _LogProbsEntropyGrad(_Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        grad_logp: torch.Tensor | None,
        grad_ent: torch.Tensor | None,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        temperature: torch.Tensor | None,
        row_index: torch.Tensor | None,
        sampling: torch.Tensor | None,
        kept: torch.Tensor | None,
        aux: torch.Tensor,
        lse: torch.Tensor,
        ent: torch.Tensor,
        config: OpConfig,
    ) -> torch.Tensor:
        if _direct(logits):
            return _run(
                logits, impl.logits_backward,
                grad_logp, grad_ent, logits, labels, temperature, row_index, lse, ent, config,
                sampling, kept, aux,
            )  # fmt: skip
        return ops.logits_backward(
            grad_logp, grad_ent, logits, labels, temperature, row_index, sampling, kept, aux,
            lse, ent, *config.op_args(),
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise _no_double_backward("log-probs / entropy from logits")


class KLFunction(_Function):
    """Exact ``KL(softmax(z/T) ‖ softmax(r/T))`` per row (any vocabulary shard).

    ``apply(logits, ref_logits, temperature, config)`` with logits of the same
    ``(..., V)`` shape; returns ``(kl (N,), lse_z (N,), lse_r (N,))`` in the
    compute dtype (fp64 if either input is fp64). Differentiable w.r.t. both.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        logits: torch.Tensor,
        ref_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        config: OpConfig,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if _direct(logits):
            return _run(logits, impl.kl_forward, logits, ref_logits, temperature, config)
        return ops.kl_forward(logits, ref_logits, temperature, *config.op_args())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        logits, ref_logits, temperature, config = inputs
        kl, lse_z, lse_r = output
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, ref_logits, temperature, lse_z, lse_r, kl)
        ctx.config = config
        ctx.mark_non_differentiable(lse_z, lse_r)

    @staticmethod
    def backward(ctx: Any, grad_kl: Any, grad_lz: Any, grad_lr: Any) -> tuple[Any, ...]:  # type: ignore[override]
        logits, ref_logits, temperature, lse_z, lse_r, kl = ctx.saved_tensors
        need_z, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_kl is None or not (need_z or need_r):
            return None, None, None, None
        gz, gr = _KLGrad.apply(
            grad_kl, logits, ref_logits, temperature, lse_z, lse_r, kl, need_z, need_r, ctx.config
        )
        return (gz if need_z else None), (gr if need_r else None), None, None


class _KLGrad(_Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        grad_kl: torch.Tensor,
        logits: torch.Tensor,
        ref_logits: torch.Tensor,
        temperature: torch.Tensor | None,
        lse_z: torch.Tensor,
        lse_r: torch.Tensor,
        kl: torch.Tensor,
        need_z: bool,
        need_r: bool,
        config: OpConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _direct(logits):
            return _run(
                logits, impl.kl_backward,
                grad_kl, logits, ref_logits, temperature, lse_z, lse_r, kl, need_z, need_r, config,
            )  # fmt: skip
        return ops.kl_backward(
            grad_kl, logits, ref_logits, temperature, lse_z, lse_r, kl, need_z, need_r,
            *config.op_args(),
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise _no_double_backward("KL from logits")


class FusedHeadFunction(_Function):
    """Label log-probs and entropy of ``(hidden @ weight.T + bias) / T`` (any vocabulary shard).

    ``apply(hidden, weight, bias, labels, temperature, config)``:

    - ``hidden``: ``(..., H)``; ``weight``: ``(V, H)`` (this process's rows),
      ``bias``: ``(V,)`` or ``None``, all of one dtype.
    - ``labels``: ``(N, K)`` int64 global token ids, ``N`` the rows of ``hidden``.
    - ``temperature``: a tensor broadcastable to ``hidden.shape[:-1]``, or ``None``.

    Returns ``(logp (N, K), entropy (N,), lse (N,))`` in the compute dtype.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        temperature: torch.Tensor | None,
        config: OpConfig,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ops.head_forward(hidden, weight, bias, labels, temperature, *config.op_args())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        hidden, weight, bias, labels, temperature, config = inputs
        logp, ent, lse = output
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, temperature, lse, ent, logp)
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        if not config.want_entropy:
            ctx.mark_non_differentiable(ent)

    @staticmethod
    def backward(ctx: Any, grad_logp: Any, grad_ent: Any, grad_lse: Any) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, labels, temperature, lse, ent, logp = ctx.saved_tensors
        need = tuple(bool(x) for x in ctx.needs_input_grad[:3])
        nones = (None, None, None)
        if not any(need) or (grad_logp is None and grad_ent is None):
            return None, None, None, *nones
        grad_logp = _nan_where_unheld(grad_logp, logp)
        gh, gw, gb = _FusedHeadGrad.apply(
            grad_logp, grad_ent, hidden, weight, bias, labels, temperature, lse, ent,
            need, ctx.config,
        )  # fmt: skip
        return (
            (gh if need[0] else None),
            (gw if need[1] else None),
            (gb if need[2] else None),
            *nones,
        )


class _FusedHeadGrad(_Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(  # type: ignore[override]
        grad_logp: torch.Tensor | None,
        grad_ent: torch.Tensor | None,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        temperature: torch.Tensor | None,
        lse: torch.Tensor,
        ent: torch.Tensor,
        need: tuple[bool, bool, bool],
        config: OpConfig,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ops.head_backward(
            grad_logp, grad_ent, hidden, weight, bias, labels, temperature, lse, ent,
            need[0], need[1], need[2], *config.op_args(),
        )  # fmt: skip

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise _no_double_backward("fused LM head")
