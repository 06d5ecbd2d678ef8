"""Straightforward loop implementations of the outcome estimators, for tests and benchmarks.

Each function has the signature and semantics of its vectorized counterpart
and is written from the math with plain Python loops over samples, groups and
time steps, in fp64 Python floats (results cast to the vectorized function's
output dtype). They are slow on purpose: they are the oracle, and the
"per-sample Python loop" the benchmarks compare against. GAE's reference
loop is :func:`compute_gae_advantage_return_reference` below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any

import torch

from rlmath._validation import result_dtype
from rlmath.masked import masked_whiten

__all__ = [
    "compute_gae_advantage_return_reference",
    "gdpo_reference",
    "gigpo_reference",
    "gpg_reference",
    "grpo_passk_reference",
    "grpo_reference",
    "maxrl_reference",
    "opo_reference",
    "optimal_token_baseline_reference",
    "reinforce_plus_plus_baseline_reference",
    "reinforce_plus_plus_reference",
    "remax_reference",
    "rloo_reference",
    "vapo_gae_reference",
]

Rows = list[list[float]]
Pair = tuple[torch.Tensor, torch.Tensor]


def _keys(index: Any) -> list[Hashable]:
    if isinstance(index, torch.Tensor):
        return index.tolist()
    if hasattr(index, "tolist"):
        return index.tolist()
    return list(index)


def _groups(index: Any) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(_keys(index)):
        groups.setdefault(key, []).append(i)
    return groups


def _rows(x: torch.Tensor) -> Rows:
    return x.detach().to("cpu", torch.float64).tolist()


def _mask_rows(mask: torch.Tensor) -> list[list[bool]]:
    return (mask != 0).cpu().tolist()


def _scores(rewards: torch.Tensor, mask: torch.Tensor) -> list[float]:
    out = []
    for r_row, m_row in zip(_rows(rewards), _mask_rows(mask)):
        out.append(math.fsum(r for r, m in zip(r_row, m_row) if m))
    return out


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and unbiased std; std 0 for fewer than two values."""
    mean = math.fsum(xs) / len(xs)
    if len(xs) < 2:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _flat(xs: Sequence[float]) -> bool:
    """A singleton or all-equal group: no learning signal."""
    return all(x == xs[0] for x in xs)


