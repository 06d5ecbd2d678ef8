"""TRL's log-prob and entropy helpers and its GRPO ``loss_type`` family, computed by rlmath.

* :func:`selective_log_softmax`, :func:`entropy_from_logits` and
  :func:`selective_log_softmax_and_entropy` have the signatures of the newest
  ``trl.trainer.utils`` (1.16; 0.24's are a prefix of them). Unlike TRL they return
  **fp32 for fp16/bf16 logits** (fp64 for fp64): rlmath upcasts one chunk at
  a time, never the whole ``[N, V]`` tensor, and its bf16 results are exact
  to fp32 rounding (TRL's bf16 ``log_softmax`` is off by ~5e-2). fp32 and
  fp64 results equal TRL's to rounding.
* :func:`grpo_loss` is ``GRPOTrainer``'s policy loss as a pure function, for
  every ``loss_type`` of TRL's ``GRPOConfig`` (``grpo``, ``bnpo``,
  ``dr_grpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo``, ``vespo``), with
  TRL's argument names, mapped onto rlmath's losses and aggregation modes.

* :func:`install` / :func:`uninstall` put them (and, on TRL 1.15/1.16, rlmath's
  fused LM head and :func:`grpo_loss`) into a running TRL: the one-line
  switch of ``docs/migration.md``.

Nothing here imports TRL, except :func:`install`.
"""

from __future__ import annotations

from typing import Any

import torch

import rlmath
from rlmath._validation import check_choice, check_in_range, check_mask, check_tensor
from rlmath.compat._trl_install import TESTED_TRL_VERSIONS, install, is_installed, uninstall

__all__ = [
    "TESTED_TRL_VERSIONS",
    "TRL_LOSS_TYPES",
    "entropy_from_logits",
    "grpo_loss",
    "install",
    "is_installed",
    "selective_log_softmax",
    "selective_log_softmax_and_entropy",
    "uninstall",
]

#: Every ``loss_type`` of TRL's ``GRPOConfig`` that :func:`grpo_loss` accepts.
TRL_LOSS_TYPES: tuple[str, ...] = (
    "grpo",
    "bnpo",
    "dr_grpo",
    "dapo",
    "cispo",
    "sapo",
    "luspo",
    "vespo",
)

_CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# The label given to positions ``row_mask`` skips (never a token id).
_SKIP = -100


