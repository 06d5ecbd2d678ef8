"""verl 0.9.1 ``verl.trainer.ppo.rollout_corr_helper``, computed by rlmath.

Importance weights come from :func:`rlmath.rollout_correction`, rejection
masks from :func:`rlmath.rollout_rejection`; this module adds verl's
threshold strings (``"2.0"``, ``"0.5_5.0"``, ``"0.4_1.8,3.0"``), verl's
return structures (the weights in a ``DataProto`` under
``"rollout_is_weights"``) and verl's metric keys (``rollout_corr/...``).

* ``rollout_is`` ``"token"`` / ``"sequence"`` with a single threshold is TIS
  (weights truncated above); a ``"lower_upper"`` threshold is IcePop **as
  verl does it**: weights outside ``[lower, upper]`` are zeroed and the
  response mask is returned unchanged, so rejected tokens still count in a
  ``token-mean`` denominator. (``rlmath.rollout_correction(mode="mask")``
  also removes them from the mask it returns; pass the input mask to the
  loss to get verl's numbers.)
* ``rollout_rs``: every verl option (``token_k1/k2/k3``, ``seq_sum_*``,
  ``seq_mean_*``, ``seq_max_k2/k3``), chained with commas
  (``"token_k1,seq_max_k3"``), one threshold for all or one per option.
* Metrics are Python floats, verl's type: computed on the device, then read
  back together (a host sync; verl syncs per value; the compat layer
  mirrors verl's behaviour, rlmath's own functions never read values back).
  ``install(float_metrics=False)`` keeps them detached 0-d tensors, except in
  ``compute_rollout_correction_and_add_to_batch`` (the trainer's
  once-per-step entry point), whose metrics are always floats for verl's
  loggers, which drop anything that is not a number. An empty mask gives 0
  metrics instead of verl's ``ValueError``.
* Exponentials of log-ratios are clamped at ±20 everywhere (verl leaves
  ``k3_kl`` unclamped, so it overflows for log-ratios beyond ≈ 88).

``apply_bypass_mode`` (configuration plumbing) stays verl's; it selects the
``bypass_mode`` loss, which ``install()`` replaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

import rlmath
from rlmath.compat._config import config_get
from rlmath.compat.verl._state import finish_metrics, world_group

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "RolloutISWeights",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
]

#: The functions ``install()`` replaces in ``verl.trainer.ppo.rollout_corr_helper``.
VERL_NAMES: tuple[str, ...] = (
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_corr_metrics_from_logprobs",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rs_metrics",
)

SAFETY_BOUND = 20.0
SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = set(rlmath.ROLLOUT_REJECTION_OPTIONS)
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {"token_k1", "token_k2", "token_k3"}

Metrics = dict[str, torch.Tensor]


@dataclass
class RolloutISWeights:
    """Stand-in for verl's ``DataProto`` when verl is not installed: ``.batch["rollout_is_weights"]``."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)


def _weights_proto(weights: torch.Tensor) -> Any:
    try:
        from verl.protocol import DataProto
    except ImportError:
        return RolloutISWeights(batch={"rollout_is_weights": weights})
    return DataProto.from_dict(tensors={"rollout_is_weights": weights})


# ------------------------------------------------------------------ threshold strings


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"Invalid {what} {text!r}: expected a number") from None


