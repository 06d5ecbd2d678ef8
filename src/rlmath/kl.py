"""Per-token KL estimators between the policy and a reference policy.

Given the log-probabilities that the policy π and the reference π_ref assign
to the *sampled* token x ~ π, each estimator is a single-sample estimate built
from the log-ratio ``d = log π(x) − log π_ref(x)`` (J. Schulman, "Approximating
KL divergence", 2020, http://joschu.net/blog/kl-approx.html):

====================  =============================  ==============================
name                  value                          E_{x~π}[value]
====================  =============================  ==============================
``k1`` / ``kl``        ``d``                          KL(π‖π_ref), high variance
``abs``                ``|d|``                        ≥ KL(π‖π_ref), a heuristic
``k2`` / ``mse``       ``d² / 2``                     ≈ KL(π‖π_ref) to second order
``k3`` / ``low_var_kl`` ``e^{−d} − 1 + d``             KL(π‖π_ref), ≥ 0, low variance
====================  =============================  ==============================

What their *gradients* estimate is a different matter. A trainer adds
``estimator(log π_θ(x), log π_ref(x))`` to the loss for sampled x and
differentiates through ``log π_θ(x)`` only (no score-function term for the
sampling). Then, exactly, in expectation over x ~ π:

* ``k2``: ``E[d ∇log π] = ∇ KL(π‖π_ref)`` — the correct gradient;
* ``k1``: ``E[∇log π] = 0`` — no gradient at all in expectation;
* ``k3``: ``E[(1 − π_ref/π) ∇log π] = ∇ KL(π_ref‖π)`` — the *reverse* KL's gradient;
* ``abs``: ``E[sign(d) ∇log π]`` — not a KL gradient.

A ``+`` suffix (``k1+``, ``k3+``, ...) keeps the estimator's value but takes
k2's gradient through a straight-through term, so every ``+`` estimator has
the correct expected gradient ∇KL(π‖π_ref). ``tests/test_kl.py`` checks all of
these statements by exact enumeration over a small categorical distribution.
"""

from __future__ import annotations

from typing import Any

import torch

from rlmath._validation import (
    as_dtype,
    check_choice,
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)

__all__ = ["KL_ESTIMATORS", "kl_penalty"]

_BASE = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
}

#: Every name accepted by :func:`kl_penalty`.
KL_ESTIMATORS: tuple[str, ...] = tuple(sorted([*_BASE, *(name + "+" for name in _BASE)]))
_ESTIMATOR_BASE = {name: _BASE[name.removesuffix("+")] for name in KL_ESTIMATORS}

_PLAIN = (float, int, type(None))
_BOUNDS: dict[tuple[Any, Any], tuple[float, float | None]] = {}


