"""One accessor for verl-style configuration objects, read duck-typed.

verl passes its configuration as dataclasses (``ActorConfig``, ``AlgoConfig``,
``RolloutCorrectionConfig``: attribute access, and also ``Mapping``), as
OmegaConf ``DictConfig`` (from Hydra YAML) or, in user code and tests, as
plain dicts and ``SimpleNamespace``. :func:`config_get` reads a (dotted) key
from any of them without importing verl or OmegaConf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["MISSING", "config_get"]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: Sentinel: "no default", so :func:`config_get` raises when the key is absent.
MISSING: Any = _Missing()


def _lookup(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        # verl's BaseConfig is a Mapping whose __getitem__ raises AttributeError;
        # OmegaConf raises ConfigKeyError (a KeyError) for an absent key.
        try:
            return obj[name]
        except (KeyError, AttributeError):
            return MISSING
    return getattr(obj, name, MISSING)


def config_get(config: Any, key: str, default: Any = MISSING, *, owner: str = "config") -> Any:
    """``config.<key>`` for a dataclass, a ``Mapping`` (dict, ``DictConfig``) or any object.

    Args:
        config: the configuration object (None reads as empty).
        key: a field name, or a dotted path such as ``"policy_loss.dro_beta"``.
        default: returned when the key (or any object on its path) is absent
            or None along the path. A key that is present with the value None
            returns None: verl gives None its own meaning ("fall back to
            clip_ratio", "use the padded width", ...), the caller applies it.
        owner: how to name ``config`` in the error message.

    Raises:
        KeyError: the key is absent and no default was given; the message
            names the key and ``owner``.
    """
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty string, got {key!r}")
    obj = config
    parts = key.split(".")
    for i, name in enumerate(parts):
        value = MISSING if obj is None else _lookup(obj, name)
        if value is MISSING or (value is None and i < len(parts) - 1):
            if default is MISSING:
                raise KeyError(
                    f"{owner} has no field {key!r} (read from {type(config).__name__}: "
                    "a verl dataclass, a dict, an OmegaConf DictConfig or an object with "
                    "that attribute)"
                )
            return default
        obj = value
    return obj