def _parse_rollout_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``(upper, lower)`` of ``rollout_is_threshold``: a number (TIS) or ``"lower_upper"`` (IcePop)."""
    if isinstance(spec, bool):
        raise TypeError(
            "rollout_is_threshold must be specified as a float or a string threshold "
            "specification, not a boolean."
        )
    lower: float | None = None
    if isinstance(spec, (int, float)):
        upper = float(spec)
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError("rollout_is_threshold must not be an empty string.")
        if "_" in text:
            low_text, high_text = text.split("_", 1)
            lower = _number(low_text, "rollout_is_threshold lower bound")
            upper = _number(high_text, "rollout_is_threshold upper bound")
        else:
            upper = _number(text, "rollout_is_threshold")
    else:
        raise TypeError(
            "rollout_is_threshold must be a float or a string threshold specification, got "
            f"{type(spec).__name__}"
        )
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold upper bound must be positive, got {upper}.")
    if lower is not None:
        if not lower > 0:
            raise ValueError(f"rollout_is_threshold lower bound must be positive, got {lower}.")
        if lower > upper:
            raise ValueError("rollout_is_threshold lower bound must be <= upper bound.")
    return upper, lower


def _parse_rollout_rs(rollout_rs: Any) -> list[str]:
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError(
            "rollout_rs must be a non-empty string (comma separated for multiple options)."
        )
    options: list[str] = []
    for opt in (part.strip() for part in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in SUPPORTED_ROLLOUT_RS_OPTIONS:
            raise ValueError(
                f"Invalid rollout_rs option: {opt}. Must be one of "
                f"{sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}."
            )
        if opt not in options:
            options.append(opt)
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option.")
    return options


def _parse_rollout_rs_thresholds(
    options: list[str], spec: Any
) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}``; ``lower`` (a ratio) only for ``k1`` options."""
    if spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        parts = [str(spec)]
    elif isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
    else:
        raise TypeError(
            "rollout_rs_threshold must be a string or numeric value specifying per-option "
            f"thresholds, got {type(spec).__name__}"
        )
    if not parts:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(parts) not in (1, len(options)):
        raise ValueError(
            "rollout_rs_threshold expects either one threshold shared by all options or "
            f"exactly {len(options)} thresholds to match the provided rollout_rs options, "
            f"got {len(parts)}."
        )
    if len(parts) == 1:
        parts = parts * len(options)
    out: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, parts):
        what = f"threshold {text!r} for option {option!r}"
        threshold: Any
        if "_" in text:
            if not option.endswith("k1"):
                raise ValueError(
                    f"rollout_rs_threshold for option {option!r} must provide a single upper "
                    f"bound without '_'. Received {text!r}."
                )
            low_text, high_text = text.split("_", 1)
            threshold = (_number(low_text, what), _number(high_text, what))
        else:
            threshold = _number(text, what)
        out[option] = rlmath.rollout_rejection_bounds(option, threshold)
    return out


