"""Which implementation runs an operation, chosen at call time.

Every public function here looks its kernel up with :func:`get_kernel`
(``op`` is ``"log_probs_entropy"`` or ``"kl"``). Backends are tried in
priority order and the first one whose ``supports(tensor)`` accepts the logits
wins. Only the pure-torch backend (``"torch"``) exists today: it runs on every
device and is the reference any other backend must match in tests. A Triton
backend for CUDA would register itself here with the same call signatures:

``log_probs_entropy(logits, labels, temperature, want_entropy, chunk, rows)``
    → ``(logp (M, K), entropy (M,))``; see
    :class:`rlmath.logprobs._functions.LogProbsEntropyFn`.
``kl(logits, ref_logits, temperature, chunk)`` → ``kl (N,)``; see
    :class:`rlmath.logprobs._functions.KLFromLogitsFn`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from rlmath.logprobs._functions import KLFromLogitsFn, LogProbsEntropyFn

__all__ = ["OPS", "Backend", "available_backends", "get_kernel", "register_backend"]

OPS = ("log_probs_entropy", "kl")


@dataclass(frozen=True)
class Backend:
    """A named set of kernels, one per op in :data:`OPS`, and the inputs it accepts."""

    name: str
    kernels: Mapping[str, Callable[..., object]]
    supports: Callable[[torch.Tensor], bool] = field(default=lambda t: True)
    priority: int = 0


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; higher ``priority`` is tried first."""
    missing = [op for op in OPS if op not in backend.kernels]
    if missing:
        raise ValueError(f"backend {backend.name!r} lacks kernels for {missing}")
    _BACKENDS[backend.name] = backend


def available_backends(tensor: torch.Tensor | None = None) -> list[str]:
    """Names of the registered backends (those accepting ``tensor`` if given), best first."""
    ranked = sorted(_BACKENDS.values(), key=lambda b: -b.priority)
    return [b.name for b in ranked if tensor is None or b.supports(tensor)]


def get_kernel(op: str, tensor: torch.Tensor, backend: str | None = None) -> Callable[..., object]:
    """The kernel for ``op`` on ``tensor``: from ``backend`` if named, else the best that accepts it."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid values are: {', '.join(OPS)}")
    if backend is not None:
        if backend not in _BACKENDS:
            raise ValueError(
                f"unknown backend {backend!r}; valid values are: {', '.join(sorted(_BACKENDS))}"
            )
        return _BACKENDS[backend].kernels[op]
    name = available_backends(tensor)[0]
    return _BACKENDS[name].kernels[op]


register_backend(
    Backend(
        name="torch",
        kernels={"log_probs_entropy": LogProbsEntropyFn.apply, "kl": KLFromLogitsFn.apply},
        priority=-1,
    )
)
