"""GiGPO: group-in-group policy optimization for multi-step agents (Feng et al. 2025, arXiv:2505.10978).

Each row of the batch is one *step* (turn) of an agent's trajectory: its
response tokens, its reward ``r`` (the sum of its valid token rewards), the
trajectory it belongs to (``traj_index``), its position there
(``step_index``), the group of trajectories rolled out from the same initial
state (``index``) and the environment state it acted in (``anchor_state``).
Two relative advantages are combined (eq. 8):

* **episode level** (eq. 3): the trajectory's return ``R(τ) = Σ_t r_t``
  compared with the other trajectories of its group, GRPO-style:
  ``A^E = (R − mean) / F``;
* **step level** (eq. 5–7): the discounted return from the step on,
  ``G_t = Σ_{k ≥ t} γ^{k−t} r_k`` within the trajectory, compared with the
  other steps of the group taken from the *same anchor state* (identical
  states met by different trajectories): ``A^S = (G − mean) / F``;
* ``A = A^E + ω · A^S`` on every valid token of the step.

``F`` is the group's standard deviation (+ε) with ``norm_adv_by_std_in_grpo``
or 1 without (the default, verl-agent's ``mean_norm`` mode). Singleton and
all-equal groups (at either level) contribute exactly 0.

**Episode statistics.** The paper compares trajectories, each counted once
(``episode_statistics="trajectory"``, the default here). verl-agent (its
default ``compute_mean_std_cross_steps``) and ROLL compute the group mean and
standard deviation over the step rows, so a trajectory with more steps
weighs more: ``episode_statistics="step"``. Both frameworks take the episode
score and the per-step rewards as separate inputs; here the episode return is
the undiscounted sum of the step rewards, as the paper defines it (the same
whenever the environment pays its reward at the last step).

Nothing loops in Python over rows, trajectories or groups: the step returns
are one segmented scan over the rows sorted by (trajectory, step), and every
statistic is a segment reduction.
"""

from __future__ import annotations

from typing import Any

import torch

from rlmath._threads import threads_per_call
from rlmath._validation import check_choice, check_in_range, check_tensor
from rlmath.advantages._common import as_unit_scalar, outcome_inputs
from rlmath.advantages.groups import group_moments, segment_ids, segment_sum, to_samples
from rlmath.advantages.linear_scan import reverse_linear_scan
from rlmath.advantages.registry import register_advantage_estimator

__all__ = ["GIGPO_EPISODE_STATISTICS", "compute_gigpo_outcome_advantage"]

#: Accepted values of ``episode_statistics``.
GIGPO_EPISODE_STATISTICS: tuple[str, ...] = ("trajectory", "step")


def _step_tensor(step_index: Any, batch: int, device: torch.device) -> torch.Tensor:
    if not isinstance(step_index, torch.Tensor):
        try:
            step_index = torch.as_tensor(step_index)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                "step_index must be a tensor or a sequence of integers, "
                f"got {type(step_index).__name__}"
            ) from None
    check_tensor("step_index", step_index)
    if step_index.dtype == torch.bool or step_index.is_floating_point() or step_index.is_complex():
        raise TypeError(f"step_index must hold integers, got dtype {step_index.dtype}")
    if step_index.shape != (batch,):
        raise ValueError(
            f"step_index must hold one step number per row ({batch}), "
            f"got shape {tuple(step_index.shape)}"
        )
    return step_index.to(device=device, dtype=torch.int64)


