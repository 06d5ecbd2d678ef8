"""verl 0.9.1 ``verl.trainer.ppo.core_algos``, computed by rlmath.

Every function has verl's exact signature (positional order, names,
defaults) and verl's return structure: ``(loss, metrics)`` with verl's metric
keys (``"actor/pg_clipfrac"``, ...) for the policy losses,
``(advantages, returns)`` for the estimators. ``config`` is read duck-typed
(:func:`rlmath.compat.config_get`) from verl's dataclasses (``ActorConfig``,
``AlgoConfig``), a dict or an OmegaConf ``DictConfig``; a field a dict does
not have takes the default of verl's dataclass, and ``config=None`` means
all defaults (verl asserts a config). The numbers are rlmath's:

* metric values have verl's types: the policy losses' metrics are Python
  floats, as verl's (read back together, a host sync, where verl syncs
  per value: the compat layer mirrors verl's behaviour, rlmath's own losses return detached 0-d tensors
  and never sync); ``install(float_metrics=False)`` keeps them tensors;
* masked positions never reach a value or a gradient, and advantages and
  returns are exactly 0 there;
* outcome estimators score a response by its valid token rewards, and a
  singleton or all-equal group gives advantage 0;
* ``pg_clipfrac`` counts only tokens whose gradient the clip removed;
  ``sapo`` and ``geo_mean`` aggregate with ``loss_agg_mode`` like every other
  loss (verl ignores it for both); Clip-Cov draws its random subset on the
  device (same distribution, not the same draw).

``seq-mean-token-sum-norm`` without ``loss_scale_factor`` uses the padded
width ``loss_mask.shape[-1]``, as verl documents (rlmath's own ``agg_loss``
requires ``norm_length``). ``docs/migration.md`` lists every difference with
the verl test that shows it.

Not provided: ``compute_pf_ppo_reweight_data`` (random resampling of a
``DataProto``, not math rlmath covers); the registry decorators
``register_policy_loss`` / ``register_adv_est`` and the ``AdvantageEstimator``
enum stay verl's (``install()`` fills verl's registries).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

import rlmath
from rlmath.compat._config import config_get
from rlmath.compat.verl._state import finish_metrics

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_policy_loss",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_value_loss",
    "get_kl_controller",
    "kl_penalty",
    "kl_penalty_forward",
]

#: The names ``install()`` replaces in ``verl.trainer.ppo.core_algos``.
VERL_NAMES: tuple[str, ...] = tuple(__all__)

#: verl's KL controllers have the same constructors and update rule.
AdaptiveKLController = rlmath.AdaptiveKLController
FixedKLController = rlmath.FixedKLController

Metrics = dict[str, torch.Tensor]

# ------------------------------------------------------------------ config plumbing

_GLOBAL_BATCH_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def _count(name: str, value: Any) -> Any:
    """A global count as rlmath's ``agg_loss`` takes it: None, a tensor or a Python number."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a 0-d tensor, got bool")
    if not isinstance(value, (int, float)) and hasattr(value, "item"):
        value = value.item()  # numpy scalars
    if not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a 0-d tensor, got {type(value).__name__}")
    return value


