"""Policy-loss registry: names (verl's, plus ``gspo_token``, ``gspo_seq`` and ``reinforce``) to functions.

Each loss registers itself where it is defined, with ``@register_policy_loss(name)``
(as the advantage estimators do with ``@register_advantage_estimator``).

Every registered function has the signature
``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode=...,
<its own keyword scalars>, rollout_is_weights=None, global_num_tokens=None,
global_num_seqs=None, dp_size=1, norm_length=None, log_ratio_clamp=20.0)
-> (loss, metrics)``; the registry only maps names, it does not wrap them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["get_policy_loss", "list_policy_losses", "register_policy_loss"]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

# Filled by @register_policy_loss at each loss's definition (rlmath.losses imports them all).
_REGISTRY: dict[str, PolicyLossFn] = {}


def list_policy_losses() -> list[str]:
    """Every registered policy-loss name, sorted."""
    return sorted(_REGISTRY)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; unknown names raise listing the valid ones."""
    if not isinstance(name, str) or name not in _REGISTRY:
        hint = ""
        if name == "bypass_mode":
            hint = (
                " (verl's bypass_mode is a composition: rollout_correction(log_prob.detach(), "
                "rollout_log_prob, ...) then 'reinforce' with its weights, or 'vanilla' with "
                "old_log_prob = rollout_log_prob; see docs/losses.md)"
            )
        raise ValueError(
            f"unknown policy loss {name!r}; valid values are: "
            f"{', '.join(list_policy_losses())}{hint}"
        )
    return _REGISTRY[name]


def register_policy_loss(
    name: str, *, override: bool = False
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a user policy loss under ``name``.

    Re-registering an existing name raises unless ``override=True`` (verl
    silently replaces it). The function is returned unchanged.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if not callable(fn):
            raise TypeError(
                f"register_policy_loss({name!r}) needs a callable, got {type(fn).__name__}"
            )
        if name in _REGISTRY and not override and _REGISTRY[name] is not fn:
            raise ValueError(
                f"policy loss {name!r} is already registered; pass override=True to replace it"
            )
        _REGISTRY[name] = fn
        return fn

    return decorator
