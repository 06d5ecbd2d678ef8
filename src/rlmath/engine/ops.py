"""The engine's torch operators (``torch.ops.rlmath.*``).

Each pass over the vocabulary is one operator registered with
``torch.library``: opaque to ``torch.compile`` and ``torch.export`` (which see
a single node with a shape-only fake implementation, so no graph break and no
recompilation per chunk count or thread count), and given a ``vmap`` rule
(one call per batch element) so that ``torch.func`` transforms compose with
it. Autograd is not registered here: the autograd functions of
:mod:`rlmath.engine.functions` call a forward and a backward operator.

The annotations are runtime objects in the ``typing`` forms (``List``,
``Optional``, ``Tuple``) from which every supported torch infers an
operator's schema. Every operator takes its tensors first and the fields of
:class:`rlmath.engine.config.OpConfig` last, flattened by
:meth:`~rlmath.engine.config.OpConfig.op_args`.
"""

from collections.abc import Callable
from typing import Any, List, Optional, Tuple

import torch
from torch.library import register_vmap
from torch.utils.flop_counter import register_flop_formula

from rlmath._operators import operator
from rlmath._validation import result_dtype
from rlmath.engine import impl
from rlmath.engine.config import OpConfig

__all__ = [
    "head_backward",
    "head_forward",
    "kl_backward",
    "kl_forward",
    "logits_backward",
    "logits_forward",
    "sum_pi_squared",
]


def _loop_vmap(op: Callable[..., Any]) -> Callable[..., Any]:
    """A ``vmap`` rule that calls ``op`` once per batch element and stacks the results."""

    def rule(info: Any, in_dims: tuple[Optional[int], ...], *args: Any) -> tuple[Any, Any]:
        results = []
        for i in range(info.batch_size):
            call = [
                a.select(d, i) if d is not None and isinstance(a, torch.Tensor) else a
                for a, d in zip(args, in_dims, strict=True)
            ]
            results.append(op(*call))
        if isinstance(results[0], torch.Tensor):
            return torch.stack(results), 0
        outs = tuple(torch.stack(list(parts)) for parts in zip(*results, strict=True))
        return outs, (0,) * len(outs)

    return rule


def _cdt(*tensors: torch.Tensor) -> torch.dtype:
    return result_dtype(*tensors)


# ------------------------------------------------------------------ logits