def _dp_size(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("dp_size must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"dp_size must be an int, got {type(value).__name__}") from None


def _agg_kwargs(
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: Any = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> dict[str, Any]:
    """verl's global-batch arguments as rlmath's ``agg_loss`` keywords."""
    dp = _dp_size(dp_size)
    if dp > 1 and loss_agg_mode == "token-mean" and batch_num_tokens is None:
        raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
    if dp > 1 and loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
        raise ValueError("global_batch_size is required when dp_size > 1")
    norm = loss_scale_factor
    if norm is None:
        # verl's documented fallback: the padded width of this micro-batch.
        norm = loss_mask.shape[-1] if loss_mask.dim() > 0 else 1
    return {
        "global_num_tokens": _count("batch_num_tokens", batch_num_tokens),
        "global_num_seqs": _count("global_batch_size", global_batch_size),
        "dp_size": dp,
        "norm_length": _count("loss_scale_factor", norm),
    }


def _global_batch_info(config: Any) -> dict[str, Any]:
    info = config_get(config, "global_batch_info", None)
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise TypeError(f"config.global_batch_info must be a mapping, got {type(info).__name__}")
    unknown = sorted(set(info) - set(_GLOBAL_BATCH_KEYS))
    if unknown:
        raise TypeError(
            f"config.global_batch_info has unknown keys {unknown}; valid keys are: "
            f"{', '.join(_GLOBAL_BATCH_KEYS)}"
        )
    return dict(info)


def _loss_agg(config: Any, response_mask: torch.Tensor, loss_agg_mode: str) -> dict[str, Any]:
    return _agg_kwargs(response_mask, loss_agg_mode, **_global_batch_info(config))


def _actor_config(config: Any, fn: str) -> Any:
    if type(config).__name__ == "AlgoConfig" or (
        config is not None and config_get(config, "adv_estimator", None) is not None
    ):
        raise TypeError(
            f"{fn} reads the actor config (actor_rollout_ref.actor: clip_ratio, policy_loss, "
            "global_batch_info, ...), got the algorithm config"
        )
    return config


def _clip_ranges(config: Any) -> tuple[float, float, float]:
    clip_ratio = config_get(config, "clip_ratio", 0.2)
    low = config_get(config, "clip_ratio_low", None)
    high = config_get(config, "clip_ratio_high", None)
    return clip_ratio, clip_ratio if low is None else low, clip_ratio if high is None else high


def _policy_loss_field(config: Any, name: str, default: Any, fallback: Any) -> Any:
    """``config.policy_loss.<name>``: absent → PolicyLossConfig's default, None → verl's fallback."""
    value = config_get(config, f"policy_loss.{name}", default)
    return fallback if value is None else value


def _metrics(m: Metrics, *keys: tuple[str, str]) -> Metrics:
    return finish_metrics({f"actor/{verl_key}": m[ours] for verl_key, ours in keys})


_PG = (
    ("pg_clipfrac", "pg_clipfrac"),
    ("ppo_kl", "ppo_kl"),
    ("pg_clipfrac_lower", "pg_clipfrac_lower"),
)


# ------------------------------------------------------------------ aggregation, value, entropy


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
) -> torch.Tensor:
    """:func:`rlmath.agg_loss` with verl's argument names.

    ``batch_num_tokens`` / ``global_batch_size`` / ``loss_scale_factor`` are
    rlmath's ``global_num_tokens`` / ``global_num_seqs`` / ``norm_length``;
    without ``loss_scale_factor``, ``seq-mean-token-sum-norm`` divides by the
    padded width ``loss_mask.shape[-1]`` (verl's documented fallback).
    """
    if not isinstance(loss_agg_mode, str):
        raise TypeError(f"loss_agg_mode must be a string, got {type(loss_agg_mode).__name__}")
    kw = _agg_kwargs(
        loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    return rlmath.agg_loss(loss_mat, loss_mask, loss_agg_mode=loss_agg_mode, **kw)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (:func:`rlmath.compute_value_loss`): ``(vf_loss, vf_clipfrac)``."""
    kw = _agg_kwargs(
        response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
        loss_scale_factor,
    )  # fmt: skip
    loss, metrics = rlmath.compute_value_loss(
        vpreds, returns, values, response_mask, cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode, **kw,
    )  # fmt: skip
    return loss, metrics["vf_clipfrac"]


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated entropy of ``softmax(logits)`` (:func:`rlmath.compute_entropy_loss`)."""
    return rlmath.compute_entropy_loss(logits, response_mask, loss_agg_mode=loss_agg_mode)[0]


# ------------------------------------------------------------------ KL, rewards, controllers


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate, every verl name incl. ``+`` (:func:`rlmath.kl_penalty`), fp32.

    ``k3`` is computed in fp32 for half inputs and clamped at 10 like verl's.
    ``"full"`` raises a ``ValueError`` pointing to :func:`rlmath.kl_from_logits`.
    """
    return rlmath.kl_penalty(logprob, ref_logprob, kl_penalty)


def kl_penalty_forward(
    logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str
) -> torch.Tensor:
    """The value of a KL estimator without the ``+`` straight-through (verl's base names)."""
    if isinstance(kl_penalty, str) and kl_penalty.endswith("+"):
        raise ValueError(
            f"kl_penalty_forward takes a base estimator name, got {kl_penalty!r}; "
            f"the value of {kl_penalty!r} is kl_penalty_forward(..., {kl_penalty[:-1]!r})"
        )
    return rlmath.kl_penalty(logprob, ref_logprob, kl_penalty)


def compute_rewards(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    kl_ratio: float,
) -> torch.Tensor:
    """``scores − kl_ratio · (old_log_prob − ref_log_prob)`` (:func:`rlmath.compute_rewards`)."""
    return rlmath.compute_rewards(token_level_scores, old_log_prob, ref_log_prob, kl_ratio)


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """A controller from ``algorithm.kl_ctrl`` (``type``, ``kl_coef``, ``target_kl``, ``horizon``)."""
    kind = config_get(kl_ctrl, "type", owner="kl_ctrl")
    kl_coef = config_get(kl_ctrl, "kl_coef", owner="kl_ctrl")
    if kind == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if kind == "adaptive":
        horizon = config_get(kl_ctrl, "horizon", owner="kl_ctrl")
        target_kl = config_get(kl_ctrl, "target_kl", owner="kl_ctrl")
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; valid values are: adaptive, fixed")


# ------------------------------------------------------------------ policy losses


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's deprecated PPO loss: ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``."""
    if cliprange is None and (cliprange_low is None or cliprange_high is None):
        raise ValueError(
            "cliprange is required unless both cliprange_low and cliprange_high are given"
        )
    base = cliprange if cliprange is not None else 0.0
    loss, m = rlmath.compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=base, clip_ratio_low=base if cliprange_low is None else cliprange_low,
        clip_ratio_high=base if cliprange_high is None else cliprange_high,
        clip_ratio_c=clip_ratio_c, norm_length=response_mask.shape[-1],
    )  # fmt: skip
    return loss, m["pg_clipfrac"], m["ppo_kl"], m["pg_clipfrac_lower"]


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clip with asymmetric ranges and dual clip (:func:`rlmath.compute_policy_loss_vanilla`).

    Reads ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
    ``clip_ratio_c`` (default 3.0) and ``global_batch_info`` from ``config``.
    Metrics: ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``.
    """
    config = _actor_config(config, "compute_policy_loss_vanilla")
    clip_ratio, low, high = _clip_ranges(config)
    loss, m = rlmath.compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=config_get(config, "clip_ratio_c", 3.0), rollout_is_weights=rollout_is_weights,
        **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, *_PG)


def _dppo(fn: Any, name: str, *args: Any, config: Any, **kw: Any) -> tuple[torch.Tensor, Metrics]:
    config = _actor_config(config, name)
    clip_ratio, low, high = _clip_ranges(config)
    mask, mode = args[3], kw.pop("loss_agg_mode")
    loss, m = fn(
        *args, loss_agg_mode=mode, clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=config_get(config, "clip_ratio_c", 20.0), **kw, **_loss_agg(config, mask, mode),
    )  # fmt: skip
    return loss, _metrics(m, *_PG)


def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-TV (:func:`rlmath.compute_policy_loss_dppo_tv`).

    The clip ranges are the TV thresholds; ``clip_ratio_c`` truncates the
    ratio (20 when the config has no such field, as in verl).
    """
    return _dppo(
        rlmath.compute_policy_loss_dppo_tv, "compute_policy_loss_dppo_tv",
        old_log_prob, log_prob, advantages, response_mask, config=config,
        loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPPO-Binary-KL (:func:`rlmath.compute_policy_loss_dppo_kl`); config as ``dppo_tv``."""
    return _dppo(
        rlmath.compute_policy_loss_dppo_kl, "compute_policy_loss_dppo_kl",
        old_log_prob, log_prob, advantages, response_mask, config=config,
        loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (:func:`rlmath.compute_policy_loss_gspo`); any config form (verl: ActorConfig only).

    The sequence log-ratio is clamped to ±20 (verl clamps the combined
    log-ratio at +10 only).
    """
    config = _actor_config(config, "compute_policy_loss_gspo")
    clip_ratio, low, high = _clip_ranges(config)
    loss, m = rlmath.compute_policy_loss_gspo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, *_PG)


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO's soft gate (:func:`rlmath.compute_policy_loss_sapo`), ``tau_pos``/``tau_neg`` from config.

    Aggregated with ``loss_agg_mode`` (verl always uses
    ``seq-mean-token-mean``: pass that mode to get verl's number).
    """
    config = _actor_config(config, "compute_policy_loss_sapo")
    loss, m = rlmath.compute_policy_loss_sapo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        tau_pos=config_get(config, "tau_pos", 1.0), tau_neg=config_get(config, "tau_neg", 1.05),
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, *_PG)


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GPG's ``−A·log π`` (:func:`rlmath.compute_policy_loss_gpg`); no metrics, as in verl."""
    config = _actor_config(config, "compute_policy_loss_gpg")
    loss, _ = rlmath.compute_policy_loss_gpg(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, {}


def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clip-Cov (:func:`rlmath.compute_policy_loss_clip_cov`), ``policy_loss.clip_cov_*`` from config.

    ``actor/pg_clipfrac`` is, as in verl, the fraction of tokens the
    covariance selection removed. The random subset is drawn on the device.
    """
    config = _actor_config(config, "compute_policy_loss_clip_cov")
    clip_ratio, low, high = _clip_ranges(config)
    loss, m = rlmath.compute_policy_loss_clip_cov(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
        clip_cov_ratio=_policy_loss_field(config, "clip_cov_ratio", 0.0002, 0.0002),
        clip_cov_lb=_policy_loss_field(config, "clip_cov_lb", 1.0, 1.0),
        clip_cov_ub=_policy_loss_field(config, "clip_cov_ub", 5.0, 5.0),
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, ("pg_clipfrac", "clip_cov_frac"), ("ppo_kl", "ppo_kl"))


def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-Cov (:func:`rlmath.compute_policy_loss_kl_cov`), ``policy_loss.kl_cov_ratio``/``ppo_kl_coef``.

    ``actor/ppo_kl`` is, as in verl, the mean absolute log-ratio.
    """
    config = _actor_config(config, "compute_policy_loss_kl_cov")
    loss, m = rlmath.compute_policy_loss_kl_cov(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        kl_cov_ratio=_policy_loss_field(config, "kl_cov_ratio", 0.0002, 0.0002),
        ppo_kl_coef=_policy_loss_field(config, "ppo_kl_coef", 0.1, 1.0),
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, ("ppo_kl", "ppo_kl_abs"))


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GMPO (:func:`rlmath.compute_policy_loss_geo_mean`), aggregated with ``loss_agg_mode``.

    verl ignores ``loss_agg_mode`` and averages over every row (fully masked
    ones included); pass ``"seq-mean-token-mean"`` for the paper's (and
    verl's, without empty rows) number. ``actor/pg_clipfrac`` /
    ``actor/pg_clipfrac_lower`` are the sign-aware fractions clipped above
    (A > 0) / below (A < 0).
    """
    config = _actor_config(config, "compute_policy_loss_geo_mean")
    clip_ratio, low, high = _clip_ranges(config)
    loss, m = rlmath.compute_policy_loss_geo_mean(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(
        m,
        ("pg_clipfrac", "pg_clipfrac_high"),
        ("ppo_kl", "ppo_kl"),
        ("pg_clipfrac_lower", "pg_clipfrac_low"),
    )


def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DRO's quadratic log-ratio penalty (:func:`rlmath.compute_policy_loss_dro`).

    ``policy_loss.dro_beta`` must be a positive number (``ValueError`` naming it).
    """
    config = _actor_config(config, "compute_policy_loss_dro")
    beta = config_get(config, "policy_loss.dro_beta", None)
    if beta is None or isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
        raise ValueError(
            f"policy_loss.dro_beta must be a positive value when using DRO, got {beta!r}"
        )
    loss, m = rlmath.compute_policy_loss_dro(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        dro_beta=beta, rollout_is_weights=rollout_is_weights,
        **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, ("ppo_kl", "ppo_kl"))


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO with verl's two-sided weight clip (:func:`rlmath.compute_policy_loss_cispo`).

    ``actor/pg_clipfrac`` counts the tokens with A ≠ 0 whose weight was
    clipped (verl also counts A = 0 tokens).
    """
    config = _actor_config(config, "compute_policy_loss_cispo")
    clip_ratio, low, high = _clip_ranges(config)
    loss, m = rlmath.compute_policy_loss_cispo(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, *_PG)


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE ``−w·A·log π`` (:func:`rlmath.compute_policy_loss_reinforce`).

    ``actor/ppo_kl`` is the mean of ``rollout_log_prob − log_prob``.
    """
    config = _actor_config(config, "compute_policy_loss_reinforce")
    loss, m = rlmath.compute_policy_loss_reinforce(
        rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights, **_loss_agg(config, response_mask, loss_agg_mode),
    )  # fmt: skip
    return loss, _metrics(m, ("ppo_kl", "ppo_kl"))


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """verl's bypass mode (``old_log_prob`` is the rollout's): rollout correction, then a loss.

    Reads ``config.policy_loss.rollout_correction`` (``loss_type``
    ``"ppo_clip"`` or ``"reinforce"``, ``rollout_is``,
    ``rollout_is_threshold``, ``rollout_is_batch_normalize``, ``rollout_rs``,
    ``rollout_rs_threshold``). IS weights and the rejection mask compare the
    current policy with the rollout's; ``ppo_clip`` uses the rejection mask
    and no weights (the PPO ratio already is the IS ratio), ``reinforce``
    both. ``rollout_is_weights`` is ignored, as in verl. Metrics: the loss's
    plus every ``rollout_corr/...`` metric.
    """
    from rlmath.compat.verl.rollout_corr_helper import _correction_and_rejection

    config = _actor_config(config, "compute_policy_loss_bypass_mode")
    rc = config_get(config, "policy_loss.rollout_correction", None)
    if rc is None:
        raise ValueError(
            "rollout_correction config not found in policy_loss. "
            "When using loss_mode='bypass_mode', ensure rollout_correction config is passed."
        )
    loss_type = config_get(rc, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    with torch.no_grad():
        weights, mask, corr_metrics = _correction_and_rejection(
            log_prob.detach(), old_log_prob, response_mask,
            rollout_is=config_get(rc, "rollout_is", None),
            rollout_is_threshold=config_get(rc, "rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=config_get(rc, "rollout_is_batch_normalize", False),
            rollout_rs=config_get(rc, "rollout_rs", None),
            rollout_rs_threshold=config_get(rc, "rollout_rs_threshold", None),
        )  # fmt: skip
    if loss_type == "reinforce":
        loss, metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights
        )
    else:
        loss, metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, None
        )
    metrics.update(corr_metrics)
    return loss, finish_metrics(metrics)


# ------------------------------------------------------------------ advantage estimators


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor,
    lam: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn GAE (:func:`rlmath.compute_gae_advantage_return`): whitened advantages, returns.

    Advantages and returns are 0 at masked positions (verl leaves ``A + V``
    there). ``gamma``/``lam`` may be numbers or 0-d tensors.
    """
    return rlmath.compute_gae_advantage_return(
        token_level_rewards, values, response_mask, _float(gamma), _float(lam)
    )


def _float(x: Any) -> Any:
    return float(x.item()) if isinstance(x, torch.Tensor) and x.numel() == 1 else x


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO / Dr.GRPO (:func:`rlmath.compute_grpo_outcome_advantage`).

    ``config`` is accepted and, as in verl, not read.
    """
    return rlmath.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same GRPO (rlmath's is vectorized already)."""
    return rlmath.compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


def _as_float_tensor(values: Any, device: torch.device) -> torch.Tensor:
    try:
        return torch.as_tensor(values, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError):
        return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)


def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict | None = None,
    batch: dict | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (:func:`rlmath.compute_gdpo_outcome_advantage`).

    With ``config``, ``non_tensor_batch`` and ``batch`` all given (verl's
    trainer), the reward components are ``non_tensor_batch[key]`` for each
    key of ``config.gdpo_reward_keys`` (one score per sample, the value verl
    places on the last response token) weighted by
    ``config.gdpo_reward_weights``; otherwise the single component is the
    response score.
    """
    components = None
    weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = config_get(config, "gdpo_reward_keys", None)
        if not keys:
            raise ValueError(
                "GDPO requires 'algorithm.gdpo_reward_keys' listing the individual reward "
                "component keys returned by compute_score (e.g. ['format_reward', 'accuracy_reward'])."
            )
        columns = []
        for key in keys:
            if key not in non_tensor_batch:
                raise ValueError(
                    f"GDPO reward key {key!r} not found in non_tensor_batch; available keys: "
                    f"{sorted(non_tensor_batch)}"
                )
            columns.append(_as_float_tensor(non_tensor_batch[key], token_level_rewards.device))
        components = torch.stack(columns, dim=-1)
        w = config_get(config, "gdpo_reward_weights", None)
        weights = None if w is None else [float(x) for x in w]
    return rlmath.compute_gdpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo,
        reward_components=components, reward_weights=weights,
    )  # fmt: skip


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (:func:`rlmath.compute_grpo_passk_outcome_advantage`).

    As in verl, ``config.norm_adv_by_std_in_grpo`` (default True) decides when
    a config is given; without one the argument does.
    """
    if config is not None:
        norm_adv_by_std_in_grpo = config_get(config, "norm_adv_by_std_in_grpo", True)
    return rlmath.compute_grpo_passk_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo
    )


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline, then batch whitening."""
    return rlmath.compute_reinforce_plus_plus_baseline_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon
    )


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's leave-one-out baseline (:func:`rlmath.compute_rloo_outcome_advantage`)."""
    return rlmath.compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon)


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same RLOO (rlmath's is vectorized already)."""
    return rlmath.compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon)


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO's length-weighted baseline (:func:`rlmath.compute_opo_outcome_advantage`)."""
    return rlmath.compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon)


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ discounted returns, batch-whitened; ``gamma`` from ``config`` (default 1.0)."""
    gamma = config_get(config, "gamma", 1.0)
    return rlmath.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards, response_mask, gamma=_float(gamma)
    )


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: return-to-go minus the greedy baseline (:func:`rlmath.compute_remax_outcome_advantage`)."""
    return rlmath.compute_remax_outcome_advantage(
        token_level_rewards, reward_baselines, response_mask
    )


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (:func:`rlmath.compute_gpg_outcome_advantage`).

    ``alpha`` is ignored, as in verl (always ``B / #{nonzero scores}``);
    ``rlmath.compute_gpg_outcome_advantage(alpha=...)`` takes a number.
    """
    return rlmath.compute_gpg_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, f_norm, None
    )


def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline (:func:`rlmath.compute_optimal_token_baseline_advantage`)."""
    return rlmath.compute_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
        rollout_is_weights, handle_zero_tail, epsilon,
    )  # fmt: skip


def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn optimal token baseline (trajectories aligned by their valid tokens)."""
    return rlmath.compute_multi_turn_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
        rollout_is_weights, handle_zero_tail, epsilon,
    )  # fmt: skip


#: verl's registry names and the functions ``install()`` puts there.
POLICY_LOSSES: dict[str, Any] = {
    "vanilla": compute_policy_loss_vanilla,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "dro": compute_policy_loss_dro,
    "cispo": compute_policy_loss_cispo,
    "bypass_mode": compute_policy_loss_bypass_mode,
}

ADV_ESTIMATORS: dict[str, Any] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_multi_turn_optimal_token_baseline_advantage,
}


def get_policy_loss_fn(name: str) -> Any:
    """verl's lookup of a policy loss by its registry name: the function with verl's signature.

    rlmath's own registry is :func:`rlmath.get_policy_loss` (rlmath's signatures).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"unknown policy loss {name!r}; verl's names are {', '.join(sorted(POLICY_LOSSES))}"
        )
    return POLICY_LOSSES[name]


def get_adv_estimator_fn(name: Any) -> Any:
    """verl's lookup of an advantage estimator by name (a string or verl's enum member)."""
    key = getattr(name, "value", name)
    if key not in ADV_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {key!r}; verl's names are "
            f"{', '.join(sorted(ADV_ESTIMATORS))}"
        )
    return ADV_ESTIMATORS[key]


# Lookups of verl's own registries: not among the names install() replaces in verl
# (it fills verl's registries instead, see _install.py).
__all__ += ["get_adv_estimator_fn", "get_policy_loss_fn"]
