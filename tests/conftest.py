"""Shared test settings: hypothesis profiles and deterministic torch.

Profiles (``HYPOTHESIS_PROFILE`` picks one):

* ``default``: random examples (a new seed each run), 40 per test; locally a
  failure is stored in ``.hypothesis/`` (git-ignored) and replayed first.
* ``ci``: the same 40 examples on every run (``derandomize=True``) and no
  example database, so nothing replays from an earlier run: CI results are
  reproducible. Chosen automatically when the ``CI`` environment variable is
  set (as CI services do), unless ``HYPOTHESIS_PROFILE`` names another one.
* ``thorough``: 400 random examples per test.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# ``derandomize`` is explicit: Hypothesis itself derandomizes its defaults when it
# detects a CI service, and ``default`` must stay random wherever it is chosen.
settings.register_profile(
    "default",
    derandomize=False,
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci", parent=settings.get_profile("default"), derandomize=True, database=None
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=400)


def _profile() -> str:
    if os.environ.get("HYPOTHESIS_PROFILE"):
        return os.environ["HYPOTHESIS_PROFILE"]
    return "ci" if os.environ.get("CI") else "default"


settings.load_profile(_profile())

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(params=["blas", "onednn"])
def matmul_library(request, monkeypatch):
    """Run the test with the fused head's fp32 CPU matmuls in torch's BLAS, then in oneDNN.

    Whichever this machine would pick (:mod:`rlmath.engine.torch_backend.cpu_matmul`),
    both paths are tested; oneDNN is skipped where this torch build lacks it.
    """
    from rlmath.engine.torch_backend import cpu_matmul

    if request.param == "onednn" and not cpu_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setattr(cpu_matmul, "_machine_choice", lambda: request.param == "onednn")
    return request.param
