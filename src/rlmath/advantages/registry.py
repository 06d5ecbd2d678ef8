"""Advantage estimators by name, with verl's names.

``get_advantage_estimator("grpo")`` returns the plain function; the registry
does not wrap or hide its signature. ``register_advantage_estimator`` adds a
custom estimator under a new name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

from rlmath._validation import check_choice

__all__ = [
    "get_advantage_estimator",
    "list_advantage_estimators",
    "register_advantage_estimator",
]

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, Callable[..., Any]] = {}


def _name_of(name: object) -> object:
    """verl passes its ``AdvantageEstimator`` enum members; use their string value."""
    return name.value if isinstance(name, enum.Enum) else name


def register_advantage_estimator(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering ``fn`` under ``name``; returns ``fn`` unchanged.

    Registering a different function under a taken name raises ``ValueError``
    unless ``override=True``.
    """
    key = _name_of(name)
    if not isinstance(key, str) or not key:
        raise TypeError(f"name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"an advantage estimator must be callable, got {type(fn).__name__}")
        current = _REGISTRY.get(key)
        if current is not None and current is not fn and not override:
            raise ValueError(
                f"advantage estimator name {key!r} is already registered to "
                f"{current.__module__}.{current.__qualname__}; pass override=True to replace it"
            )
        _REGISTRY[key] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """The estimator registered under ``name`` (a string or a verl enum member).

    Raises ``ValueError`` listing the valid names for an unknown name.
    """
    key = check_choice("advantage estimator", _name_of(name), _REGISTRY)
    return _REGISTRY[key]


def list_advantage_estimators() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)
