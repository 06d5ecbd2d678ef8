"""The straightforward code each benchmark compares rlmath against.

What one writes without rlmath, computing the same quantities with the same
semantics, so that a ratio in a table compares two ways of getting one
result:

* log-probs: :func:`naive_log_probs` materializes the fp32 ``log_softmax``
  of the whole ``(N, V)`` logits and gathers the labels;
  :func:`naive_log_probs_and_entropy` adds ``−Σ p·log p`` from the same
  ``log_softmax``.
* fused head: :func:`unfused_head` materializes the logits ``hidden @
  weight.T`` and hands them to rlmath's log-probs and entropy, so that the
  comparison isolates the fusion. :func:`unfused_head_onednn` is the same
  with its three matmuls in oneDNN, the library the fused head's fp32 CPU
  matmuls run in on some machines
  (:mod:`rlmath.engine.torch_backend.cpu_matmul`): it shows what the choice
  of matmul library is worth apart from the fusion.
* GAE: :func:`gae_loop`, the backward loop over ``T``, one step of tensor
  ops over the batch per time step, with rlmath's multi-turn semantics
  (masked tokens are skipped).
* outcome estimators: per-sample scores and per-group statistics in plain
  Python (:data:`OUTCOME_LOOPS`), and :func:`grpo_torch_scalar_loop`, GRPO
  as a per-sample loop over torch scalars.

The outcome loops follow rlmath's conventions where estimators differ
between libraries: a singleton group, or a group whose scores are all
equal, gives 0 before any batch whitening; whitening is over the valid
tokens of the batch with the unbiased variance and ``eps = 1e-8``. Outputs
are fp32 (fp64 for fp64 inputs) and 0 at masked positions, as rlmath's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

import torch

from rlmath.engine.torch_backend import cpu_matmul
from rlmath.log_probs import log_probs_and_entropy_from_logits

__all__ = [
    "OUTCOME_LOOPS",
    "gae_loop",
    "gdpo_loop",
    "gpg_loop",
    "grpo_loop",
    "grpo_passk_loop",
    "grpo_torch_scalar_loop",
    "naive_log_probs",
    "naive_log_probs_and_entropy",
    "opo_loop",
    "reinforce_plus_plus_baseline_loop",
    "rloo_loop",
    "unfused_head",
    "unfused_head_onednn",
]

Pair = tuple[torch.Tensor, torch.Tensor]

# ----------------------------------------------------------------------------- log-probs


def naive_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float(), -1).gather(-1, labels)``: ``(N, V)``, ``(N,)`` → ``(N,)``."""
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def naive_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> Pair:
    """The label log-probs and the entropy ``−Σ p·log p``, both from one fp32 ``log_softmax``."""
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(-1, labels[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def unfused_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Pair:
    """Log-probs and entropy of the materialized logits ``hidden @ weight.T`` (``(N, V)``)."""
    return log_probs_and_entropy_from_logits(hidden @ weight.T, labels)


class _OnednnLinear(torch.autograd.Function):
    """``hidden @ weight.T`` whose three matmuls (forward and both gradients) run in oneDNN.

    fp32 only: oneDNN's CPU matmuls; any other dtype takes torch's (``torch.mm``).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        return cpu_matmul.mm(hidden, weight.T, onednn=hidden.dtype == torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        hidden, weight = ctx.saved_tensors
        onednn = grad.dtype == torch.float32
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = cpu_matmul.mm(grad, weight, onednn=onednn)
        if ctx.needs_input_grad[1]:
            grad_weight = cpu_matmul.mm(grad.T, hidden, onednn=onednn)
        return grad_hidden, grad_weight


def unfused_head_onednn(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Pair:
    """:func:`unfused_head` with its three matmuls in oneDNN (fp32 CPU tensors).

    Shape: ``(N, H)``, ``(V, H)``, ``(N,)`` → ``((N,), (N,))``.
    """
    return log_probs_and_entropy_from_logits(_OnednnLinear.apply(hidden, weight), labels)


# ----------------------------------------------------------------------------- GAE


def _result_dtype(*xs: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _whiten_tokens(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(x − mean) / sqrt(var + 1e-8)`` over the valid tokens (unbiased variance); 0 elsewhere."""
    n = valid.sum()
    mean = torch.where(valid, x, 0).sum() / n
    var = torch.where(valid, (x - mean) ** 2, 0).sum() / (n - 1)
    return torch.where(valid, (x - mean) * torch.rsqrt(var + 1e-8), 0)


@torch.no_grad()
def gae_loop(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool = True,
) -> Pair:
    """GAE by the backward loop over ``t``: ``(advantages, returns)``, each ``(B, T)``.

    ``δ = r[t] + γ·V[next valid] − V[t]`` and ``A[t] = δ + γλ·A[next valid]``
    on the valid tokens; a masked step reads nothing and passes the running
    advantage and the next valid value through. Returns are ``A + V``;
    advantages are then whitened over the valid tokens of the batch.
    """
    valid = response_mask.bool()
    dtype = _result_dtype(token_level_rewards, values)
    rewards = token_level_rewards.to(dtype)
    vals = values.to(dtype)
    batch, length = rewards.shape
    advantages = torch.zeros(batch, length, dtype=dtype, device=rewards.device)
    carried = advantages.new_zeros(batch)  # A at the next valid token
    next_value = advantages.new_zeros(batch)  # V at the next valid token, 0 after the last
    for t in range(length - 1, -1, -1):
        here = valid[:, t]
        a_t = rewards[:, t] + gamma * next_value - vals[:, t] + gamma * lam * carried
        advantages[:, t] = torch.where(here, a_t, 0)
        carried = torch.where(here, a_t, carried)
        next_value = torch.where(here, vals[:, t], next_value)
    returns = torch.where(valid, advantages + vals, 0)
    if whiten:
        advantages = _whiten_tokens(advantages, valid)
    return advantages, returns


# ----------------------------------------------------------------------------- outcome estimators


def _ids(index: Any) -> list[Hashable]:
    """Group ids as Python values: from a tensor, a numpy array or any sequence."""
    return index.tolist() if hasattr(index, "tolist") else list(index)


def _groups(index: Any) -> list[list[int]]:
    """The sample positions of each group, in order of first appearance."""
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(_ids(index)):
        members.setdefault(key, []).append(i)
    return list(members.values())


def _scores(rewards: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Per sample, the sum of its valid token rewards, in Python floats."""
    rows = rewards.detach().double().cpu().tolist()
    keep = (mask != 0).cpu().tolist()
    return [sum(r for r, k in zip(row, ks) if k) for row, ks in zip(rows, keep)]


def _valid_lengths(mask: torch.Tensor) -> list[int]:
    return [sum(row) for row in (mask != 0).cpu().tolist()]


def _spread(xs: list[float]) -> bool:
    """At least two different scores: a learning signal (else the group gets 0)."""
    return any(x != xs[0] for x in xs)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and unbiased standard deviation of at least two values."""
    mean = sum(xs) / len(xs)
    return mean, (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def _per_token(per_sample: list[float], rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's value on its valid tokens, 0 on the others."""
    column = torch.tensor(per_sample, dtype=_result_dtype(rewards), device=rewards.device)
    return torch.where(mask != 0, column[:, None], 0)


def _outcome(per_sample: list[float], rewards: torch.Tensor, mask: torch.Tensor) -> Pair:
    adv = _per_token(per_sample, rewards, mask)
    return adv, adv


def _whitened(per_sample: list[float], rewards: torch.Tensor, mask: torch.Tensor) -> Pair:
    adv = _whiten_tokens(_per_token(per_sample, rewards, mask), mask != 0)
    return adv, adv


def _grpo_scores(scores: list[float], index: Any, epsilon: float) -> list[float]:
    adv = [0.0] * len(scores)
    for group in _groups(index):
        xs = [scores[i] for i in group]
        if _spread(xs):
            mean, std = _mean_std(xs)
            for i in group:
                adv[i] = (scores[i] - mean) / (std + epsilon)
    return adv


def _centered(scores: list[float], index: Any) -> list[float]:
    adv = [0.0] * len(scores)
    for group in _groups(index):
        xs = [scores[i] for i in group]
        if _spread(xs):
            mean = sum(xs) / len(xs)
            for i in group:
                adv[i] = scores[i] - mean
    return adv


def grpo_loop(rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6) -> Pair:
    """GRPO: ``(s − mean_g) / (std_g + ε)`` per group."""
    return _outcome(_grpo_scores(_scores(rewards, mask), index, epsilon), rewards, mask)


def grpo_passk_loop(
    rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> Pair:
    """GRPO pass@k: the unique best of a group gets ``(s_max − s_second) / (std_g + ε)``."""
    scores = _scores(rewards, mask)
    adv = [0.0] * len(scores)
    for group in _groups(index):
        xs = [scores[i] for i in group]
        if not _spread(xs):
            continue
        ranked = sorted(group, key=lambda i: scores[i], reverse=True)
        best, second = scores[ranked[0]], scores[ranked[1]]
        if best > second:
            adv[ranked[0]] = (best - second) / (_mean_std(xs)[1] + epsilon)
    return _outcome(adv, rewards, mask)


def rloo_loop(rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6) -> Pair:
    """RLOO: ``s_i`` minus the mean of the other scores of its group."""
    scores = _scores(rewards, mask)
    adv = [0.0] * len(scores)
    for group in _groups(index):
        xs = [scores[i] for i in group]
        if _spread(xs):
            total = sum(xs)
            for i in group:
                adv[i] = scores[i] - (total - scores[i]) / (len(group) - 1)
    return _outcome(adv, rewards, mask)


def opo_loop(rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6) -> Pair:
    """OPO: ``s_i`` minus the group's length-weighted mean score."""
    scores, lengths = _scores(rewards, mask), _valid_lengths(mask)
    adv = [0.0] * len(scores)
    for group in _groups(index):
        if not _spread([scores[i] for i in group]):
            continue
        tokens = sum(lengths[i] for i in group)
        baseline = sum(lengths[i] * scores[i] for i in group) / tokens if tokens else 0.0
        for i in group:
            adv[i] = scores[i] - baseline
    return _outcome(adv, rewards, mask)


def gpg_loop(rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6) -> Pair:
    """GPG: ``α · (s − mean_g)`` with ``α = B / #{non-zero scores}`` (``F_norm = 1``)."""
    scores = _scores(rewards, mask)
    alpha = len(scores) / max(1, sum(s != 0 for s in scores))
    return _outcome([alpha * a for a in _centered(scores, index)], rewards, mask)


def reinforce_plus_plus_baseline_loop(
    rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6
) -> Pair:
    """REINFORCE++ with baseline: ``s − mean_g`` on the tokens, whitened over the batch."""
    return _whitened(_centered(_scores(rewards, mask), index), rewards, mask)


def gdpo_loop(rewards: torch.Tensor, mask: torch.Tensor, index: Any, epsilon: float = 1e-6) -> Pair:
    """GDPO with one reward component: GRPO's group normalization, then batch whitening."""
    return _whitened(_grpo_scores(_scores(rewards, mask), index, epsilon), rewards, mask)


#: The per-group loop of each outcome estimator, by rlmath's registry name.
OUTCOME_LOOPS: dict[str, Callable[[torch.Tensor, torch.Tensor, Any], Pair]] = {
    "grpo": grpo_loop,
    "grpo_passk": grpo_passk_loop,
    "rloo": rloo_loop,
    "opo": opo_loop,
    "gpg": gpg_loop,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_loop,
    "gdpo": gdpo_loop,
}


def grpo_torch_scalar_loop(
    rewards: torch.Tensor, mask: torch.Tensor, index: list[Hashable], epsilon: float = 1e-6
) -> torch.Tensor:
    """GRPO as a per-sample loop over torch scalars, the style of verl before it vectorized.

    Returns the ``(B, T)`` advantages. A singleton group has mean = its
    score and std 1, so it gets 0, as in rlmath.
    """
    scores = torch.where(mask != 0, rewards, 0).sum(-1)
    by_group: dict[Hashable, list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        by_group[index[i]].append(scores[i])
    mean, std = {}, {}
    for key, xs in by_group.items():
        if len(xs) == 1:
            mean[key], std[key] = xs[0], scores.new_tensor(1.0)
        else:
            stacked = torch.stack(xs)
            mean[key], std[key] = stacked.mean(), stacked.std()
    out = scores.clone()
    for i in range(scores.shape[0]):
        out[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon)
    return torch.where(mask != 0, out[:, None], 0)