def _discounted_step_returns(
    rewards: torch.Tensor, traj: torch.Tensor, step: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``G = r + γ·G_next`` within each trajectory, steps ordered by ``step`` (``(B,)``)."""
    # Rows sorted by (trajectory, step): a stable sort by step, then by trajectory.
    by_step = torch.sort(step, stable=True).indices
    order = by_step[torch.sort(traj[by_step], stable=True).indices]
    traj_sorted = traj[order]
    # The coefficient is γ where the next sorted row continues the trajectory, else 0.
    continues = torch.zeros_like(traj_sorted, dtype=torch.bool)
    continues[:-1] = traj_sorted[1:] == traj_sorted[:-1]
    # Built in the rewards' dtype (a float32 γ would round 0.95 to 0.94999999).
    coef = torch.where(continues, rewards.new_full((), gamma), rewards.new_zeros(()))
    sorted_returns = reverse_linear_scan(rewards[order].unsqueeze(0), coef.unsqueeze(0))[0]
    return torch.empty_like(sorted_returns).scatter_(0, order, sorted_returns)


def _relative(
    values: torch.Tensor, ids: torch.Tensor, norm_by_std: bool, eps: float
) -> torch.Tensor:
    m = group_moments(values, ids)
    if not norm_by_std:
        return m.centered
    # A flat group's std is 0: with ε = 0 the quotient would be 0/0.
    return torch.where(m.zero_std, 0, m.centered / (m.std + eps))


def _episode_advantage_per_trajectory(
    scores: torch.Tensor, ids: torch.Tensor, traj: torch.Tensor, norm_by_std: bool, eps: float
) -> torch.Tensor:
    """``A^E`` with each trajectory counted once in its group's statistics, per row."""
    batch = scores.shape[0]
    slots = torch.arange(batch, device=scores.device)
    returns = segment_sum(scores, traj)  # trajectory label → R(τ)
    present = segment_sum(torch.ones_like(scores), traj) > 0
    # Each trajectory slot takes its group's label (all its rows share one group);
    # an unused slot gets a label of its own past B, so it forms a flat group of
    # one 0 that never meets a real group. The second half only sizes the buffers.
    owner = torch.zeros_like(ids).scatter_(0, traj, ids)
    labels = torch.cat([torch.where(present, owner, batch + slots), batch + slots])
    padded = torch.cat([returns, torch.zeros_like(returns)])
    per_traj = _relative(padded, labels, norm_by_std, eps)[:batch]
    return to_samples(per_traj, traj)


@register_advantage_estimator("gigpo")
@torch.no_grad()
@threads_per_call
def compute_gigpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO advantages of step rows: episode-relative plus anchor-state-relative.

    Args:
        token_level_rewards: Shape ``(B, T)``, floating: the rewards of each
            step's tokens; a step's reward is the sum over its valid tokens.
        response_mask: Shape ``(B, T)``, bool or 0/1.
        index: Episode group (initial state / prompt) of each row: tensor,
            numpy array or list of hashable ids.
        traj_index: Trajectory of each row (hashable ids, unique across the
            batch; every row of a trajectory in the same ``index`` group).
        step_index: Position of each row in its trajectory: integer tensor
            or sequence ``(B,)``; only the order within a trajectory matters.
        anchor_state: State each step acted in (hashable ids, e.g. a hash of
            the observation); steps of one ``index`` group with equal ids form
            a step-level group.
        gamma: Discount ``γ`` in ``[0, 1]`` of the step returns (verl-agent's
            default 0.95).
        step_advantage_weight: ``ω`` (>= 0) of the step-level advantage.
        epsilon: ``ε`` added to the standard deviations (>= 0).
        norm_adv_by_std_in_grpo: Divide by the group standard deviation
            (verl-agent's ``mean_std_norm``); default False (``mean_norm``).
        episode_statistics: ``"trajectory"`` (the paper) or ``"step"``
            (verl-agent, ROLL): what one member of an episode group is.

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, fp32
        (fp64 for fp64 rewards), 0 at masked positions.
    """
    g = as_unit_scalar("gamma", gamma)
    omega = check_in_range("step_advantage_weight", step_advantage_weight, 0.0, None)
    eps = check_in_range("epsilon", epsilon, 0.0, None)
    check_choice("episode_statistics", episode_statistics, GIGPO_EPISODE_STATISTICS)
    if not isinstance(norm_adv_by_std_in_grpo, bool):
        raise TypeError(
            f"norm_adv_by_std_in_grpo must be a bool, got {type(norm_adv_by_std_in_grpo).__name__}"
        )
    x = outcome_inputs(token_level_rewards, response_mask, index)
    assert x.ids is not None
    s, ids = x.scores, x.ids
    batch, device = s.shape[0], s.device
    traj = _labels("traj_index", traj_index, batch, device)
    anchor = _labels("anchor_state", anchor_state, batch, device)
    step = _step_tensor(step_index, batch, device)

    if episode_statistics == "trajectory":
        episode = _episode_advantage_per_trajectory(s, ids, traj, norm_adv_by_std_in_grpo, eps)
    else:
        episode_return = to_samples(segment_sum(s, traj), traj)
        episode = _relative(episode_return, ids, norm_adv_by_std_in_grpo, eps)
    step_return = _discounted_step_returns(s, traj, step, g)
    # Step groups: the same anchor state within the same episode group.
    pairs = segment_ids(ids * batch + anchor, batch, device)
    step_adv = _relative(step_return, pairs, norm_adv_by_std_in_grpo, eps)
    advantages = x.to_tokens(episode + omega * step_adv)
    return advantages, advantages


def _labels(name: str, ids: Any, batch: int, device: torch.device) -> torch.Tensor:
    try:
        return segment_ids(ids, batch, device)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("index", name, 1)) from None