def _row_masked(index: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    if row_mask is None:
        return index
    check_tensor("row_mask", row_mask)
    if row_mask.shape != index.shape:
        raise ValueError(
            f"row_mask must have the shape of index {tuple(index.shape)}, got {tuple(row_mask.shape)}"
        )
    # A skipped position carries the ignore label: rlmath returns 0 there and reads no logits.
    return index.masked_fill(row_mask.to(index.device) == 0, _SKIP)


def _check_temperature(temperature: float) -> None:
    if isinstance(temperature, torch.Tensor) or not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")


def selective_log_softmax(
    logits: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``index``, in bounded memory (:func:`rlmath.log_probs_from_logits`).

    Shapes: ``logits`` ``(..., V)``; ``index`` ``(...)`` or ``(..., K)`` integer
    (K log-probs per position, e.g. top-K); ``row_mask`` the shape of ``index``
    (0 = skip: that entry is 0 and gets no gradient, and a position whose
    entries are all skipped reads no logits). Result: the shape of ``index``,
    fp32 (fp64 for fp64 logits) whatever the logits' dtype; differentiable
    w.r.t. ``logits``. ``temperature`` and ``row_mask`` are TRL >= 1.14's
    arguments (TRL 0.24 has ``(logits, index)``).

    Raises:
        ValueError: ``temperature <= 0``; ``row_mask`` not of ``index``'s shape.
    """
    _check_temperature(temperature)
    labels = _row_masked(index, row_mask)
    return rlmath.log_probs_from_logits(
        logits, labels, temperature=temperature, ignore_index=None if row_mask is None else _SKIP
    )


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits)`` per row, ``chunk_size`` rows at a time.

    :func:`rlmath.entropy_from_logits`. Shapes: ``logits`` ``(..., V)``;
    result ``logits.shape[:-1]``, fp32 (fp64 for fp64 logits) whatever the
    logits' dtype; differentiable, and finite for ``-inf`` logits.
    """
    return rlmath.entropy_from_logits(logits, chunk_size=chunk_size)


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL >= 1.14's one-pass log-probs and entropies (:func:`rlmath.log_probs_and_entropy_from_logits`).

    Shapes: ``logits`` ``(..., V)``, ``index`` and ``row_mask`` ``(...)``.
    Returns ``(log_probs, entropy)``, both of ``index``'s shape, fp32 (fp64
    for fp64 logits), of ``softmax(logits / temperature)``; positions with
    ``row_mask == 0`` are 0 in both and get no gradient.
    ``entropy_requires_grad=False`` returns the entropy detached.

    Raises:
        ValueError: ``temperature <= 0``; ``index`` not of shape
            ``logits.shape[:-1]``; ``row_mask`` not of ``index``'s shape.
    """
    _check_temperature(temperature)
    check_tensor("logits", logits, floating=True)
    if index.shape != logits.shape[:-1]:
        raise ValueError(
            f"index must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(index.shape)}"
        )
    labels = _row_masked(index, row_mask)
    log_probs, entropy = rlmath.log_probs_and_entropy_from_logits(
        logits, labels, temperature=temperature, ignore_index=_SKIP
    )
    return log_probs, entropy if entropy_requires_grad else entropy.detach()


def _masked_row_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return rlmath.masked_mean(x, valid)


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    importance_sampling_ratio: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    num_items_in_batch: Any = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL ``GRPOTrainer``'s loss for one micro-batch, as ``(loss, metrics)``.

    Per-token losses (``r`` the token ratio, or the length-normalised
    sequence ratio with ``importance_sampling_level="sequence"``):

    * ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: PPO clip
      ``−min(r·A, clip(r, 1−epsilon, 1+epsilon_high)·A)``
      (:func:`rlmath.compute_policy_loss_vanilla`, or the GSPO-token form
      :func:`rlmath.compute_policy_loss_gspo` at sequence level); ``delta``
      (INTELLECT-2's upper bound for ``A < 0``, > ``1 + epsilon_high``) is
      rlmath's dual clip ``clip_ratio_c``.
    * ``cispo``: ``−sg(min(r, epsilon_high))·A·log π`` — TRL's
      ``epsilon_high`` is an absolute cap here (:func:`rlmath.compute_policy_loss_cispo`
      with ``upper_only=True``, ``clip_ratio_high = epsilon_high − 1``).
    * ``sapo``: the soft gate (:func:`rlmath.compute_policy_loss_sapo`).
    * ``vespo``: the Gamma weight of the sequence ratio
      (:func:`rlmath.compute_policy_loss_vespo`); ``importance_sampling_ratio``
      is folded into that ratio instead of multiplying the loss.

    Aggregation (``B`` rows, ``G`` = ``gradient_accumulation_steps``):
    ``grpo``/``sapo``: mean over rows of each row's token mean, ``/ G``
    (``seq-mean-token-mean``); ``bnpo``: local token mean ``/ G``
    (``token-mean``); ``dr_grpo``: ``Σ / (B · max_completion_length) / G``
    (``seq-mean-token-sum-norm``); ``dapo``/``cispo``/``vespo``:
    ``Σ · num_processes / num_items_in_batch`` (``token-mean`` with the
    global token count; ``num_items_in_batch`` defaults to the local count);
    ``luspo``: ``Σ_i |y_i|·l_i / B / G`` (``seq-mean-token-sum``). Rows
    without a valid token count in ``B``, as in TRL.

    With ``beta > 0`` the k3 estimate of KL(π‖π_ref) (unclamped, as TRL's;
    times the token ratio with ``use_bias_correction_kl``) is added to every
    token's loss. ``importance_sampling_ratio`` (vLLM's truncated IS weights,
    ``(B, T)``) multiplies the policy term for every loss type but ``vespo``.
    Entropy or off-policy masks: multiply them into ``completion_mask``.

    Args:
        per_token_logps: log π_θ of the completion tokens, ``(B, T)``.
        old_per_token_logps: log π_old, ``(B, T)``, or None (on-policy: the
            detached ``per_token_logps``, as TRL).
        advantages: ``(B,)`` per completion or ``(B, T)``.
        completion_mask: bool or 0/1 ``(B, T)``.

    Returns:
        ``loss`` (0-d, fp32; fp64 for fp64 inputs) and detached 0-d metrics
        with TRL's names: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
        ``clip_ratio/region_mean`` (clip family), ``cispo_clip_ratio``,
        ``vespo/phi_seq_mean``, ``kl`` (when ``beta > 0``); local values
        (TRL averages them over processes).
    """
    check_choice("loss_type", loss_type, TRL_LOSS_TYPES)
    check_choice("importance_sampling_level", importance_sampling_level, ("token", "sequence"))
    check_tensor("per_token_logps", per_token_logps, floating=True)
    if per_token_logps.dim() != 2:
        raise ValueError(
            f"per_token_logps must have shape (B, T), got {tuple(per_token_logps.shape)}"
        )
    check_mask("completion_mask", completion_mask, "per_token_logps", per_token_logps)
    check_tensor("advantages", advantages, floating=True)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.dim() != 2 or advantages.shape[0] != per_token_logps.shape[0]:
        raise ValueError(
            f"advantages must have shape (B,) or (B, T) with B = {per_token_logps.shape[0]}, "
            f"got {tuple(advantages.shape)}"
        )
    advantages = advantages.expand(per_token_logps.shape)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    check_in_range("epsilon", epsilon, 0.0, None)
    eps_high = (
        epsilon if epsilon_high is None else check_in_range("epsilon_high", epsilon_high, 0.0, None)
    )
    for name, value in (
        ("num_processes", num_processes),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        raise ValueError(
            "loss_type 'luspo' requires importance_sampling_level='sequence' (as in TRL)"
        )
    if loss_type == "vespo" and importance_sampling_level != "token":
        raise ValueError(
            "loss_type 'vespo' requires importance_sampling_level='token' (its weight is already "
            "sequence-level, as in TRL)"
        )
    if loss_type in ("cispo", "sapo") and importance_sampling_level == "sequence":
        raise ValueError(
            f"loss_type {loss_type!r} is implemented at importance_sampling_level='token' only"
        )
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError(
            "loss_type 'dr_grpo' needs max_completion_length (its constant normaliser)"
        )
    if delta is not None:
        check_in_range("delta", delta, 1.0 + eps_high, None, low_inclusive=False)
    check_in_range("beta", beta, 0.0, None)
    if beta > 0 and ref_per_token_logps is None:
        raise ValueError("ref_per_token_logps is required when beta > 0")

    mask = completion_mask
    valid = mask if mask.dtype == torch.bool else mask != 0
    rows = per_token_logps.shape[0]
    G = gradient_accumulation_steps
    if loss_type in ("grpo", "sapo"):
        agg: Any = {"loss_agg_mode": "seq-mean-token-mean", "global_num_seqs": rows * G}
    elif loss_type == "bnpo":
        local = rlmath.masked_sum(torch.ones_like(per_token_logps), mask)
        agg = {"loss_agg_mode": "token-mean", "global_num_tokens": local * G}
    elif loss_type == "dr_grpo":
        agg = {
            "loss_agg_mode": "seq-mean-token-sum-norm",
            "global_num_seqs": rows * G,
            "norm_length": max_completion_length,
        }
    elif loss_type == "luspo":
        agg = {"loss_agg_mode": "seq-mean-token-sum", "global_num_seqs": rows * G}
    else:  # dapo, cispo, vespo: the global token count of the accumulated batch
        count = num_items_in_batch
        if count is None:
            count = rlmath.masked_sum(torch.ones_like(per_token_logps), mask)
        if isinstance(count, torch.Tensor):
            count = count.clamp(min=1.0)
        elif count < 1:
            count = 1.0
        agg = {"loss_agg_mode": "token-mean", "global_num_tokens": count, "dp_size": num_processes}

    is_weights = None if loss_type == "vespo" else importance_sampling_ratio
    args = (old_per_token_logps, per_token_logps, advantages, mask)
    metrics: dict[str, torch.Tensor] = {}
    if loss_type in _CLIP_FAMILY:
        if importance_sampling_level == "token":
            loss, _ = rlmath.compute_policy_loss_vanilla(
                old_per_token_logps, per_token_logps, advantages, mask, clip_ratio=epsilon,
                clip_ratio_low=epsilon, clip_ratio_high=eps_high, clip_ratio_c=delta,
                rollout_is_weights=is_weights, **agg,
            )  # fmt: skip
            coef = torch.exp(
                (per_token_logps.detach() - old_per_token_logps.detach()).clamp(-20, 20)
            )
            adv, units = advantages, valid
        else:
            if delta is not None:
                raise ValueError("delta is implemented at importance_sampling_level='token' only")
            loss, _ = rlmath.compute_policy_loss_gspo(
                old_per_token_logps, per_token_logps, advantages, mask, clip_ratio=epsilon,
                clip_ratio_low=epsilon, clip_ratio_high=eps_high, rollout_is_weights=is_weights,
                **agg,
            )  # fmt: skip
            seq = rlmath.sequence_log_ratio(per_token_logps - old_per_token_logps, mask)
            coef = torch.exp(seq.squeeze(-1))
            adv = rlmath.masked_mean(advantages.detach(), mask, axis=-1)
            units = valid.any(dim=-1)
        low = (coef < 1 - epsilon) & (adv < 0)
        high = (coef > 1 + eps_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = _masked_row_mean(low, units)
        metrics["clip_ratio/high_mean"] = _masked_row_mean(high, units)
        metrics["clip_ratio/region_mean"] = _masked_row_mean(low | high, units)
    elif loss_type == "cispo":
        if eps_high < 1:
            raise ValueError(
                f"epsilon_high is CISPO's absolute cap and must be >= 1, got {eps_high}"
            )
        loss, _ = rlmath.compute_policy_loss_cispo(
            *args, clip_ratio_high=eps_high - 1, upper_only=True, rollout_is_weights=is_weights,
            **agg,
        )  # fmt: skip
        coef = torch.exp((per_token_logps.detach() - old_per_token_logps.detach()).clamp(-20, 20))
        metrics["cispo_clip_ratio"] = _masked_row_mean((coef > eps_high) & (advantages > 0), valid)
    elif loss_type == "sapo":
        loss, _ = rlmath.compute_policy_loss_sapo(
            *args, tau_pos=sapo_temperature_pos, tau_neg=sapo_temperature_neg,
            rollout_is_weights=is_weights, **agg,
        )  # fmt: skip
    else:
        loss, m = rlmath.compute_policy_loss_vespo(
            *args, k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos, k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg, importance_sampling_ratio=importance_sampling_ratio,
            **agg,
        )  # fmt: skip
        metrics["vespo/phi_seq_mean"] = m["vespo_phi_mean"]
    if beta > 0:
        assert ref_per_token_logps is not None
        kl = rlmath.kl_penalty(per_token_logps, ref_per_token_logps, "k3", k3_max=None)
        if use_bias_correction_kl:
            # TRL multiplies by its (differentiable) importance weight of the level.
            log_ratio = (per_token_logps - old_per_token_logps.detach()).clamp(-20, 20)
            if importance_sampling_level == "sequence":
                log_ratio = rlmath.masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)
            kl = kl * torch.exp(log_ratio)
        loss = loss + beta * rlmath.agg_loss(kl, mask, **agg)
        metrics["kl"] = rlmath.masked_mean(kl.detach(), mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


# ---------------------------------------------------------------------------
# TRL's names for its token masks and its length reward, computed by rlmath:
# ``GRPOTrainer.get_off_policy_mask`` (a static method in TRL >= 0.27),
# ``GRPOTrainer.get_high_entropy_mask`` (a method; ``self`` only supplies the
# process group) and ``trl.rewards.get_soft_overlong_punishment``.

__all__ += ["get_high_entropy_mask", "get_off_policy_mask", "get_soft_overlong_punishment"]


def get_off_policy_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    off_policy_threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask as TRL returns it (:func:`rlmath.off_policy_sequence_mask`).

    Shapes: ``advantages`` ``(B, 1)`` (or ``(B, T)``), the log-probs and
    ``mask`` ``(B, T)``. Returns ``(A >= 0) | (δ <= threshold)`` in
    ``advantages``' shape and ``mask``'s dtype (1 = keep), ``δ`` the mean over
    valid tokens of ``sampling_per_token_logps − per_token_logps``.
    """
    check_tensor("advantages", advantages, floating=True)
    out = rlmath.off_policy_sequence_mask(
        sampling_per_token_logps, per_token_logps, advantages, mask,
        threshold=off_policy_threshold,
    )  # fmt: skip
    low_kl = (out.sequence_kl <= off_policy_threshold).unsqueeze(-1)
    return ((advantages >= 0) | low_kl).to(mask.dtype)


def get_high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, threshold: float, *, group: Any = None
) -> torch.Tensor:
    """TRL's high-entropy token mask (:func:`rlmath.high_entropy_token_mask`).

    ``threshold`` is the quantile level (TRL passes ``1 − top_entropy_quantile``);
    ``group`` is the process group TRL's accelerator gathers over. Returns a
    bool ``(B, T)`` mask equal to TRL's, without gathering the entropies.
    """
    level = check_in_range("threshold", threshold, 0.0, 1.0)
    return rlmath.high_entropy_token_mask(
        entropies, mask, top_entropy_quantile=1.0 - level, group=group
    ).keep


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Any:
    """TRL's DAPO length reward function (:func:`rlmath.soft_overlong_punishment`).

    Returns a callable ``(completion_ids: list[list[int]], **kwargs) -> list[float]``
    like TRL's reward functions. ``soft_punish_cache`` must be in
    ``[1, max_completion_len]`` (TRL also accepts 0, and then divides by it).
    """
    rlmath.soft_overlong_punishment(
        torch.zeros(0, 1),
        torch.zeros(0, 1, dtype=torch.bool),
        max_response_length=max_completion_len,
        overlong_buffer_length=soft_punish_cache,
    )  # fmt: skip  (validates the two lengths now, not at the first call)

    def soft_overlong_punishment_reward(
        completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
        rows = torch.zeros(len(completion_ids), 1, dtype=torch.float64)
        out = rlmath.soft_overlong_punishment(
            rows, torch.ones_like(rows, dtype=torch.bool), max_response_length=max_completion_len,
            overlong_buffer_length=soft_punish_cache, response_length=lengths,
        )  # fmt: skip
        return [float(v) for v in out.token_level_rewards[:, 0].tolist()]

    return soft_overlong_punishment_reward
