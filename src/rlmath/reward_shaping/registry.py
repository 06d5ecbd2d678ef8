"""Reward shaping functions by name.

Every registered function has the signature
``fn(token_level_rewards, response_mask, *, truncated=None, <own keyword scalars>)
-> RewardShaping(token_level_rewards, response_mask, metrics)``: ``(B, T)``
token rewards and mask in, the shaped rewards (fp32, fp64 for fp64 input,
0 at masked positions), the mask to train with and detached 0-d metrics
out, so shapings chain. ``truncated`` is a bool ``(B,)`` tensor, True where
generation stopped at the length limit instead of at an end-of-sequence
token; the shapings that need it raise without it. The registry only maps
names, it does not wrap the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlmath._validation import check_choice

__all__ = ["get_reward_shaping", "list_reward_shapings", "register_reward_shaping"]

ShapingFn = Callable[..., Any]

_REGISTRY: dict[str, ShapingFn] = {}


def list_reward_shapings() -> list[str]:
    """Every registered reward-shaping name, sorted."""
    return sorted(_REGISTRY)


def get_reward_shaping(name: str) -> ShapingFn:
    """The function registered under ``name``; unknown names raise listing the valid ones."""
    return _REGISTRY[check_choice("reward shaping", name, _REGISTRY)]


def register_reward_shaping(
    name: str, *, override: bool = False
) -> Callable[[ShapingFn], ShapingFn]:
    """Decorator registering ``fn`` under ``name``; a taken name raises unless ``override=True``."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")

    def decorator(fn: ShapingFn) -> ShapingFn:
        if not callable(fn):
            raise TypeError(
                f"register_reward_shaping({name!r}) needs a callable, got {type(fn).__name__}"
            )
        if name in _REGISTRY and _REGISTRY[name] is not fn and not override:
            raise ValueError(
                f"reward shaping {name!r} is already registered; pass override=True to replace it"
            )
        _REGISTRY[name] = fn
        return fn

    return decorator
