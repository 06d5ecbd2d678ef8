"""The estimator registry: verl's names, plain functions, verl's positional arguments."""

from __future__ import annotations

import enum
import inspect

import pytest
import torch

import rlmath as R
from rlmath.advantages import registry

# verl 0.9.1's registry names and the positional parameters of its functions (minus
# ``config``), which migrating callers rely on.
VERL_SIGNATURES = {
    "gae": ["token_level_rewards", "values", "response_mask", "gamma", "lam"],
    "grpo": ["token_level_rewards", "response_mask", "index", "epsilon", "norm_adv_by_std_in_grpo"],
    "grpo_vectorized": [
        "token_level_rewards",
        "response_mask",
        "index",
        "epsilon",
        "norm_adv_by_std_in_grpo",
    ],
    "grpo_passk": [
        "token_level_rewards",
        "response_mask",
        "index",
        "epsilon",
        "norm_adv_by_std_in_grpo",
    ],
    "gdpo": ["token_level_rewards", "response_mask", "index", "epsilon", "norm_adv_by_std_in_grpo"],
    "rloo": ["token_level_rewards", "response_mask", "index", "epsilon"],
    "rloo_vectorized": ["token_level_rewards", "response_mask", "index", "epsilon"],
    "opo": ["token_level_rewards", "response_mask", "index", "epsilon"],
    "reinforce_plus_plus": ["token_level_rewards", "response_mask"],
    "reinforce_plus_plus_baseline": ["token_level_rewards", "response_mask", "index", "epsilon"],
    "remax": ["token_level_rewards", "reward_baselines", "response_mask"],
    "gpg": ["token_level_rewards", "response_mask", "index", "epsilon", "f_norm", "alpha"],
    "optimal_token_baseline": [
        "token_level_rewards",
        "response_mask",
        "index",
        "old_log_prob",
        "sum_pi_squared",
        "rollout_is_weights",
        "handle_zero_tail",
        "epsilon",
    ],
    "tir_optimal_token_baseline": [
        "token_level_rewards",
        "response_mask",
        "index",
        "old_log_prob",
        "sum_pi_squared",
        "rollout_is_weights",
        "handle_zero_tail",
        "epsilon",
    ],
}

# verl's defaults for the keyword scalars (function defaults or AlgoConfig fields).
VERL_DEFAULTS = {
    "grpo": {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": True},
    "grpo_passk": {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": True},
    "gdpo": {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": True},
    "reinforce_plus_plus": {"gamma": 1.0},
    "gpg": {"epsilon": 1e-6, "f_norm": 1.0},
    "optimal_token_baseline": {"handle_zero_tail": True, "epsilon": 1e-8},
    "gae": {"whiten": True},
}


def test_every_verl_name_is_registered():
    assert set(VERL_SIGNATURES) <= set(R.list_advantage_estimators())


@pytest.mark.parametrize("name", sorted(VERL_SIGNATURES))
def test_positional_parameters_follow_verl(name):
    params = inspect.signature(R.get_advantage_estimator(name)).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == VERL_SIGNATURES[name]


@pytest.mark.parametrize("name", sorted(VERL_DEFAULTS))
def test_defaults_follow_verl(name):
    params = inspect.signature(R.get_advantage_estimator(name)).parameters
    for arg, default in VERL_DEFAULTS[name].items():
        assert params[arg].default == default, (name, arg)


def test_registry_returns_the_plain_functions():
    assert R.get_advantage_estimator("grpo") is R.compute_grpo_outcome_advantage
    assert R.get_advantage_estimator("grpo_vectorized") is R.compute_grpo_outcome_advantage
    assert R.get_advantage_estimator("rloo_vectorized") is R.compute_rloo_outcome_advantage
    assert R.get_advantage_estimator("remax") is R.compute_remax_outcome_advantage


def test_enum_members_are_accepted():
    class AdvantageEstimator(str, enum.Enum):
        GRPO = "grpo"

    assert R.get_advantage_estimator(AdvantageEstimator.GRPO) is R.compute_grpo_outcome_advantage


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="advantage estimator") as info:
        R.get_advantage_estimator("grpoo")
    for name in ("gae", "grpo", "rloo", "tir_optimal_token_baseline"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="advantage estimator"):
        R.get_advantage_estimator(3)


def test_register_custom_estimator_and_duplicates():
    def my_estimator(token_level_rewards, response_mask):
        adv = torch.where(response_mask.bool(), token_level_rewards, 0)
        return adv, adv

    try:
        assert R.register_advantage_estimator("test_custom")(my_estimator) is my_estimator
        assert R.get_advantage_estimator("test_custom") is my_estimator
        # Re-registering the same function is a no-op; a different one needs override.
        R.register_advantage_estimator("test_custom")(my_estimator)
        with pytest.raises(ValueError, match="test_custom"):
            R.register_advantage_estimator("test_custom")(lambda *a: a)
        with pytest.raises(ValueError, match="grpo"):
            R.register_advantage_estimator("grpo")(my_estimator)
        other = R.register_advantage_estimator("test_custom", override=True)(lambda *a: a)
        assert R.get_advantage_estimator("test_custom") is other
    finally:
        registry._REGISTRY.pop("test_custom", None)
    with pytest.raises(TypeError, match="name"):
        R.register_advantage_estimator("")
    with pytest.raises(TypeError, match="callable"):
        R.register_advantage_estimator("test_not_callable")(42)
