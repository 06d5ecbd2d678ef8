"""Call verl's ``ray_trainer.compute_advantage`` for every advantage estimator verl registers.

Run by ``test_compat_verl_workers.py`` in a fresh process per side, stock or
patched by ``rlmath.compat.verl.install()``, so the patch cannot leak into the
other side. One batch, built here from a seed, holds every input some
estimator reads (values for GAE, ``reward_baselines`` for ReMax,
``sum_pi_squared`` and ``old_log_probs`` for the optimal-token baselines, two
reward components for GDPO); the returned ``DataProto``'s tensors are saved.

    python -m tests.peers.verl_advantage_run [--patched] OUT.pt
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

B, PROMPT, T = 16, 4, 8  # sequences (4 groups of 4), prompt and response tokens
GDPO_KEYS = ["format_reward", "accuracy_reward"]


def build_batch(seed: int, estimator: str) -> Any:
    import numpy as np
    import torch
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    # Groups of equal size, shuffled (not contiguous), as the rollout's `uid`s are.
    uid = np.array([f"prompt-{i % 4}" for i in range(B)], dtype=object)
    uid = uid[torch.randperm(B, generator=gen).numpy()]
    # Outcome rewards on each response's last valid token, as verl's reward managers write them.
    outcome = torch.randint(0, 3, (B,), generator=gen).float() - torch.rand(B, generator=gen)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = outcome
    attention = torch.cat([torch.ones(B, PROMPT), mask], dim=1).long()
    old_log_probs = -torch.rand(B, T, generator=gen) * 3
    batch = {
        "prompts": torch.randint(0, 100, (B, PROMPT), generator=gen),
        "responses": torch.randint(0, 100, (B, T), generator=gen),
        "attention_mask": attention,
        "response_mask": mask,
        "token_level_rewards": rewards,
        "values": torch.randn(B, T, generator=gen) * mask,
        "old_log_probs": old_log_probs,
        # sum_v pi_v^2 is at least pi_token^2 and at most 1.
        "sum_pi_squared": torch.exp(2 * old_log_probs)
        + torch.rand(B, T, generator=gen) * (1 - torch.exp(2 * old_log_probs)),
    }
    if estimator == "remax":
        # verl's trainer adds the greedy rollout's reward for ReMax only; compute_advantage
        # passes it to any estimator when present, and not every estimator accepts it.
        batch["reward_baselines"] = torch.rand(B, generator=gen)
    non_tensor = {"uid": uid}
    for key in GDPO_KEYS:
        non_tensor[key] = torch.randint(0, 2, (B,), generator=gen).float().numpy()
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--patched", action="store_true")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore")

    import torch

    torch.set_num_threads(1)
    installed: dict[str, Any] = {}
    if opts.patched:
        import rlmath.compat.verl

        installed = rlmath.compat.verl.install()
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos, ray_trainer

    # Every estimator verl knows: its enum and its registry (a name registered by a plugin
    # without an enum member is called by its string, as verl's trainer does).
    names = sorted(
        {e.value for e in core_algos.AdvantageEstimator} | set(core_algos.ADV_ESTIMATOR_REGISTRY)
    )
    results: dict[str, Any] = {}
    for name in names:
        for gamma, lam, norm in ((1.0, 1.0, True), (0.9, 0.8, False)):
            config = AlgoConfig(
                adv_estimator=name, gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm,
                gdpo_reward_keys=GDPO_KEYS, gdpo_reward_weights=[1.0, 0.5],
            )  # fmt: skip
            estimator: Any = name
            if name in {e.value for e in core_algos.AdvantageEstimator}:
                estimator = core_algos.AdvantageEstimator(name)
            data = build_batch(len(results), name)
            inputs = {key: value.clone() for key, value in data.batch.items()}
            out = ray_trainer.compute_advantage(
                data, estimator, gamma=gamma, lam=lam, num_repeat=1,
                norm_adv_by_std_in_grpo=norm, config=config,
            )  # fmt: skip
            results[f"{name}:gamma={gamma},lam={lam},norm={norm}"] = {
                "tensors": {key: value.detach().clone() for key, value in out.batch.items()},
                "non_tensor_keys": sorted(out.non_tensor_batch),
                "inputs": inputs,
            }
    used = {
        "gae": core_algos.compute_gae_advantage_return.__module__,
        "grpo": core_algos.compute_grpo_outcome_advantage.__module__,
        "registry": sorted({fn.__module__ for fn in core_algos.ADV_ESTIMATOR_REGISTRY.values()}),
    }
    torch.save({"installed": sorted(installed), "used": used, "results": results}, opts.out)


if __name__ == "__main__":
    sys.exit(main())
