"""verl 0.9.1's own unit tests, run against verl patched by ``rlmath.compat.verl.install()``.

The copies live in ``verl_0_9_1/`` (origin and license in each file's header;
``verl_0_9_1/conftest.py`` installs the patch and holds the expected-failure
list). They run in a subprocess so that the patch never leaks into the other
differential tests of this session, which compare rlmath with the *original*
verl. Green means: every copied test passes except the listed expected
failures, which must fail (strict xfail); a new failure, an unexpected pass
or a test that silently stops being collected turns this red.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers.peer_helpers import import_verl

import_verl("verl.trainer.ppo.core_algos")

import rlmath  # noqa: E402

SUITE = Path(__file__).parent / "verl_0_9_1"

# What the copied suite holds (verl 0.9.1 + the guard test_install_in_effect.py). A change
# here means a test stopped being collected or the expected-failure list changed. By default
# the metrics have verl's types and everything passes; under install(float_metrics=False)
# (tensor metrics) verl's test_offpolicy_metrics is the one expected failure.
EXPECTED_COUNTS = {
    False: {"passed": 160, "xfailed": 1, "skipped": 4},
    True: {"passed": 161, "xfailed": 0, "skipped": 4},
}


def _summary(output: str) -> dict[str, int]:
    last = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    assert last, output[-3000:]
    return {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", last[-1])}


@pytest.mark.parametrize("float_metrics", [True, False], ids=["float-metrics", "tensor-metrics"])
def test_verl_0_9_1_unit_tests_pass_with_rlmath_installed(float_metrics):
    env = dict(os.environ)
    env["RLMATH_COMPAT_FLOAT_METRICS"] = "1" if float_metrics else "0"
    # The subprocess must import the rlmath this session tests, not another install.
    src = str(Path(rlmath.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
        cwd=SUITE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    counts = _summary(output)
    assert counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0, output[-6000:]
    for kind, expected in EXPECTED_COUNTS[float_metrics].items():
        assert counts.get(kind, 0) == expected, (kind, counts, output[-3000:])