# ------------------------------------------------------------------ masked helpers (no host sync)


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _extreme(x: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    picked = torch.where(valid, x, -torch.inf if largest else torch.inf)
    top = picked.amax() if largest else picked.amin()
    return torch.where(valid.any(), top, torch.zeros_like(top))


def _frac(condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return rlmath.masked_mean(condition, mask)


def _std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population std of the masked values, 0 unless more than one is valid (verl's rule)."""
    count = rlmath.masked_sum(torch.ones_like(x), mask)
    std = rlmath.masked_var(x, mask, unbiased=False).clamp(min=0).sqrt()
    return torch.where(count > 1, std, torch.zeros_like(std))


# ------------------------------------------------------------------ rejection sampling


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: torch.Tensor | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> Metrics:
    """verl's per-option rejection metrics (``rollout_rs_<option>_*``), as 0-d tensors.

    ``rs_statistic`` is per token ``(B, T)`` (the sequence statistic
    broadcast for sequence options); thresholds are in the statistic's units
    (log-ratios for ``k1``). ``_mean`` and ``_std`` are token-weighted;
    ``_max``/``_min``/``_fraction_*`` are over sequences for sequence options
    and over tokens otherwise; ``_seq_*`` summarise the per-sequence values.
    """
    prefix = f"rollout_rs_{option_name}"
    valid = _valid(response_mask)
    seq_valid = _valid(seq_valid_mask)
    if per_sequence_values is not None:
        seq_values = per_sequence_values
    else:
        seq_values = rlmath.masked_mean(rs_statistic, response_mask, axis=-1)
    if seq_values.dim() > 1:
        seq_values = seq_values.squeeze(-1)
    thr, low = rollout_rs_threshold, rollout_rs_threshold_lower
    m: Metrics = {f"{prefix}_mean": rlmath.masked_mean(rs_statistic, response_mask)}
    zero = torch.zeros_like(m[f"{prefix}_mean"])
    any_seq = seq_valid.any()

    def by_level(seq_version: torch.Tensor, token_version: torch.Tensor) -> torch.Tensor:
        if level != "sequence":
            return token_version
        return torch.where(any_seq, seq_version, token_version)

    m[f"{prefix}_max"] = by_level(
        _extreme(seq_values, seq_valid, True), _extreme(rs_statistic, valid, True)
    )
    m[f"{prefix}_min"] = by_level(
        _extreme(seq_values, seq_valid, False), _extreme(rs_statistic, valid, False)
    )
    m[f"{prefix}_fraction_high"] = by_level(
        _frac(seq_values > thr, seq_valid), _frac(rs_statistic > thr, response_mask)
    )
    m[f"{prefix}_fraction_low"] = (
        by_level(_frac(seq_values < low, seq_valid), _frac(rs_statistic < low, response_mask))
        if apply_lower_threshold
        else zero
    )
    clamp_min = low if apply_lower_threshold else 0.0
    m[f"{prefix}_std"] = _std(rs_statistic.clamp(min=clamp_min, max=thr), response_mask)
    seq_var = rlmath.masked_var(seq_values, seq_valid, unbiased=True)
    m[f"{prefix}_seq_mean"] = rlmath.masked_mean(seq_values, seq_valid)
    m[f"{prefix}_seq_std"] = seq_var.clamp(min=0).sqrt()
    m[f"{prefix}_seq_max"] = _extreme(seq_values, seq_valid, True)
    m[f"{prefix}_seq_min"] = _extreme(seq_values, seq_valid, False)
    m[f"{prefix}_seq_max_deviation"] = _extreme(seq_values.abs(), seq_valid, True)
    m[f"{prefix}_seq_fraction_high"] = _frac(seq_values > thr, seq_valid)
    if apply_lower_threshold:
        m[f"{prefix}_seq_fraction_low"] = _frac(seq_values < low, seq_valid)
    return finish_metrics(m)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Reject tokens/sequences whose divergence estimate is out of bounds (:func:`rlmath.rollout_rejection`).

    ``log_ratio`` is ``log π_train − log π_rollout`` ``(B, T)``. ``rollout_rs``
    is one option or several joined by commas (all must pass);
    ``rollout_rs_threshold`` one threshold for all or one per option (comma
    separated): ``k1`` options take ``"lower_upper"`` ratio bounds (a single
    ``u`` means ``1/u_u``), the others one upper bound. Returns the response
    mask with rejected positions zeroed (same dtype) and verl's
    ``rollout_rs_*`` metrics.
    """
    options = _parse_rollout_rs(rollout_rs)
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    bounds = _parse_rollout_rs_thresholds(options, rollout_rs_threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    criteria: dict[str, Any] = {
        opt: upper if lower is None else (lower, upper) for opt, (lower, upper) in bounds.items()
    }
    rej = rlmath.rollout_rejection(
        log_ratio, torch.zeros_like(log_ratio), response_mask, criteria=criteria
    )
    valid = _valid(response_mask)
    seq_valid = valid.any(dim=-1)
    metrics: Metrics = {}
    for opt, (lower, upper) in bounds.items():
        is_k1 = lower is not None
        stat = rej.statistics[opt]
        token_level = opt in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS
        metrics.update(
            compute_rs_metrics(
                opt,
                stat if token_level else stat.unsqueeze(-1).expand(response_mask.shape),
                response_mask,
                seq_valid,
                level="token" if token_level else "sequence",
                per_sequence_values=None if token_level else stat,
                rollout_rs_threshold=math.log(upper) if is_k1 else upper,
                rollout_rs_threshold_lower=math.log(lower) if lower is not None else 0.0,
                apply_lower_threshold=is_k1,
            )
        )
        rejected = rej.rejected[opt]
        metrics[f"rollout_rs_{opt}_masked_fraction"] = _frac(rejected, response_mask)
        metrics[f"rollout_rs_{opt}_seq_masked_fraction"] = _frac(rejected.any(dim=-1), seq_valid)
    lost = valid & ~rej.keep
    metrics["rollout_rs_masked_fraction"] = _frac(lost, response_mask)
    # verl divides by every row of the batch here (rows without valid tokens included).
    dtype = metrics["rollout_rs_masked_fraction"].dtype
    metrics["rollout_rs_seq_masked_fraction"] = lost.any(dim=-1).to(dtype).mean()
    return rej.response_mask, finish_metrics(metrics)


# ------------------------------------------------------------------ importance weights


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: float | None = None,
) -> Metrics:
    """verl's IS-weight metrics (``rollout_is_*``), as 0-d tensors.

    Mean, max, min, std and effective sample size of the applied weights,
    fractions above/below the thresholds from the raw weights (sequence
    level: from ``log_ratio_for_metrics``, one log-ratio per row), and
    per-sequence summaries. ``rollout_is_threshold_lower`` defaults to
    ``1 / rollout_is_threshold``.
    """
    upper = float(rollout_is_threshold)
    lower = 1.0 / upper if rollout_is_threshold_lower is None else float(rollout_is_threshold_lower)
    w, raw, mask = rollout_is_weights, raw_rollout_is_weights, response_mask
    valid = _valid(mask)
    m: Metrics = {"rollout_is_mean": rlmath.masked_mean(w, mask)}
    if rollout_is == "sequence":
        lr = log_ratio_for_metrics
        dtype = m["rollout_is_mean"].dtype
        m["rollout_is_max"] = torch.exp(lr.amax().clamp(max=SAFETY_BOUND)).to(dtype)
        m["rollout_is_min"] = torch.exp(lr.amin()).to(dtype)
        m["rollout_is_ratio_fraction_high"] = (lr > math.log(upper)).to(dtype).mean()
        m["rollout_is_ratio_fraction_low"] = (lr < math.log(lower)).to(dtype).mean()
    else:
        m["rollout_is_ratio_fraction_high"] = _frac(raw > upper, mask)
        m["rollout_is_ratio_fraction_low"] = _frac(raw < lower, mask)
        m["rollout_is_max"] = _extreme(w, valid, True)
        m["rollout_is_min"] = _extreme(w, valid, False)
    clipped = w.clamp(min=0.0, max=upper)
    m["rollout_is_std"] = _std(clipped, mask)
    normalized = clipped / (rlmath.masked_mean(clipped, mask) + 1e-8)
    second = rlmath.masked_mean(normalized.square(), mask)
    # No weight (an empty mask, or every weight zeroed): no effective sample (verl divides by 0).
    m["rollout_is_eff_sample_size"] = torch.where(
        second > 0, 1.0 / second, torch.zeros_like(second)
    )
    if w.dim() > 1:
        seq_mean = rlmath.masked_mean(w, mask, axis=-1)
        m["rollout_is_seq_mean"] = seq_mean.mean()
        m["rollout_is_seq_std"] = (
            seq_mean.std() if seq_mean.numel() > 1 else torch.zeros_like(m["rollout_is_mean"])
        )
        m["rollout_is_seq_max"] = seq_mean.amax()
        m["rollout_is_seq_min"] = seq_mean.amin()
        m["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().amax()
        raw_seq_mean = rlmath.masked_mean(raw, mask, axis=-1)
        m["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).to(seq_mean.dtype).mean()
        m["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower).to(seq_mean.dtype).mean()
    return finish_metrics(m)


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated (TIS) or IcePop importance weights ``π_train/π_rollout`` (:func:`rlmath.rollout_correction`).

    ``rollout_is``: ``"token"`` or ``"sequence"``. ``rollout_is_threshold``: a
    number (truncate above it) or ``"lower_upper"`` (IcePop: zero the weights
    outside the bounds). ``rollout_is_batch_normalize`` rescales the weights
    to mean 1 (over tokens, or over sequences for ``"sequence"``; over every
    rank when ``torch.distributed`` is initialized). Returns detached
    ``(B, T)`` weights (0 at masked positions) and verl's ``rollout_is_*``
    metrics (computed before the normalisation).
    """
    if rollout_is not in ("token", "sequence"):
        raise ValueError(
            f"Invalid rollout_is: {rollout_is}. Must be one of {{'token', 'sequence'}}."
        )
    upper, lower = _parse_rollout_is_threshold(rollout_is_threshold)
    icepop = lower is not None
    corr = rlmath.rollout_correction(
        log_ratio, torch.zeros_like(log_ratio), response_mask, level=rollout_is,
        mode="mask" if icepop else "truncate", threshold_low=lower, threshold_high=upper,
        log_ratio_clamp=SAFETY_BOUND,
    )  # fmt: skip
    weights = corr.weights
    valid = _valid(response_mask)
    if rollout_is == "token":
        level_log_ratio = log_ratio
        raw_log = torch.where(valid, log_ratio.detach().to(weights.dtype), 0)
    else:
        level_log_ratio = rlmath.masked_sum(log_ratio.detach(), response_mask, axis=-1).unsqueeze(
            -1
        )
        raw_log = level_log_ratio.expand(log_ratio.shape)
    raw = torch.where(valid, torch.exp(raw_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)), 0)
    metrics = compute_is_metrics(
        weights, raw, level_log_ratio.detach(), response_mask, rollout_is, upper, lower
    )
    if icepop:
        assert lower is not None
        metrics["rollout_is_oob_ratio"] = _frac((raw < lower) | (raw > upper), response_mask)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = rlmath.masked_mean(weights, response_mask, group=world_group())
        else:
            seq_weights = rlmath.masked_mean(weights, response_mask, axis=-1)
            mean = rlmath.masked_mean(seq_weights, valid.any(dim=-1), group=world_group())
        ok = mean > 1e-8
        weights = torch.where(ok, weights / torch.where(ok, mean, 1.0), weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(ok, mean, 1.0).detach()
    return weights.detach(), finish_metrics(metrics)


# ------------------------------------------------------------------ off-policy diagnostics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, Any]:
    """verl's off-policy diagnostics between the training and rollout policies (0-d tensors).

    ``training_ppl``/``training_log_ppl`` always; with ``rollout_log_prob``
    also ``kl`` (``E[log μ − log π]``), ``k3_kl``, ``rollout_ppl``,
    ``rollout_log_ppl``, ``log_ppl_diff`` (+ ``_abs_diff``, ``_max``,
    ``_min``), ``ppl_ratio``, ``chi2_token`` (``E[ρ²] − 1``) and ``chi2_seq``
    (``E[(Πρ)²] − 1``). Perplexities are per sequence, then averaged over
    rows.
    """
    m: dict[str, Any] = {}
    mean_train = rlmath.masked_mean(old_log_prob.detach(), response_mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_train).mean()
    m["training_log_ppl"] = (-mean_train).mean()
    if rollout_log_prob is not None:
        old, rollout = old_log_prob.detach(), rollout_log_prob.detach()
        m["kl"] = rlmath.masked_mean(rollout - old, response_mask)
        log_ratio = (old - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        m["k3_kl"] = rlmath.masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask)
        mean_rollout = rlmath.masked_mean(rollout, response_mask, axis=-1)
        m["rollout_ppl"] = torch.exp(-mean_rollout).mean()
        m["rollout_log_ppl"] = (-mean_rollout).mean()
        diff = mean_rollout - mean_train
        m["log_ppl_diff"] = diff.mean()
        m["log_ppl_abs_diff"] = diff.abs().mean()
        m["log_ppl_diff_max"] = diff.amax()
        m["log_ppl_diff_min"] = diff.amin()
        m["ppl_ratio"] = torch.exp(diff).mean()
        m["chi2_token"] = rlmath.masked_mean(torch.exp(log_ratio).square(), response_mask) - 1.0
        seq_log_ratio = rlmath.masked_sum(old - rollout, response_mask, axis=-1)
        m["chi2_seq"] = (
            torch.exp(2.0 * seq_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean() - 1.0
        )
    return finish_metrics(m)


# ------------------------------------------------------------------ the trainer's entry points


def _correction_and_rejection(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None,
    rollout_is_threshold: str | float | None,
    rollout_is_batch_normalize: bool,
    rollout_rs: str | None,
    rollout_rs_threshold: str | float | None,
) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape "
            f"{rollout_log_prob.shape}."
        )
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob shape {old_log_prob.shape} does not match response_mask shape "
            f"{response_mask.shape}."
        )
    log_ratio = old_log_prob.detach() - rollout_log_prob.detach()
    metrics: Metrics = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(
                "rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                "Set rollout_rs_threshold to the desired threshold value."
            )
        mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio, response_mask, rollout_rs, rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Any, torch.Tensor, Metrics]:
    """IS weights, rejection mask and diagnostics: ``(weights_proto, response_mask, metrics)``.

    ``weights_proto`` is None when ``rollout_is`` is None, else verl's
    ``DataProto`` (:class:`RolloutISWeights` without verl) holding
    ``batch["rollout_is_weights"]``. ``response_mask`` is a copy of the input
    with rejected positions zeroed (IcePop never changes it). Metrics carry
    the ``rollout_corr/`` prefix.
    """
    weights, mask, metrics = _correction_and_rejection(
        old_log_prob, rollout_log_prob, response_mask, rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize, rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )  # fmt: skip
    return (None if weights is None else _weights_proto(weights)), mask, finish_metrics(metrics)


def compute_rollout_correction_and_add_to_batch(
    batch: Any, rollout_corr_config: Any
) -> tuple[Any, dict]:
    """The trainer's step: correct ``batch`` in place of verl's, return ``(batch, metrics)``.

    Reads ``old_log_probs``, ``rollout_log_probs`` and ``response_mask`` from
    ``batch.batch``, replaces ``response_mask`` with the rejection mask and
    adds ``rollout_is_weights`` when ``rollout_is`` is set. The metrics are
    converted to Python floats here (one read per training step, on the
    driver), because verl's console logger drops values that are not numbers.
    """

    def get(key: str, default: Any) -> Any:
        return config_get(rollout_corr_config, key, default, owner="rollout_corr_config")

    weights, mask, metrics = _correction_and_rejection(
        batch.batch["old_log_probs"], batch.batch["rollout_log_probs"],
        batch.batch["response_mask"], rollout_is=get("rollout_is", None),
        rollout_is_threshold=get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=get("rollout_is_batch_normalize", False),
        rollout_rs=get("rollout_rs", None), rollout_rs_threshold=get("rollout_rs_threshold", None),
    )  # fmt: skip
    batch.batch["response_mask"] = mask
    if weights is not None:
        batch = batch.union(_weights_proto(weights))
    return batch, {k: float(v) for k, v in metrics.items()}


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, Any]:
    """Off-policy diagnostics of the current policy against the rollout's, ``rollout_corr/`` prefixed."""
    metrics = compute_offpolicy_metrics(log_prob, rollout_log_prob, response_mask)
    return finish_metrics({f"rollout_corr/{k}": v for k, v in metrics.items()})
