"""Reward shaping: length and truncation penalties and filters, by name.

Every function takes ``(token_level_rewards, response_mask)`` and returns
``RewardShaping(token_level_rewards, response_mask, metrics)`` so they chain
before an advantage estimator (:mod:`rlmath.reward_shaping.registry` states
the shared signature). Nothing reads a tensor on the host.
"""

from rlmath.reward_shaping._common import RewardShaping
from rlmath.reward_shaping.overlong_filter import overlong_filter
from rlmath.reward_shaping.registry import (
    get_reward_shaping,
    list_reward_shapings,
    register_reward_shaping,
)
from rlmath.reward_shaping.soft_overlong_punishment import soft_overlong_punishment
from rlmath.reward_shaping.stop_properly_penalty import stop_properly_penalty

__all__ = [
    "RewardShaping",
    "get_reward_shaping",
    "list_reward_shapings",
    "overlong_filter",
    "register_reward_shaping",
    "soft_overlong_punishment",
    "stop_properly_penalty",
]