def _check_bounds(log_ratio_clamp: object, k3_max: object) -> tuple[float, float | None]:
    """The checked ``(log_ratio_clamp, k3_max)``, remembered for Python numbers."""
    key = (log_ratio_clamp, k3_max)
    plain = type(log_ratio_clamp) in _PLAIN and type(k3_max) in _PLAIN
    if plain and key in _BOUNDS:
        return _BOUNDS[key]
    clamp = check_in_range("log_ratio_clamp", log_ratio_clamp, 0.0, None, low_inclusive=False)
    top = None
    if k3_max is not None:
        top = check_in_range("k3_max", k3_max, 0.0, None, low_inclusive=False)
    if plain and len(_BOUNDS) < 64:
        _BOUNDS[key] = (clamp, top)
    return clamp, top


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float = 20.0,
    k3_max: float | None = 10.0,
    old_log_prob: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from the sampled tokens' log-probs.

    See the module docstring for what each estimator's value and gradient
    estimate. The computation runs in fp32 (fp64 if an input is fp64) whatever
    the input dtype.

    * ``k3``/``low_var_kl`` is computed as ``expm1(x) − x`` with
      ``x = clamp(ref_log_prob − log_prob, ±log_ratio_clamp)`` (accurate near 0,
      no overflow), then clamped from above at ``k3_max`` like verl. With the
      default 10 the clamp is active where ``x > 2.61`` (π_ref/π > 13.6) or
      ``x < −11``; there the value is flat and **its gradient is zero**, so a
      token whose probability the policy has pushed far below the reference
      gets no KL pull back. ``k3_max=None`` disables the clamp; ``k3+`` keeps
      its gradient (k2's) in that zone.
    * ``+`` estimators return ``k2 − sg(k2) + sg(value)`` (sg = stop-gradient):
      the exact value of the base estimator with k2's gradient.
    * ``old_log_prob`` (``k3``/``low_var_kl`` only) turns on the importance
      correction for tokens sampled from an older policy π_old (DeepSeek-V3.2,
      2025): the result is ``w · k3`` with ``w = π/π_old =
      exp(clamp(log_prob − old_log_prob, ±log_ratio_clamp))``. The weight is
      **not** detached: since ``E_{π_old}[w · k3] = E_π[k3] = KL(π‖π_ref)``
      for every θ, differentiating through ``w`` makes the expected gradient
      exactly ∇KL(π‖π_ref) (with a detached weight it would be ∇KL(π_ref‖π),
      the same biased gradient as plain k3).
    * ``response_mask`` (optional) makes masked positions exactly 0 and keeps
      NaN/inf there out of every value and gradient (inputs are selected with
      ``torch.where`` before any arithmetic). Without it the function is
      purely element-wise; a later masked reduction then hides masked values,
      but the gradient at a masked position holding NaN/inf is ``0 · NaN``.
    * ``"full"`` needs whole distributions, not sampled log-probs: use
      ``rlmath.kl_from_logits(logits, ref_logits)``.

    Migrating from verl: verl's parameters are ``(logprob, ref_logprob,
    kl_penalty)``, its call sites pass the estimator as ``kl_penalty="k3"``;
    :func:`rlmath.compat.verl.kl_penalty` keeps that signature.

    Args:
        log_prob: log π(x) of the sampled tokens. Shape ``(*)`` (``(B, T)``), float.
        ref_log_prob: log π_ref(x), same shape, float.
        estimator: one of :data:`KL_ESTIMATORS`. Default ``"k1"``.
        log_ratio_clamp: bound on ``|log-ratio|`` before any exponential (> 0).
        k3_max: upper clamp of k3's value (> 0), or None for no clamp.
        old_log_prob: log π_old(x) of the sampling policy, same shape, or None.
        response_mask: None, or bool/0-1 of the same shape, nonzero = valid.

    Returns:
        Shape ``(*)``; fp32, or fp64 if any input is fp64; 0 where
        ``response_mask`` is 0. Element-wise: a NaN at one position affects
        that position only.
    """
    if (
        estimator == "k1"
        and response_mask is None
        and old_log_prob is None
        and type(log_prob) is torch.Tensor
        and type(ref_log_prob) is torch.Tensor
        and log_prob.dtype is torch.float32
        and ref_log_prob.dtype is torch.float32
        and log_prob.shape == ref_log_prob.shape
        and type(log_ratio_clamp) is float
        and log_ratio_clamp == 20.0
        and type(k3_max) is float
        and k3_max == 10.0
    ):
        # The most common call, checked in full: two fp32 tensors of one shape, the
        # default bounds (which k1 does not read). One subtraction is the whole estimator.
        return log_prob - ref_log_prob
    base = _ESTIMATOR_BASE.get(estimator) if isinstance(estimator, str) else None
    if base is None:
        if estimator in ("full", "full+"):
            raise ValueError(
                "estimator 'full' is the exact KL over the vocabulary and needs the logits, "
                "not the sampled tokens' log-probs: call rlmath.kl_from_logits(logits, ref_logits)"
            )
        check_choice("estimator", estimator, KL_ESTIMATORS)
    check_tensor("log_prob", log_prob, floating=True)
    check_tensor("ref_log_prob", ref_log_prob, floating=True)
    check_same_shape("ref_log_prob", ref_log_prob, "log_prob", log_prob)
    clamp, k3_max = _check_bounds(log_ratio_clamp, k3_max)
    tensors = [log_prob, ref_log_prob]
    if old_log_prob is not None:
        if estimator not in ("k3", "low_var_kl"):
            raise ValueError(
                "old_log_prob (importance-corrected KL) is only defined for estimator "
                f"'k3' / 'low_var_kl', got estimator={estimator!r}"
            )
        check_tensor("old_log_prob", old_log_prob, floating=True)
        check_same_shape("old_log_prob", old_log_prob, "log_prob", log_prob)
        tensors.append(old_log_prob)

    dtype = result_dtype(*tensors)
    logp = as_dtype(log_prob, dtype)
    ref = as_dtype(ref_log_prob, dtype)
    old = None if old_log_prob is None else as_dtype(old_log_prob, dtype)
    valid = None
    if response_mask is not None:
        check_mask("response_mask", response_mask, "log_prob", log_prob)
        valid = valid_mask(response_mask)
        logp = torch.where(valid, logp, 0)
        ref = torch.where(valid, ref, 0)
        old = None if old is None else torch.where(valid, old, 0)
    if base == "k1":
        value = logp - ref
    elif base == "abs":
        value = (logp - ref).abs()
    elif base == "k2":
        value = 0.5 * (logp - ref).square()
    else:
        x = (ref - logp).clamp(-clamp, clamp)
        value = torch.expm1(x) - x  # = π_ref/π − 1 − log(π_ref/π) ≥ 0
        if k3_max is not None:
            value = value.clamp(max=k3_max)

    if old is not None:
        log_w = (logp - old).clamp(-clamp, clamp)
        value = torch.exp(log_w) * value

    if estimator.endswith("+") and base != "k2":
        k2 = 0.5 * (logp - ref).square()
        # Adding (k2 − sg(k2)), exactly 0, keeps the value bit-identical to the estimator's.
        value = (k2 - k2.detach()) + value.detach()
    if valid is not None:
        value = torch.where(valid, value, 0)
    return value
