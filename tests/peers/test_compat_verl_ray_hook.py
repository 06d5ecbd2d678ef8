"""The documented way to patch verl's Ray workers: ``worker_process_setup_hook``.

verl's trainer computes advantages and losses in Ray worker processes, which
do not share the driver's patched modules. Ray runs
``rlmath.compat.verl.install`` in every worker when it is given as the runtime
environment's ``worker_process_setup_hook`` (verl's CLI:
``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=rlmath.compat.verl.install``).
This starts a one-CPU local Ray in a subprocess (about 10 s) and checks what
a worker's verl computes with.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.peers.peer_helpers import import_verl

import_verl("verl.trainer.ppo.core_algos")
pytest.importorskip("ray", reason="ray is part of .venv-peers (verl imports it)")

import rlmath  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import os
    import ray

    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "worker_process_setup_hook": "rlmath.compat.verl.install",
            "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]},
        },
    )

    @ray.remote
    def probe():
        import torch
        import verl.trainer.ppo.core_algos as core_algos
        import verl.trainer.ppo.rollout_corr_helper as rollout_corr_helper

        import rlmath.compat.verl as compat

        loss_fn = core_algos.get_policy_loss_fn("vanilla")
        old = torch.tensor([[-1.0, -2.0, -0.5]])
        _, metrics = loss_fn(old, old + 0.1, torch.ones(1, 3), torch.ones(1, 3), "token-mean", {})
        return (
            compat.is_installed(),
            loss_fn is compat.compute_policy_loss_vanilla,
            core_algos.get_adv_estimator_fn("grpo") is compat.compute_grpo_outcome_advantage,
            rollout_corr_helper.compute_rollout_correction_and_rejection_mask.__module__,
            type(metrics["actor/ppo_kl"]).__name__,
        )

    print("RESULT", ray.get(probe.remote()))
    ray.shutdown()
    """
)


def test_ray_workers_compute_with_rlmath_through_the_setup_hook(tmp_path):
    env = dict(os.environ)
    src = str(Path(rlmath.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    assert line == (
        "RESULT (True, True, True, 'rlmath.compat.verl.rollout_corr_helper', 'float')"
    ), output[-4000:]
