"""Which implementation runs the fused head, chosen at call time.

Backends (their names, priorities and the tensors they accept) are those of
:mod:`rlmath.logprobs.dispatch`: a backend registered there, say a Triton one
for CUDA, also registers its fused-head kernel here with
:func:`register_fused_kernel`. :func:`get_fused_kernel` walks the logprobs
backends that accept the hidden states, best first, and returns the first
fused kernel it finds; the pure-torch kernel (:class:`FusedLinearLogProbsFn`)
runs everywhere and is the reference any other kernel must match in tests.

A kernel is called as ``kernel(hidden, weight, bias, labels, valid,
temperature, want_entropy, rows, tile)`` with the arguments documented in
:class:`rlmath.fused_head._function.FusedLinearLogProbsFn` and returns
``(logp (N,), entropy (N,))``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlmath.fused_head._function import FusedLinearLogProbsFn
from rlmath.logprobs.dispatch import available_backends

__all__ = ["fused_backends", "get_fused_kernel", "register_fused_kernel"]

_KERNELS: dict[str, Callable[..., object]] = {"torch": FusedLinearLogProbsFn.apply}


def register_fused_kernel(backend: str, kernel: Callable[..., object]) -> None:
    """Add (or replace) the fused-head kernel of ``backend`` (a name of ``rlmath.logprobs.dispatch``)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    _KERNELS[backend] = kernel


def fused_backends(tensor: torch.Tensor | None = None) -> list[str]:
    """Backends with a fused kernel (those accepting ``tensor`` if given), best first."""
    ranked = [name for name in available_backends(tensor) if name in _KERNELS]
    return ranked or ["torch"]


def get_fused_kernel(tensor: torch.Tensor, backend: str | None = None) -> Callable[..., object]:
    """The fused kernel for ``tensor`` (the hidden states): from ``backend`` if named, else the best."""
    if backend is not None:
        if backend not in _KERNELS:
            raise ValueError(
                f"unknown backend {backend!r}; valid values are: {', '.join(sorted(_KERNELS))}"
            )
        return _KERNELS[backend]
    return _KERNELS[fused_backends(tensor)[0]]