@operator("rlmath::logits_forward")
def logits_forward(
    logits: torch.Tensor,
    labels: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    row_index: Optional[torch.Tensor],
    sampling: Optional[torch.Tensor],
    kept: Optional[torch.Tensor],
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Label log-probs ``(M, K)``, entropy ``(M,)``, log-sum-exp ``(M,)``, and with a truncating
    sampler each row's threshold and kept-set size ``(M, 2)`` and the labels outside ``(M, K)``."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.logits_forward(logits, labels, temperature, row_index, cfg, sampling, kept)


@logits_forward.register_fake
def _(logits, labels, temperature, row_index, sampling, kept, backend, group, floats, ints):
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    want_entropy = cfg.want_entropy
    cdt, M = _cdt(logits), impl.num_rows(logits, row_index, cfg.narrow)
    logp = logits.new_empty((M, labels.shape[-1]) if labels is not None else (0,), dtype=cdt)
    ent = logits.new_empty((M,) if want_entropy else (0,), dtype=cdt)
    aux = logits.new_empty((M, 2) if cfg.sampler else (0,), dtype=cdt)
    outside = logits.new_empty(
        (M, labels.shape[-1]) if cfg.sampler and labels is not None else (0,), dtype=torch.bool
    )
    return logp, ent, logits.new_empty((M,), dtype=cdt), aux, outside


@operator("rlmath::logits_backward")
def logits_backward(
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    logits: torch.Tensor,
    labels: Optional[torch.Tensor],
    temperature: Optional[torch.Tensor],
    row_index: Optional[torch.Tensor],
    sampling: Optional[torch.Tensor],
    kept: Optional[torch.Tensor],
    aux: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> torch.Tensor:
    """The gradient of ``logits`` (its shape and dtype)."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.logits_backward(
        grad_logp, grad_entropy, logits, labels, temperature, row_index, lse, entropy, cfg,
        sampling, kept, aux,
    )  # fmt: skip


@logits_backward.register_fake
def _(grad_logp, grad_entropy, logits, *args):
    return torch.empty_like(logits)


# ------------------------------------------------------------------ KL


@operator("rlmath::kl_forward")
def kl_forward(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: Optional[torch.Tensor],
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``KL (N,)``, ``lse_z (N,)``, ``lse_r (N,)`` over the (sharded) vocabulary."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.kl_forward(logits, ref_logits, temperature, cfg)


@kl_forward.register_fake
def _(logits, ref_logits, *args):
    n = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    cdt = _cdt(logits, ref_logits)
    return tuple(logits.new_empty((n,), dtype=cdt) for _ in range(3))


@operator("rlmath::kl_backward")
def kl_backward(
    grad_kl: torch.Tensor,
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: Optional[torch.Tensor],
    lse_z: torch.Tensor,
    lse_r: torch.Tensor,
    kl: torch.Tensor,
    need_logits: bool,
    need_ref_logits: bool,
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``logits`` and ``ref_logits`` (empty where not needed)."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.kl_backward(
        grad_kl, logits, ref_logits, temperature, lse_z, lse_r, kl,
        need_logits, need_ref_logits, cfg,
    )  # fmt: skip


@kl_backward.register_fake
def _(grad_kl, logits, ref_logits, temperature, lse_z, lse_r, kl, need_logits, need_ref_logits,
      *args):  # fmt: skip
    gz = torch.empty_like(logits) if need_logits else logits.new_empty((0,))
    gr = torch.empty_like(ref_logits) if need_ref_logits else ref_logits.new_empty((0,))
    return gz, gr


# ------------------------------------------------------------------ fused head


@operator("rlmath::head_forward")
def head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    temperature: Optional[torch.Tensor],
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Label log-probs ``(N, K)``, entropy ``(N,)`` and log-sum-exp ``(N,)`` of the head."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.head_forward(hidden, weight, bias, labels, temperature, cfg)


@head_forward.register_fake
def _(hidden, weight, bias, labels, temperature, backend, group, floats, ints):
    want_entropy = OpConfig.from_op_args(backend, group, floats, ints).want_entropy
    cdt = _cdt(hidden, weight)
    n = labels.shape[0]
    logp = hidden.new_empty((n, labels.shape[-1]), dtype=cdt)
    ent = hidden.new_empty((n,) if want_entropy else (0,), dtype=cdt)
    return logp, ent, hidden.new_empty((n,), dtype=cdt)


@operator("rlmath::head_backward")
def head_backward(
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels: torch.Tensor,
    temperature: Optional[torch.Tensor],
    lse: torch.Tensor,
    entropy: torch.Tensor,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``hidden``, ``weight`` and ``bias`` (empty where not needed)."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.head_backward(
        grad_logp, grad_entropy, hidden, weight, bias, labels, temperature, lse, entropy,
        (need_hidden, need_weight, need_bias), cfg,
    )  # fmt: skip


@head_backward.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, labels, temperature, lse, entropy,
      need_hidden, need_weight, need_bias, *args):  # fmt: skip
    gh = torch.empty_like(hidden) if need_hidden else hidden.new_empty((0,))
    gw = torch.empty_like(weight) if need_weight else hidden.new_empty((0,))
    gb = torch.empty_like(bias) if need_bias and bias is not None else hidden.new_empty((0,))
    return gh, gw, gb


# ------------------------------------------------------------------ Σ π²


@operator("rlmath::sum_pi_squared")
def sum_pi_squared(
    logits: torch.Tensor,
    temperature: Optional[torch.Tensor],
    backend: str,
    group: str,
    floats: List[float],
    ints: List[int],
) -> torch.Tensor:
    """``Σ_v π_v²`` per row ``(N,)`` (no gradient)."""
    cfg = OpConfig.from_op_args(backend, group, floats, ints)
    return impl.pi_squared(logits, temperature, cfg)


@sum_pi_squared.register_fake
def _(logits, *args):
    n = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    return logits.new_empty((n,), dtype=_cdt(logits))


for _op in (
    logits_forward,
    logits_backward,
    kl_forward,
    kl_backward,
    head_forward,
    head_backward,
    sum_pi_squared,
):
    register_vmap(_op, _loop_vmap(_op))


# ------------------------------------------------------------------ FLOP counts

# torch.utils.flop_counter.FlopCounterMode sees each operator as one op: its
# count is that of the matmuls the fused head runs (it counts matmuls only; the
# logits operators have none). A shape is a tuple of ints, ``ints[9]`` the real
# columns of the weight (-1: all, :meth:`OpConfig.op_args`).


def _head_matmul_flops(hidden: Tuple[int, ...], weight: Tuple[int, ...], ints: List[int]) -> int:
    """FLOPs of one ``(N, H) @ (H, V)`` product over the weight's real rows."""
    real = weight[0] if ints[9] < 0 else ints[9]
    return 2 * hidden[0] * hidden[1] * real


@register_flop_formula(torch.ops.rlmath.head_forward)
def _head_forward_flops(hidden, weight, bias, labels, temperature, backend, group, floats, ints,
                        out_shape=None):  # fmt: skip
    return _head_matmul_flops(hidden, weight, ints)


@register_flop_formula(torch.ops.rlmath.head_backward)
def _head_backward_flops(grad_logp, grad_entropy, hidden, weight, bias, labels, temperature,
                         lse, entropy, need_hidden, need_weight, need_bias, backend, group,
                         floats, ints, out_shape=None):  # fmt: skip
    # Each block's logits are recomputed, then multiplied into each gradient asked for.
    return _head_matmul_flops(hidden, weight, ints) * (1 + int(need_hidden) + int(need_weight))
