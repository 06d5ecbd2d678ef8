"""Differential tests of rlmath against its peers (verl 0.9.1, TRL 0.24).

The peers are heavy and never a dependency of rlmath: they live in
``.venv-peers`` (see README.md here and ``setup_peers_env.sh``). In any other
environment every module of this directory skips with a clear reason, because
each one starts with ``pytest.importorskip`` of the peer it compares against
(a skip raised from a conftest would be an error when this directory is the
argument of pytest, so the skip lives in the modules).
"""

from __future__ import annotations

import importlib.util

import pytest

# verl's own tests (copied in verl_0_9_1/) run against verl *patched* by
# rlmath.compat.verl.install(); patching inside this session would change what the
# other differential tests compare against, so they run in a subprocess started by
# test_compat_verl_suite.py and are never collected here.
collect_ignore = ["verl_0_9_1"]


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "absent"


def pytest_report_header(config: pytest.Config) -> list[str]:
    have_verl = importlib.util.find_spec("verl") is not None
    have_trl = importlib.util.find_spec("trl") is not None
    return [
        "peers: verl "
        + (_version("verl") if have_verl else "absent")
        + ", trl "
        + (_version("trl") if have_trl else "absent")
        + " (build .venv-peers with tests/peers/setup_peers_env.sh to run tests/peers)"
    ]


@pytest.fixture
def gen():
    """A seeded CPU generator: every random input here is reproducible."""
    import torch

    return torch.Generator().manual_seed(1234)
