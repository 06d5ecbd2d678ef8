"""KL coefficient controllers: the β in ``reward − β·KL``.

Both controllers expose the current coefficient as ``.value`` (a Python
float) and an ``update(current_kl, n_steps)`` method, so a trainer can swap
one for the other. They run once per training step, outside the tensor math:
``current_kl`` may be a 0-d tensor, and reading it with ``float()`` here is
the one host sync per step that the update needs.

Like an optimizer or an LR scheduler, each controller has ``state_dict()``
(a plain dict of Python floats, to save with the checkpoint) and
``load_state_dict(state)`` (restores it, after checking every entry), so a
resumed run continues with the β it stopped at.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

import torch

from rlmath._validation import check_finite_scalar, check_in_range, check_int

__all__ = ["AdaptiveKLController", "FixedKLController"]


def _check_update_args(current_kl: object, n_steps: object) -> tuple[float, int]:
    # A tensor current_kl is read with .item(): the one host sync per training step.
    kl = check_finite_scalar("current_kl", current_kl)
    return kl, check_int("n_steps", n_steps, 0)


def _checked_state(
    owner: str, state: object, checks: Mapping[str, Callable[[str, object], float]]
) -> dict[str, float]:
    """The entries of ``state`` checked by ``checks`` (one per key, no key missing or extra)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{owner}.load_state_dict expects a dict (from state_dict()), got {type(state).__name__}"
        )
    missing = sorted(set(checks) - set(state))
    unexpected = sorted(str(k) for k in set(state) - set(checks))
    if missing or unexpected:
        raise ValueError(
            f"{owner}.load_state_dict: state_dict keys must be {sorted(checks)}; "
            f"missing {missing}, unexpected {unexpected}"
        )
    return {k: check(f"state_dict[{k!r}]", state[k]) for k, check in checks.items()}


def _coef(name: str, value: object) -> float:
    return check_in_range(name, value, 0.0, None)


def _positive(name: str, value: object) -> float:
    return check_in_range(name, value, 0.0, None, low_inclusive=False)


class FixedKLController:
    """A constant KL coefficient; ``update`` checks its arguments and changes nothing.

    Args:
        kl_coef: the coefficient β, a finite number ``>= 0``.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value: float = check_in_range("kl_coef", kl_coef, 0.0, None)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Validate the arguments like :class:`AdaptiveKLController` does; β stays fixed."""
        _check_update_args(current_kl, n_steps)

    def state_dict(self) -> dict[str, float]:
        """``{"value": β}``, a new dict of Python floats."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s output; bad keys or values raise before anything changes."""
        self.value = _checked_state(type(self).__name__, state_dict, {"value": _coef})["value"]

    def __repr__(self) -> str:
        return f"FixedKLController(kl_coef={self.value!r})"


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards a target.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"
    (https://arxiv.org/abs/1909.08593), section 2.2: after each step,

        e = clip(current_kl / target_kl − 1, −0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)

    so β grows when the KL is above target and shrinks when below, by at most
    20 % per ``horizon`` steps. ``n_steps`` is the number of samples (or steps)
    the measurement covers; verl passes the batch size.

    **β stays positive.** The update is one Euler step of
    ``dβ/dn = e·β/horizon``; taken as one step over ``n_steps > 5·horizon``
    with ``e = −0.2`` it would make β zero (at exactly 5 horizons, and it
    stays 0 forever after) or negative (rewarding distance from the
    reference). So an update that covers more than one horizon is applied as
    consecutive sub-updates of at most ``horizon`` steps each, i.e. with
    ``n_steps = q·horizon + r`` (``0 <= r < horizon``)::

        β ← β · (1 + e)^q · (1 + e · r / horizon)

    Each factor lies in ``[0.8, 1.2]``, so β keeps the documented rate limit
    (at most 20 % per horizon, compounded) and its sign. For
    ``n_steps <= horizon`` (the usual case: a batch per update and a horizon
    of thousands of samples) this is exactly the update above, and verl's
    values. The result is kept inside the positive normal floats
    (``[sys.float_info.min, sys.float_info.max]``) so that absurdly long
    updates (``n_steps`` of thousands of horizons) can neither underflow to 0
    nor overflow to inf. A β of exactly 0 (``init_kl_coef=0``) stays 0.

    Args:
        init_kl_coef: initial β, finite, ``>= 0``.
        target_kl: the KL to aim for, ``> 0``.
        horizon: the time constant in the same unit as ``n_steps``, ``> 0``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value: float = check_in_range("init_kl_coef", init_kl_coef, 0.0, None)
        self.target: float = check_in_range("target_kl", target_kl, 0.0, None, low_inclusive=False)
        self.horizon: float = check_in_range("horizon", horizon, 0.0, None, low_inclusive=False)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Apply one Ziegler et al. update to ``.value``.

        Args:
            current_kl: the measured KL, a finite Python number or a 1-element
                tensor (read with ``float()``: one host sync).
            n_steps: how many samples/steps the measurement covers, an int ``>= 0``.
        """
        kl, n = _check_update_args(current_kl, n_steps)
        error = min(max(kl / self.target - 1, -0.2), 0.2)
        if self.value == 0.0:
            return
        # More than one horizon: one Ziegler update per horizon (class docstring).
        whole, rest = divmod(n, self.horizon) if n > self.horizon else (0, n)
        try:
            factor = (1 + error) ** whole
        except OverflowError:
            factor = float("inf")
        value = self.value * factor * (1 + error * rest / self.horizon)
        self.value = min(max(value, sys.float_info.min), sys.float_info.max)

    def state_dict(self) -> dict[str, float]:
        """``{"value": β, "target": target_kl, "horizon": horizon}``, a new dict of floats."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: Mapping[str, object]) -> None:
        """Restore :meth:`state_dict`'s output; bad keys or values raise before anything changes.

        ``value`` must be a finite number ``>= 0``, ``target`` and ``horizon``
        finite and ``> 0`` (the constructor's rules).
        """
        checks = {"value": _coef, "target": _positive, "horizon": _positive}
        state = _checked_state(type(self).__name__, state_dict, checks)
        self.value, self.target, self.horizon = state["value"], state["target"], state["horizon"]

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self.value!r}, target_kl={self.target!r}, "
            f"horizon={self.horizon!r})"
        )
