"""Learning-rate schedules with linear warmup: constant, cosine, warmup-stable-decay.

Each ``get_*_schedule_with_warmup`` returns a ``torch.optim.lr_scheduler.LambdaLR``
whose multiplier at step ``s`` (the scheduler's ``last_epoch``) is the pure
function ``*_schedule_lambda(s, ...)`` of this module, so the learning rate
after a resume depends only on the step, and the multiplier can be plotted or
tested without an optimizer. Arguments, defaults and values follow verl's
``verl.utils.torch_functional`` schedules step by step on
``[0, num_training_steps]``; the one deliberate difference is that the cosine
holds its final value past ``num_training_steps`` (verl's keeps following the
cosine and climbs back towards the peak). No schedule divides by zero:
``num_warmup_steps = 0``, ``= 1``, ``>= num_training_steps`` are all fine.

The multiplier functions are picklable (``functools.partial`` of module-level
functions), so the schedulers can be saved with ``torch.save``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from rlmath._validation import check_in_range, check_int

__all__ = [
    "constant_schedule_lambda",
    "cosine_schedule_lambda",
    "get_constant_schedule_with_warmup",
    "get_cosine_schedule_with_warmup",
    "get_wsd_schedule_with_warmup",
    "wsd_schedule_lambda",
]


def _check_int(name: str, value: object) -> int:
    return check_int(name, value, 0)


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )


def _check_last_epoch(last_epoch: object) -> int:
    last_epoch = check_int("last_epoch", last_epoch)
    if last_epoch < -1:
        raise ValueError(f"last_epoch must be >= -1 (-1 = start fresh), got {last_epoch}")
    return int(last_epoch)


def _warmup(step: int, num_warmup_steps: int, init_lr_ratio: float = 0.0) -> float:
    """Linear ramp from ``init_lr_ratio`` at step 0 towards 1 at ``num_warmup_steps``."""
    return init_lr_ratio + (1.0 - init_lr_ratio) * (step / max(1, num_warmup_steps))


# ---------------------------------------------------------------- constant


def _constant(step: int, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return 1.0


def constant_schedule_lambda(step: int, *, num_warmup_steps: int) -> float:
    """Multiplier ``step / num_warmup_steps`` during warmup, then 1.

    Args:
        step: the scheduler step (``last_epoch``), an int ``>= 0``.
        num_warmup_steps: an int ``>= 0``.

    Returns:
        A Python float in ``[0, 1]``.
    """
    return _constant(_check_int("step", step), _check_int("num_warmup_steps", num_warmup_steps))


def get_constant_schedule_with_warmup(
    optimizer: torch.optim.Optimizer, num_warmup_steps: int, last_epoch: int = -1
) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's learning rate, then constant.

    Args:
        optimizer: the optimizer whose ``lr`` is the peak.
        num_warmup_steps: warmup length, an int ``>= 0``.
        last_epoch: -1 to start fresh; the last completed step when resuming
            (the param groups then need ``initial_lr``, as for any torch scheduler).

    Returns:
        ``LambdaLR`` with multiplier :func:`constant_schedule_lambda`.
    """
    _check_optimizer(optimizer)
    fn = functools.partial(
        _constant, num_warmup_steps=_check_int("num_warmup_steps", num_warmup_steps)
    )
    return LambdaLR(optimizer, fn, _check_last_epoch(last_epoch))


# ---------------------------------------------------------------- cosine


def _cosine(
    step: int,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float,
    num_cycles: float,
    init_lr_ratio: float,
    zero_indexed_step: bool,
) -> float:
    if not zero_indexed_step:
        step += 1
    # Past the end, hold the value reached at num_training_steps.
    step = min(step, num_training_steps)
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps, init_lr_ratio)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    cosine = math.cos(math.pi * num_cycles * 2.0 * progress)
    # (1 + cos)/2 rescaled from [0, 1] to [min_lr_ratio, 1].
    value = cosine * (1.0 - min_lr_ratio) * 0.5 + (1.0 + min_lr_ratio) * 0.5
    return max(min_lr_ratio, value)


def _check_cosine_args(
    num_warmup_steps: object,
    num_training_steps: object,
    min_lr_ratio: object,
    num_cycles: object,
    init_lr_ratio: object,
    zero_indexed_step: object,
) -> dict:
    if not isinstance(zero_indexed_step, bool):
        raise TypeError(f"zero_indexed_step must be a bool, got {type(zero_indexed_step).__name__}")
    return {
        "num_warmup_steps": _check_int("num_warmup_steps", num_warmup_steps),
        "num_training_steps": _check_int("num_training_steps", num_training_steps),
        # verl treats min_lr_ratio=None as 0.
        "min_lr_ratio": 0.0
        if min_lr_ratio is None
        else check_in_range("min_lr_ratio", min_lr_ratio, 0.0, 1.0),
        "num_cycles": check_in_range("num_cycles", num_cycles, 0.0, None),
        "init_lr_ratio": 0.0
        if init_lr_ratio is None
        else check_in_range("init_lr_ratio", init_lr_ratio, 0.0, 1.0),
        "zero_indexed_step": zero_indexed_step,
    }


