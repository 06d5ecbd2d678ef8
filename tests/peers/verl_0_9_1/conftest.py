"""Run verl 0.9.1's own unit tests against verl patched by ``rlmath.compat.verl.install()``.

The test files next to this conftest are verbatim copies of verl's (see
their header comments and ``tests/peers/README.md``). ``install()`` runs here,
when pytest imports this conftest, i.e. before any of those files executes
its ``from verl... import fn`` lines, so every verl math function they call is
rlmath's. The directory is excluded from the normal ``tests/peers`` session
(``collect_ignore`` in ``tests/peers/conftest.py``): patching verl there would
change what the other differential tests compare against. It runs in its own
process, started by ``tests/peers/test_compat_verl_suite.py``.

``EXPECTED_FAILURES`` lists, by test id, the tests that assert a behaviour
rlmath deliberately changes (each documented in ``docs/migration.md``); they
are marked ``xfail(strict=True)``, so an unexpected pass fails the run as
well as any new failure. ``NOT_RUN`` lists the tests skipped here, with why.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

#: RLMATH_COMPAT_FLOAT_METRICS=0 runs the suite under install(float_metrics=False) (tensor
#: metrics); the default install() gives verl's float metrics.
FLOAT_METRICS = os.environ.get("RLMATH_COMPAT_FLOAT_METRICS", "1") == "1"

if importlib.util.find_spec("verl") is None:  # pragma: no cover - only without verl
    collect_ignore_glob = ["*.py"]
else:
    import rlmath.compat.verl as compat_verl

    REPLACED = compat_verl.install(float_metrics=FLOAT_METRICS)

#: test id -> the documented difference it asserts.
EXPECTED_FAILURES: dict[str, str] = {}
if not FLOAT_METRICS:
    EXPECTED_FAILURES[
        "trainer/ppo/test_rollout_corr_integration.py::TestRolloutISIntegration::test_offpolicy_metrics"
    ] = (
        "asserts isinstance(metrics['kl'], float): under install(float_metrics=False) "
        "rlmath.compat.verl returns metrics as detached 0-d tensors (no host sync per call)"
    )

#: test id (or file) -> why it is not run here.
NOT_RUN: dict[str, str] = {
    "utils/test_torch_functional.py::test_distributed_mean_max_min_std": (
        "spawns 2 and 4 NCCL processes, one GPU each (verl runs it on a multi-GPU machine)"
    ),
    "utils/test_torch_functional.py::test_distributed_masked_mean": (
        "spawns 2 and 4 NCCL processes, one GPU each (verl runs it on a multi-GPU machine)"
    ),
}

#: files not collected here, with why (none: setup_peers_env.sh installs what
#: verl.trainer.ppo.ray_trainer imports, so its spec-decode metric tests run too).
NOT_COLLECTED: dict[str, str] = {}
collect_ignore = list(NOT_COLLECTED)


def _key(item: pytest.Item) -> str:
    return item.nodeid.split("verl_0_9_1/", 1)[-1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        key = _key(item)
        base = key.split("[", 1)[0]
        for skip_key, reason in NOT_RUN.items():
            if key == skip_key or base == skip_key:
                item.add_marker(pytest.mark.skip(reason=reason))
        reason = EXPECTED_FAILURES.get(key) or EXPECTED_FAILURES.get(base)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def pytest_report_header(config: pytest.Config) -> list[str]:
    if importlib.util.find_spec("verl") is None:
        return ["verl absent: nothing to run"]
    return [f"rlmath.compat.verl.install() replaced {len(REPLACED)} verl functions and entries"]
