"""Which implementation runs a vocabulary operation: chosen visibly at the call.

Every vocabulary function takes ``backend: str = "auto"``. ``"torch"`` (pure
PyTorch, chunked; runs on every device and is the reference any other
backend is tested against) is always there; ``"triton"`` (CUDA kernels) is
loaded on first use when the ``triton`` package imports. ``"auto"`` picks the
registered backend of highest priority that accepts the input. The choice is
made once per call, before the operator runs, and covers the single-process
and vocabulary-parallel paths alike.

A backend is a :class:`Kernels` set, one callable per pass (the pure-torch
ones in :mod:`rlmath.engine.torch_backend` document the signatures); the
engine's operators do everything else (labels, masks, temperature, the
combination of vocabulary shards, the gradient coefficients).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "Kernels",
    "available_backends",
    "get_kernels",
    "register_backend",
    "resolve_backend",
]

BACKEND_NAMES = ("auto", "torch", "triton")
"""Every value the ``backend`` argument accepts."""

# Optional backends: imported on first use; the module registers its backend.
_OPTIONAL = {"triton": "rlmath.engine.triton_backend"}


@dataclass(frozen=True)
class Kernels:
    """One callable per pass over the vocabulary (see :mod:`rlmath.engine.torch_backend`).

    ``head_tiles`` optionally replaces :func:`rlmath.engine.policy.auto_tile_sizes`
    (same signature) as the rule that sizes the fused head's blocks for this
    backend's ``head_stats`` and ``head_grad``.
    """

    logits_stats: Callable[..., Any]
    logits_grad: Callable[..., Any]
    kl_stats: Callable[..., Any]
    kl_grad: Callable[..., Any]
    head_stats: Callable[..., Any]
    head_grad: Callable[..., Any]
    pi_squared_stats: Callable[..., Any]
    head_tiles: Callable[..., tuple[int, int]] | None = None


@dataclass(frozen=True)
class Backend:
    """A named kernel set, the inputs it accepts, and its rank for ``"auto"``."""

    name: str
    kernels: Kernels
    supports: Callable[[torch.Tensor], bool] = field(default=lambda t: True)
    priority: int = 0


_BACKENDS: dict[str, Backend] = {}
_UNAVAILABLE: dict[str, str] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; for ``"auto"``, higher ``priority`` is tried first."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
    if not isinstance(backend.kernels, Kernels):
        raise TypeError(f"backend {backend.name!r}: kernels must be a Kernels set")
    _BACKENDS[backend.name] = backend
    _UNAVAILABLE.pop(backend.name, None)


def _load_optional(name: str) -> str | None:
    """Import optional backend ``name`` once; ``None`` if it is available, else why not."""
    if name in _BACKENDS:
        return None
    if name not in _UNAVAILABLE:
        try:
            importlib.import_module(_OPTIONAL[name])
        except ImportError as exc:
            _UNAVAILABLE[name] = str(exc) or type(exc).__name__
        else:
            if name not in _BACKENDS:
                _UNAVAILABLE[name] = f"{_OPTIONAL[name]} registered no backend"
    return _UNAVAILABLE.get(name)


def available_backends(tensor: torch.Tensor | None = None) -> list[str]:
    """Names of the registered backends (those accepting ``tensor`` if given), best first."""
    if tensor is not None and tensor.device.type == "cuda":
        for name in _OPTIONAL:
            _load_optional(name)
    ranked = sorted(_BACKENDS.values(), key=lambda b: -b.priority)
    return [b.name for b in ranked if tensor is None or b.supports(tensor)]


def resolve_backend(backend: object, tensor: torch.Tensor) -> str:
    """The concrete backend that runs an operation on ``tensor``, for ``backend`` as given.

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: an unknown name (the message lists the valid ones), a
            backend that is not available here (and why), or one that does
            not accept ``tensor``'s device or dtype.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend == "auto":
        return available_backends(tensor)[0]
    if backend not in _BACKENDS:
        if backend in _OPTIONAL:
            reason = _load_optional(backend)
            if reason is not None:
                raise ValueError(f"backend {backend!r} is not available: {reason}")
        else:
            valid = sorted({*BACKEND_NAMES, *_BACKENDS})
            raise ValueError(f"unknown backend {backend!r}; valid values are: {', '.join(valid)}")
    chosen = _BACKENDS[backend]
    if not chosen.supports(tensor):
        raise ValueError(
            f"backend {backend!r} does not accept {tensor.dtype} tensors on {tensor.device}; "
            f"backends that do: {', '.join(available_backends(tensor))}"
        )
    return backend


def get_kernels(name: str) -> Kernels:
    """The kernels of the registered backend ``name`` (a name :func:`resolve_backend` returned)."""
    return _BACKENDS[name].kernels
