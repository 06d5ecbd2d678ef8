"""Adaptive entropy coefficient (Skywork-OR1, He et al. 2025, https://arxiv.org/abs/2505.22312, §3.2).

An entropy bonus ``−c·H`` keeps a policy from collapsing, but a fixed ``c``
either does nothing or blows the entropy up. Skywork-OR1 switches the bonus
on only when the entropy has fallen to a target and adapts its size: after
each optimizer step, with ``e`` the step's mean token entropy,

    c ← min(c + Δ, c_max)   if e ≤ target,      c ← max(c − Δ, c_min)   otherwise

and the coefficient applied in the next step is ``c`` if that step's
``e ≤ target`` and 0 otherwise. This is TRL's ``use_adaptive_entropy``
(``entropy_coef``, ``entropy_coef_delta``, ``entropy_coef_min``,
``entropy_coef_max``, ``entropy_target``); before the first measurement no
bonus is applied (TRL starts from an entropy of +inf).

Like the KL controllers, the controller lives outside the tensor math: the
trainer measures ``e`` (over the same tokens as the loss, every rank and
micro-batch of the step), calls :meth:`AdaptiveEntropyController.update`
once per optimizer step (reading a 0-d tensor there is the one host sync),
and uses ``.value`` as ``coef`` in ``loss − coef·entropy``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rlmath._validation import check_finite_scalar, check_in_range

__all__ = ["AdaptiveEntropyController"]


class AdaptiveEntropyController:
    """Skywork-OR1's adaptive entropy coefficient (module docstring).

    Args:
        init_coef: initial ``c`` (TRL's ``entropy_coef``), in ``[min_coef, max_coef]``.
        target_entropy: the entropy (nats) at or below which the bonus applies, >= 0.
        delta: step ``Δ`` of ``c`` per update, >= 0 (TRL: 0.005).
        min_coef, max_coef: bounds of ``c``, ``0 <= min_coef <= max_coef`` (TRL: 0 and 1).

    Attributes:
        coef: the adapted ``c`` (a Python float).
        last_entropy: the last measured entropy (``inf`` before the first update).
    """

    def __init__(
        self,
        init_coef: float = 0.0,
        target_entropy: float = 0.2,
        *,
        delta: float = 0.005,
        min_coef: float = 0.0,
        max_coef: float = 1.0,
    ) -> None:
        self.min_coef = check_in_range("min_coef", min_coef, 0.0, None)
        self.max_coef = check_in_range("max_coef", max_coef, self.min_coef, None)
        self.coef = check_in_range("init_coef", init_coef, self.min_coef, self.max_coef)
        self.target = check_in_range("target_entropy", target_entropy, 0.0, None)
        self.delta = check_in_range("delta", delta, 0.0, None)
        self.last_entropy = math.inf

    @property
    def value(self) -> float:
        """The coefficient to apply in the coming step: ``coef`` if the last entropy ≤ target, else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, current_entropy: float | torch.Tensor) -> None:
        """Record the finished step's mean entropy and adapt ``coef``.

        ``current_entropy`` is a finite number or a one-element tensor (read
        once: a host sync).
        """
        entropy = check_finite_scalar("current_entropy", current_entropy)
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.max_coef)
        else:
            self.coef = max(self.coef - self.delta, self.min_coef)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, float]:
        """Every field, as Python floats (``last_entropy`` may be ``inf``)."""
        return {
            "coef": self.coef,
            "last_entropy": self.last_entropy,
            "target": self.target,
            "delta": self.delta,
            "min_coef": self.min_coef,
            "max_coef": self.max_coef,
        }

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s output; bad keys or values raise before anything changes."""
        keys = {"coef", "last_entropy", "target", "delta", "min_coef", "max_coef"}
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                "AdaptiveEntropyController.load_state_dict expects a dict (from state_dict()), "
                f"got {type(state_dict).__name__}"
            )
        if set(state_dict) != keys:
            raise ValueError(
                f"AdaptiveEntropyController.load_state_dict: state_dict keys must be "
                f"{sorted(keys)}, got {sorted(map(str, state_dict))}"
            )
        restored = AdaptiveEntropyController(
            float(check_finite_scalar("state_dict['coef']", state_dict["coef"])),
            check_in_range("state_dict['target']", state_dict["target"], 0.0, None),
            delta=check_in_range("state_dict['delta']", state_dict["delta"], 0.0, None),
            min_coef=check_in_range("state_dict['min_coef']", state_dict["min_coef"], 0.0, None),
            max_coef=check_in_range("state_dict['max_coef']", state_dict["max_coef"], 0.0, None),
        )
        last = state_dict["last_entropy"]
        if not (isinstance(last, (int, float)) and not isinstance(last, bool)) or last != last:
            raise ValueError(f"state_dict['last_entropy'] must be a number, got {last!r}")
        if last != math.inf:
            check_finite_scalar("state_dict['last_entropy']", last)
        restored.last_entropy = float(last)
        self.__dict__.update(restored.__dict__)

    def __repr__(self) -> str:
        return (
            f"AdaptiveEntropyController(coef={self.coef!r}, target_entropy={self.target!r}, "
            f"delta={self.delta!r}, min_coef={self.min_coef!r}, max_coef={self.max_coef!r})"
        )
