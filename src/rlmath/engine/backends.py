"""Which implementation runs a vocabulary operation: chosen visibly at the call.

Every vocabulary function takes ``backend: str = "auto"``. ``"torch"`` (pure
PyTorch, chunked; runs on every device and is the reference any other
backend is tested against) is always there; ``"triton"`` (CUDA kernels) is
loaded on first use when the ``triton`` package imports. ``"auto"`` picks the
registered backend of highest priority that accepts the input and, for a
backend registered with ``checked=True`` (Triton), has passed its self-check
for the operation's family of kernels on this device and dtype
(:mod:`rlmath.engine.self_check`: run once per process, values and gradients
against the pure-torch backend); a backend that fails it (a wrong result, a
kernel that does not compile) is passed over with one warning. The
environment variable ``RLMATH_BACKEND`` (``torch`` or ``triton``) replaces
``"auto"`` by that name, without a self-check. The choice is made once per
call, before the operator runs, and covers the single-process and
vocabulary-parallel paths alike.

A backend is a :class:`Kernels` set, one callable per pass (the pure-torch
ones in :mod:`rlmath.engine.torch_backend` document the signatures); the
engine's operators do everything else (labels, masks, temperature, the
combination of vocabulary shards, the gradient coefficients).
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BACKEND_ENV",
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

BACKEND_ENV = "RLMATH_BACKEND"
"""Environment variable that, set to a backend name, replaces ``backend="auto"`` by it."""

# Optional backends: imported on first use; the module registers its backend.
_OPTIONAL = {"triton": "rlmath.engine.triton_backend"}


@dataclass(frozen=True)
class Kernels:
    """One callable per pass over the vocabulary (see :mod:`rlmath.engine.torch_backend`).

    ``head_tiles`` optionally replaces :func:`rlmath.engine.policy.auto_tile_sizes`
    (same signature) as the rule that sizes the fused head's blocks for this
    backend's ``head_stats`` and ``head_grad``.

    Sums over the vocabulary come back added up per row (``(N,)``). A backend
    that gives ``logits_max`` (the rows' max alone) also takes ``shift=`` (the
    rows' global max) in ``logits_stats``, ``pi_squared_stats`` and
    ``kl_stats`` and then returns its sums per 128-column tile (``(N, n)``),
    which the engine adds across shards in the fixed tree of
    :mod:`rlmath.engine.tree`: bitwise one process's result over a vocabulary
    split on the tile grid.

    A backend that gives ``head_tile_nodes`` computes the fused head's
    per-tile statistics in the tree of :data:`rlmath.engine.stats.STATS_TREE`
    and returns a shard's nodes of it, which the engine finishes across
    shards (:func:`rlmath.engine.stats.combine_nodes`): the same bits as one
    process over a vocabulary split on the tile grid.

    ``kept_thresholds`` (optional) finds a truncating sampler's global
    thresholds over a vocabulary split between processes
    (:func:`rlmath.engine.torch_backend.kept_shards.sharded_thresholds`).
    """

    logits_stats: Callable[..., Any]
    logits_grad: Callable[..., Any]
    kl_stats: Callable[..., Any]
    kl_grad: Callable[..., Any]
    head_stats: Callable[..., Any]
    head_grad: Callable[..., Any]
    pi_squared_stats: Callable[..., Any]
    head_tiles: Callable[..., tuple[int, int]] | None = None
    logits_max: Callable[..., Any] | None = None
    head_tile_nodes: Callable[..., Any] | None = None
    kept_thresholds: Callable[..., Any] | None = None


@dataclass(frozen=True)
class Backend:
    """A named kernel set, the inputs it accepts, and its rank for ``"auto"``.

    With ``checked``, ``"auto"`` chooses the backend for a family of kernels
    only once it has matched the pure-torch backend on a small input of that
    family, device and dtype (:mod:`rlmath.engine.self_check`).
    """

    name: str
    kernels: Kernels
    supports: Callable[[torch.Tensor], bool] = field(default=lambda t: True)
    priority: int = 0
    checked: bool = False


_BACKENDS: dict[str, Backend] = {}
_UNAVAILABLE: dict[str, str] = {}
# Self-check outcomes: (backend, family, device, dtype) -> None (passed) or the reason it failed.
_CHECKS: dict[tuple[str, str, str, torch.dtype], str | None] = {}


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


def _env_backend() -> str | None:
    """The backend named by ``RLMATH_BACKEND``, ``None`` when unset or empty; a bad name raises."""
    value = os.environ.get(BACKEND_ENV, "").strip()
    if not value:
        return None
    valid = sorted({*BACKEND_NAMES, *_BACKENDS} - {"auto"})
    if value not in valid:
        raise ValueError(
            f"the environment variable {BACKEND_ENV}={value!r} is not a backend; "
            f"valid values are: {', '.join(valid)} (or unset it for 'auto')"
        )
    return value


def self_check_failure(
    name: str, family: str, device: torch.device, dtype: torch.dtype
) -> str | None:
    """Why backend ``name`` failed its self-check for ``family`` on ``device`` and ``dtype``; ``None``
    if it passed. Runs the check the first time (once per process for each key) and warns once
    when it fails."""
    key = (name, family, str(device), dtype)
    if key not in _CHECKS:
        from rlmath.engine.self_check import run_self_check

        # The check runs a backward: also from a caller under no_grad or inference_mode.
        with torch.inference_mode(False), torch.enable_grad():
            reason = run_self_check(name, family, dtype, device)
        _CHECKS[key] = reason
        if reason is not None:
            warnings.warn(
                f"rlmath: the {name!r} backend failed its self-check for the {family} kernels "
                f"on {device} in {dtype} ({reason}); backend='auto' uses the next backend for "
                f"them in this process. Set {BACKEND_ENV}={name} or pass backend={name!r} to "
                "use it anyway.",
                RuntimeWarning,
                stacklevel=3,
            )
    return _CHECKS[key]


@torch.compiler.assume_constant_result
def _auto(family: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The backend ``"auto"`` runs ``family`` with for tensors of ``device`` and ``dtype`` (a
    compiler takes the answer as a constant: the self-check runs outside any trace)."""
    probe = torch.empty(0, dtype=dtype, device=device)
    for name in available_backends(probe):
        if family is not None and _BACKENDS[name].checked:
            if self_check_failure(name, family, device, dtype) is not None:
                continue
        return name
    return "torch"


def resolve_backend(backend: object, tensor: torch.Tensor, family: str | None = None) -> str:
    """The concrete backend that runs an operation on ``tensor``, for ``backend`` as given.

    ``family`` names the operation's kernels for the self-check of a
    ``checked`` backend under ``"auto"`` (``"logits"``, ``"kl"``,
    ``"pi_squared"``, ``"head"``; ``None``: no check). ``RLMATH_BACKEND``, when
    set, replaces ``"auto"``.

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: an unknown name (the message lists the valid ones), a
            backend that is not available here (and why), one that does
            not accept ``tensor``'s device or dtype, or a bad ``RLMATH_BACKEND``.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend == "auto":
        forced = _env_backend()
        if forced is None:
            if tensor.device.type == "cuda":
                for name in _OPTIONAL:
                    _load_optional(name)
            return _auto(family, tensor.device, tensor.dtype)
        backend = forced
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