def cosine_schedule_lambda(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float | None = 0.0,
    num_cycles: float = 0.5,
    init_lr_ratio: float | None = None,
    zero_indexed_step: bool = True,
) -> float:
    """Multiplier of the warmup + cosine schedule at ``step``.

    Warmup (``step < num_warmup_steps``): linear from ``init_lr_ratio`` (0 if
    None) towards 1. Then, with ``p = (step − num_warmup_steps) /
    (num_training_steps − num_warmup_steps)``::

        min_lr_ratio + (1 − min_lr_ratio) · (1 + cos(2π · num_cycles · p)) / 2

    which falls from 1 to ``min_lr_ratio`` over ``p ∈ [0, 1]`` for the default
    half cycle. For ``step > num_training_steps`` the value at
    ``num_training_steps`` is held (verl's climbs back up instead).
    ``zero_indexed_step=False`` counts steps from 1 (torchtitan's convention,
    verl's flag): the function is evaluated at ``step + 1``.

    Returns:
        A Python float in ``[0, 1]``.
    """
    args = _check_cosine_args(
        num_warmup_steps,
        num_training_steps,
        min_lr_ratio,
        num_cycles,
        init_lr_ratio,
        zero_indexed_step,
    )
    return _cosine(_check_int("step", step), **args)


def get_cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float | None = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    init_lr_ratio: float | None = None,
    zero_indexed_step: bool = True,
) -> LambdaLR:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` × the optimizer's lr.

    Args:
        optimizer: the optimizer whose ``lr`` is the peak.
        num_warmup_steps: an int ``>= 0``.
        num_training_steps: an int ``>= 0``; the decay ends here and the
            multiplier is held afterwards.
        min_lr_ratio: final multiplier, in ``[0, 1]`` (None means 0, as in verl).
        num_cycles: cosine waves over the decay (0.5 = one half-wave down), ``>= 0``.
        last_epoch: -1 to start fresh, else the last completed step (resume).
        init_lr_ratio: multiplier at step 0, in ``[0, 1]``; None means 0.
        zero_indexed_step: False evaluates the schedule at ``step + 1``.

    Returns:
        ``LambdaLR`` with multiplier :func:`cosine_schedule_lambda`.
    """
    _check_optimizer(optimizer)
    args = _check_cosine_args(
        num_warmup_steps,
        num_training_steps,
        min_lr_ratio,
        num_cycles,
        init_lr_ratio,
        zero_indexed_step,
    )
    return LambdaLR(optimizer, functools.partial(_cosine, **args), _check_last_epoch(last_epoch))


# ---------------------------------------------------------------- warmup-stable-decay


def _wsd(
    step: int,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float,
    num_cycles: float,
    stable_ratio: float,
) -> float:
    remaining = max(0, num_training_steps - num_warmup_steps)
    num_stable = int(remaining * stable_ratio)
    num_decay = remaining - num_stable
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step < num_warmup_steps + num_stable:
        return 1.0
    if step < num_training_steps:
        progress = (step - num_warmup_steps - num_stable) / max(1, num_decay)
        value = max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))
        return (1.0 - min_lr_ratio) * value + min_lr_ratio
    return min_lr_ratio


def _check_wsd_args(
    num_warmup_steps: object,
    num_training_steps: object,
    min_lr_ratio: object,
    num_cycles: object,
    stable_ratio: object,
) -> dict:
    return {
        "num_warmup_steps": _check_int("num_warmup_steps", num_warmup_steps),
        "num_training_steps": _check_int("num_training_steps", num_training_steps),
        "min_lr_ratio": check_in_range("min_lr_ratio", min_lr_ratio, 0.0, 1.0),
        "num_cycles": check_in_range("num_cycles", num_cycles, 0.0, None),
        "stable_ratio": check_in_range("stable_ratio", stable_ratio, 0.0, 1.0),
    }


def wsd_schedule_lambda(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    stable_ratio: float = 0.9,
) -> float:
    """Multiplier of the warmup-stable-decay schedule at ``step``.

    The ``R = num_training_steps − num_warmup_steps`` post-warmup steps split
    into ``S = int(R · stable_ratio)`` stable steps at 1 and ``R − S`` decay
    steps following ``min_lr_ratio + (1 − min_lr_ratio) · (1 + cos(2π ·
    num_cycles · p)) / 2`` over ``p ∈ [0, 1)``. From ``num_training_steps`` on
    the multiplier is ``min_lr_ratio``.

    Returns:
        A Python float in ``[0, 1]``.
    """
    args = _check_wsd_args(
        num_warmup_steps, num_training_steps, min_lr_ratio, num_cycles, stable_ratio
    )
    return _wsd(_check_int("step", step), **args)


def get_wsd_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
    stable_ratio: float = 0.9,
) -> LambdaLR:
    """Warmup-stable-decay: linear warmup, a plateau, then a cosine decay.

    Args:
        optimizer: the optimizer whose ``lr`` is the peak.
        num_warmup_steps: an int ``>= 0``.
        num_training_steps: an int ``>= 0``.
        min_lr_ratio: final multiplier, in ``[0, 1]``.
        num_cycles: cosine waves over the decay phase, ``>= 0``.
        last_epoch: -1 to start fresh, else the last completed step (resume).
        stable_ratio: share of the post-warmup steps spent at the peak, in ``[0, 1]``
            (0 = plain cosine decay after warmup).

    Returns:
        ``LambdaLR`` with multiplier :func:`wsd_schedule_lambda`.
    """
    _check_optimizer(optimizer)
    args = _check_wsd_args(
        num_warmup_steps, num_training_steps, min_lr_ratio, num_cycles, stable_ratio
    )
    return LambdaLR(optimizer, functools.partial(_wsd, **args), _check_last_epoch(last_epoch))