def _to_tokens(per_sample: Sequence[float], mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = [[v if m else 0.0 for m in m_row] for v, m_row in zip(per_sample, _mask_rows(mask))]
    return torch.tensor(rows, dtype=dtype).reshape(mask.shape).to(mask.device)


def _outcome(per_sample: Sequence[float], rewards: torch.Tensor, mask: torch.Tensor) -> Pair:
    adv = _to_tokens(per_sample, mask, result_dtype(rewards))
    return adv, adv


def grpo_reference(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Pair:
    scores = _scores(rewards, mask)
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        xs = [scores[i] for i in members]
        if _flat(xs):
            continue
        mean, std = _mean_std(xs)
        for i in members:
            adv[i] = (scores[i] - mean) / (std + epsilon if norm_adv_by_std_in_grpo else 1.0)
    return _outcome(adv, rewards, mask)


def grpo_passk_reference(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Pair:
    scores = _scores(rewards, mask)
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        xs = sorted((scores[i] for i in members), reverse=True)
        if len(xs) < 2 or xs[0] == xs[1]:
            continue
        best = max(members, key=lambda i: scores[i])
        gap = xs[0] - xs[1]
        adv[best] = gap / (_mean_std(xs)[1] + epsilon) if norm_adv_by_std_in_grpo else gap
    return _outcome(adv, rewards, mask)


def rloo_reference(
    rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> Pair:
    scores = _scores(rewards, mask)
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        if _flat([scores[i] for i in members]):
            continue
        for i in members:
            others = [scores[j] for j in members if j != i]
            adv[i] = scores[i] - math.fsum(others) / len(others)
    return _outcome(adv, rewards, mask)


def opo_reference(
    rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> Pair:
    scores = _scores(rewards, mask)
    lengths = [sum(row) for row in _mask_rows(mask)]
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        if _flat([scores[i] for i in members]):
            continue
        total = sum(lengths[i] for i in members)
        baseline = math.fsum(lengths[i] * scores[i] for i in members) / total if total else 0.0
        for i in members:
            adv[i] = scores[i] - baseline
    return _outcome(adv, rewards, mask)


def gpg_reference(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float | None = None,
) -> Pair:
    scores = _scores(rewards, mask)
    if alpha is None:
        alpha = len(scores) / max(1, sum(1 for s in scores if s != 0))
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        xs = [scores[i] for i in members]
        if _flat(xs):
            continue
        mean = math.fsum(xs) / len(xs)
        for i in members:
            adv[i] = alpha * (scores[i] - mean) / f_norm
    return _outcome(adv, rewards, mask)


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> Rows:
    """Backward loop; masked steps carry the running return unchanged and read nothing."""
    out = []
    for r_row, m_row in zip(_rows(rewards), _mask_rows(mask)):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                running = r_row[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def reinforce_plus_plus_reference(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0
) -> Pair:
    dtype = result_dtype(rewards)
    returns = torch.tensor(_discounted_returns(rewards, mask, gamma), dtype=dtype)
    returns = returns.reshape(rewards.shape)
    return masked_whiten(returns, mask != 0), returns


def reinforce_plus_plus_baseline_reference(
    rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> Pair:
    scores = _scores(rewards, mask)
    centered = [0.0] * len(scores)
    for members in _groups(index).values():
        xs = [scores[i] for i in members]
        if _flat(xs):
            continue
        mean = math.fsum(xs) / len(xs)
        for i in members:
            centered[i] = scores[i] - mean
    tokens = _to_tokens(centered, mask, result_dtype(rewards))
    adv = masked_whiten(tokens, mask != 0)
    return adv, adv


def remax_reference(
    rewards: torch.Tensor, reward_baselines: torch.Tensor, mask: torch.Tensor
) -> Pair:
    dtype = result_dtype(rewards, reward_baselines)
    returns = torch.tensor(_discounted_returns(rewards, mask, 1.0), dtype=dtype)
    returns = returns.reshape(rewards.shape)
    base = reward_baselines.detach().cpu().to(torch.float64).tolist()
    adv = [
        [g - base[i] if m else 0.0 for g, m in zip(row, m_row)]
        for i, (row, m_row) in enumerate(zip(returns.tolist(), _mask_rows(mask)))
    ]
    return torch.tensor(adv, dtype=dtype).reshape(rewards.shape), returns


def gdpo_reference(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
) -> Pair:
    if reward_components is None:
        components = [[s] for s in _scores(rewards, mask)]
        dtype = result_dtype(rewards)
    else:
        components = _rows(reward_components)
        dtype = result_dtype(rewards, reward_components)
    k = len(components[0])
    weights = [1.0] * k if reward_weights is None else [float(w) for w in reward_weights]
    combined = [0.0] * len(components)
    for members in _groups(index).values():
        for c in range(k):
            xs = [components[i][c] for i in members]
            if _flat(xs):
                continue
            mean, std = _mean_std(xs)
            for i in members:
                scale = std + epsilon if norm_adv_by_std_in_grpo else 1.0
                combined[i] += weights[c] * (components[i][c] - mean) / scale
    adv = masked_whiten(_to_tokens(combined, mask, dtype), mask != 0)
    return adv, adv


def optimal_token_baseline_reference(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    old_log_prob: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    *,
    multi_turn: bool = False,
) -> Pair:
    """Both OTB variants: per group, per aligned step, a weighted mean of the returns."""
    extra = [old_log_prob, sum_pi_squared]
    if rollout_is_weights is not None:
        extra.append(rollout_is_weights)
    dtype = result_dtype(rewards, *extra)
    batch, length = rewards.shape
    valid = _mask_rows(mask)
    returns = _discounted_returns(rewards, mask, 1.0)
    logp, sq = _rows(old_log_prob), _rows(sum_pi_squared)
    rho = _rows(rollout_is_weights) if rollout_is_weights is not None else None

    # Per trajectory: the aligned steps (columns, or the k-th valid token).
    steps: list[list[int]] = []
    cum_w: list[dict[int, float]] = []
    for i in range(batch):
        running, w_at = 0.0, {}
        for t in range(length):
            if valid[i][t]:
                w = 1.0 - 2.0 * math.exp(logp[i][t]) + sq[i][t]
                if rho is not None:
                    w *= rho[i][t] ** 2
                running += w
                w_at[t] = running
        cum_w.append(w_at)
        steps.append([t for t in range(length) if valid[i][t]])

    def aligned(i: int) -> dict[int, int]:
        """Aligned step → column of trajectory i."""
        if multi_turn:
            return {k: t for k, t in enumerate(steps[i])}
        return {t: t for t in steps[i]}

    adv = [[0.0] * length for _ in range(batch)]
    for members in _groups(index).values():
        if multi_turn:
            members = [i for i in members if steps[i]]
        if len(members) < 2:
            continue
        columns = {i: aligned(i) for i in members}
        lengths = {i: len(steps[i]) for i in members}
        ranked = sorted(lengths.values(), reverse=True)
        tail_owner = None
        if handle_zero_tail and ranked[0] > ranked[1]:
            tail_owner = max(members, key=lambda i: lengths[i])
        for k in range(length):
            at_k = [i for i in members if k in columns[i]]
            g = {i: returns[i][columns[i][k]] for i in at_k}
            weight = {i: cum_w[i][columns[i][k]] for i in at_k}
            if all(g[i] == g[at_k[0]] for i in at_k):
                baseline = dict(g)
            else:
                total = math.fsum(weight.values()) + epsilon
                b = math.fsum(g[i] * weight[i] for i in at_k) / total
                baseline = {i: b for i in at_k}
            for i in at_k:
                b_i = 0.0 if (i == tail_owner and k >= ranked[1]) else baseline[i]
                adv[i][columns[i][k]] = g[i] - b_i

    out_returns = torch.tensor(returns, dtype=dtype).reshape(rewards.shape)
    return torch.tensor(adv, dtype=dtype).reshape(rewards.shape), out_returns


@torch.no_grad()
def compute_gae_advantage_return_reference(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook backward loop over ``t`` with the same semantics, for tests.

    Same arguments, outputs and dtypes as :func:`compute_gae_advantage_return`;
    ``O(T)`` Python steps. Masked steps carry the running advantage and the
    next valid value through unchanged.
    """
    rewards = token_level_rewards
    valid = response_mask.bool()
    g, lam_ = float(gamma), float(lam)
    dtype = result_dtype(rewards, values)
    r = torch.where(valid, rewards.to(dtype), 0)
    v = torch.where(valid, values.to(dtype), 0)
    batch, length = r.shape
    advantages = torch.zeros_like(r)
    next_value = r.new_zeros(batch)
    running = r.new_zeros(batch)
    for t in reversed(range(length)):
        keep = valid[:, t]
        delta = r[:, t] + g * next_value - v[:, t]
        step = delta + g * lam_ * running
        advantages[:, t] = torch.where(keep, step, 0)
        running = torch.where(keep, step, running)
        next_value = torch.where(keep, v[:, t], next_value)
    returns = torch.where(valid, advantages + v, 0)
    if whiten:
        advantages = masked_whiten(advantages, valid)
    return advantages, returns


def maxrl_reference(
    rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> Pair:
    """MaxRL (Tajwar et al. 2026): (s − mean_g)/(mean_g + ε); flat groups and singletons 0."""
    scores = _scores(rewards, mask)
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        xs = [scores[i] for i in members]
        if _flat(xs):
            continue
        mean = math.fsum(xs) / len(xs)
        for i in members:
            adv[i] = (scores[i] - mean) / (mean + epsilon)
    return _outcome(adv, rewards, mask)


def vapo_gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float = 1.0,
    *,
    lam_actor: float | None = None,
    length_adaptive_alpha: float | None = 0.05,
    whiten: bool = True,
) -> Pair:
    """VAPO's decoupled GAE as two textbook backward loops per row (arXiv:2504.05118, eq. 7).

    Returns from λ_critic = ``lam``; advantages from λ_actor = 1 − 1/max(α·l, 1)
    with l the row's valid-token count (or a fixed ``lam_actor``), whitened.
    """
    dtype = result_dtype(rewards, values)
    r_rows, v_rows, m_rows = _rows(rewards), _rows(values), _mask_rows(mask)

    def gae_row(r: list[float], v: list[float], m: list[bool], lam_: float) -> list[float]:
        out, running, next_value = [0.0] * len(r), 0.0, 0.0
        for t in reversed(range(len(r))):
            if m[t]:
                running = r[t] + gamma * next_value - v[t] + gamma * lam_ * running
                out[t] = running
                next_value = v[t]
        return out

    adv, ret = [], []
    for r, v, m in zip(r_rows, v_rows, m_rows):
        if length_adaptive_alpha is not None:
            lam_a = 1.0 - 1.0 / max(length_adaptive_alpha * sum(m), 1.0)
        else:
            lam_a = lam if lam_actor is None else lam_actor
        adv.append(gae_row(r, v, m, lam_a))
        critic = gae_row(r, v, m, lam)
        ret.append([a + v_t if m_t else 0.0 for a, v_t, m_t in zip(critic, v, m)])
    shape = rewards.shape
    advantages = torch.tensor(adv, dtype=dtype).reshape(shape)
    if whiten:
        advantages = masked_whiten(advantages, mask != 0)
    return advantages, torch.tensor(ret, dtype=dtype).reshape(shape)


def gigpo_reference(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    index: Any,
    traj_index: Any,
    step_index: Any,
    anchor_state: Any,
    gamma: float = 0.95,
    step_advantage_weight: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = False,
    *,
    episode_statistics: str = "trajectory",
) -> Pair:
    """GiGPO (Feng et al. 2025, eqs. 3, 5–8) by loops over trajectories and groups."""
    scores = _scores(rewards, mask)
    groups, trajs = _keys(index), _keys(traj_index)
    steps, anchors = _keys(step_index), _keys(anchor_state)
    by_traj: dict[Hashable, list[int]] = {}
    for i, key in enumerate(trajs):
        by_traj.setdefault(key, []).append(i)
    step_return = [0.0] * len(scores)
    episode_return = [0.0] * len(scores)
    for members in by_traj.values():
        ordered = sorted(members, key=lambda i: steps[i])
        running = 0.0
        for i in reversed(ordered):  # eq. 5: discounted return from each step
            running = scores[i] + gamma * running
            step_return[i] = running
        total = math.fsum(scores[i] for i in members)  # R(τ) = Σ_t r_t
        for i in members:
            episode_return[i] = total

    def relative(values: dict[int, float], member_groups: list[list[int]]) -> dict[int, float]:
        out = dict.fromkeys(values, 0.0)
        for members in member_groups:
            xs = [values[i] for i in members]
            if _flat(xs):
                continue
            mean, std = _mean_std(xs)
            for i in members:
                scale = std + epsilon if norm_adv_by_std_in_grpo else 1.0
                out[i] = (values[i] - mean) / scale
        return out

    episode = [0.0] * len(scores)
    by_group: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        by_group.setdefault(key, []).append(i)
    if episode_statistics == "trajectory":
        # One member per trajectory: its first row stands for it.
        heads = {members[0]: members for members in by_traj.values()}
        traj_groups: dict[Hashable, list[int]] = {}
        for head in heads:
            traj_groups.setdefault(groups[head], []).append(head)
        rel = relative({h: episode_return[h] for h in heads}, list(traj_groups.values()))
        for head, members in heads.items():
            for i in members:
                episode[i] = rel[head]
    else:
        rel = relative(dict(enumerate(episode_return)), list(by_group.values()))
        episode = [rel[i] for i in range(len(scores))]
    anchor_groups: dict[tuple[Hashable, Hashable], list[int]] = {}
    for i in range(len(scores)):
        anchor_groups.setdefault((groups[i], anchors[i]), []).append(i)
    step = relative(dict(enumerate(step_return)), list(anchor_groups.values()))
    adv = [episode[i] + step_advantage_weight * step[i] for i in range(len(scores))]
    return _outcome(adv, rewards, mask)


#: The fp64 oracle of every registered estimator, by registry name. The
#: conformance matrix compares each registered estimator with its oracle on
#: the shared batch, and fails for a registered name missing here.
ORACLES: dict[str, Callable[..., Pair]] = {
    "gae": compute_gae_advantage_return_reference,
    "grpo": grpo_reference,
    "grpo_vectorized": grpo_reference,
    "grpo_passk": grpo_passk_reference,
    "rloo": rloo_reference,
    "rloo_vectorized": rloo_reference,
    "opo": opo_reference,
    "gpg": gpg_reference,
    "reinforce_plus_plus": reinforce_plus_plus_reference,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_reference,
    "remax": remax_reference,
    "gdpo": gdpo_reference,
    "gigpo": gigpo_reference,
    "maxrl": maxrl_reference,
    "vapo_gae": vapo_gae_reference,
    "optimal_token_baseline": optimal_token_baseline_reference,
    "tir_optimal_token_baseline": partial(optimal_token_baseline_reference, multi_turn=True),
}
