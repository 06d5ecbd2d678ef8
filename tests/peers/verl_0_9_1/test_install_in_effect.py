"""Guard (not a verl test): the copied tests really call rlmath.compat.verl's functions.

The conftest calls ``install()`` before pytest imports the copied test files, so
the names they bound with ``from verl... import fn`` must be rlmath's.
"""

import sys

import verl.trainer.ppo.core_algos as core_algos
import verl.trainer.ppo.rollout_corr_helper as rollout_corr_helper
import verl.utils.torch_functional as torch_functional

import rlmath.compat.verl as compat_verl


def test_verl_modules_are_patched():
    assert compat_verl.is_installed()
    assert core_algos.agg_loss is compat_verl.agg_loss
    assert core_algos.get_policy_loss_fn("vanilla") is compat_verl.compute_policy_loss_vanilla
    assert core_algos.get_adv_estimator_fn("grpo") is compat_verl.compute_grpo_outcome_advantage
    assert torch_functional.masked_mean is compat_verl.masked_mean
    assert (
        rollout_corr_helper.compute_rollout_correction_and_rejection_mask
        is compat_verl.compute_rollout_correction_and_rejection_mask
    )


def test_copied_tests_bound_the_compat_functions():
    bound = {
        "test_core_algos_on_cpu": "compute_grpo_outcome_advantage",
        "test_value_loss_normalization_on_cpu": "compute_value_loss",
        "test_loss_aggregation_on_cpu": "agg_loss",
        "test_dynamic_policy_losses_on_cpu": "compute_policy_loss_dro",
        "test_reinforce_pp_multiturn_on_cpu": "compute_reinforce_plus_plus_outcome_advantage",
        "test_rollout_corr": "compute_rollout_correction_and_rejection_mask",
        "test_rollout_corr_integration": "compute_policy_loss_vanilla",
        "test_torch_functional": "calculate_sum_pi_squared_from_logits",
    }
    for module, name in bound.items():
        assert getattr(sys.modules[module], name) is getattr(compat_verl, name), (module, name)
