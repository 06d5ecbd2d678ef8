"""Advantage estimators: ``[B, T]`` token tensors in, ``(advantages, returns)`` out.

Every estimator is a plain function, importable directly and registered under
verl's name (``get_advantage_estimator("grpo")``). Outputs are fp32 (fp64 for
fp64 inputs) and exactly 0 at masked positions. GAE and the discounted returns
use an ``O(B·T)`` tree scan instead of a Python loop over time; outcome
estimators use segment reductions over group ids instead of loops over samples
or groups. Semantics are pinned in docs/design.md ("Advantage estimators").
"""

from rlmath.advantages.gae import (
    compute_gae_advantage_return,
)
from rlmath.advantages.gdpo import compute_gdpo_outcome_advantage
from rlmath.advantages.gigpo import GIGPO_EPISODE_STATISTICS, compute_gigpo_outcome_advantage
from rlmath.advantages.gpg import compute_gpg_outcome_advantage
from rlmath.advantages.groups import GroupStats, group_ids, group_stats
from rlmath.advantages.grpo import (
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
)
from rlmath.advantages.maxrl import compute_maxrl_outcome_advantage
from rlmath.advantages.opo import compute_opo_outcome_advantage
from rlmath.advantages.optimal_token_baseline import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)
from rlmath.advantages.registry import (
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)
from rlmath.advantages.reinforce_plus_plus import (
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
)
from rlmath.advantages.remax import compute_remax_outcome_advantage
from rlmath.advantages.rloo import compute_rloo_outcome_advantage
from rlmath.advantages.scan import reverse_discounted_cumsum
from rlmath.advantages.vapo_gae import compute_vapo_gae_advantage_return, length_adaptive_lambda

__all__ = [
    "GIGPO_EPISODE_STATISTICS",
    "GroupStats",
    "compute_gae_advantage_return",
    "compute_gdpo_outcome_advantage",
    "compute_gigpo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_maxrl_outcome_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "compute_opo_outcome_advantage",
    "compute_optimal_token_baseline_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_vapo_gae_advantage_return",
    "get_advantage_estimator",
    "group_ids",
    "group_stats",
    "length_adaptive_lambda",
    "list_advantage_estimators",
    "register_advantage_estimator",
    "reverse_discounted_cumsum",
]
