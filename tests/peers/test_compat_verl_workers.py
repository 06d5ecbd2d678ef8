"""``rlmath.compat.verl.install()`` inside verl's trainer code: stock against patched.

Each side runs in its own fresh subprocess, stock or patched, so the patch can
leak neither into the other side nor into the differential tests of this
session (which compare rlmath with the *original* verl).

``ray_trainer.compute_advantage`` (``verl_advantage_run.py``) is called for
every advantage estimator verl 0.9.1 registers, enumerated at run time from
its ``AdvantageEstimator`` enum and ``ADV_ESTIMATOR_REGISTRY``.

Tolerances (advantages). Both sides evaluate the same formulas in fp32; they
differ only in rounding and summation order. The largest reduction is a
whitening over the ``n`` valid tokens of the batch, ``a = (x - mu) / sigma``:
recursive summation of ``n`` terms errs by at most ``n u sum|x|`` (``u =
2**-24``, fp32's unit roundoff), so ``|d mu| <= n u max|x|`` and ``sigma``'s
relative error is at most ``(n/2 + 3) u``, giving ``|d a| <= n u (max|x| /
sigma + |a|) <= n u (2 max|a| + 1)`` for inputs whose mean is within one
standard deviation of 0, as here. Each side has that error: the bound is
doubled. A masked position is exactly 0 on the patched side
(``docs/design.md``, "Advantage estimators"); stock verl leaves GAE's whitened
advantage there non-zero, the one documented difference, so masked positions
are compared only where stock verl writes 0 too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers.peer_helpers import import_verl

import_verl("verl.trainer.ppo.core_algos")
pytest.importorskip(
    "torchdata", reason="verl.trainer.ppo.ray_trainer imports torchdata (setup_peers_env.sh)"
)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
U = 2.0**-24  # fp32 unit roundoff


def _run(module: str, out: Path, *args: str, timeout: int = 600) -> dict:
    cmd = [sys.executable, "-m", f"tests.peers.{module}", *args, str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


# --------------------------------------------------------------------------- compute_advantage


@pytest.fixture(scope="module")
def advantages(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("verl_advantage")
    stock = _run("verl_advantage_run", tmp / "stock.pt")
    patched = _run("verl_advantage_run", tmp / "patched.pt", "--patched")
    return stock, patched


def test_compute_advantage_is_rlmath_only_when_patched(advantages):
    stock, patched = advantages
    assert stock["installed"] == [] and patched["installed"]
    assert stock["used"] == {
        "gae": "verl.trainer.ppo.core_algos",
        "grpo": "verl.trainer.ppo.core_algos",
        "registry": ["verl.trainer.ppo.core_algos"],
    }
    assert patched["used"] == {
        "gae": "rlmath.compat.verl.core_algos",
        "grpo": "rlmath.compat.verl.core_algos",
        "registry": ["rlmath.compat.verl.core_algos"],
    }


def test_compute_advantage_covers_every_registered_estimator(advantages):
    stock, patched = advantages
    assert list(stock["results"]) == list(patched["results"])
    names = {key.split(":")[0] for key in stock["results"]}
    core_algos = import_verl("verl.trainer.ppo.core_algos")
    registered = {e.value for e in core_algos.AdvantageEstimator}
    assert names == registered | set(core_algos.ADV_ESTIMATOR_REGISTRY)


def test_compute_advantage_stock_vs_patched(advantages):
    stock, patched = advantages
    for case, want in stock["results"].items():
        got = patched["results"][case]
        assert sorted(got["tensors"]) == sorted(want["tensors"]), case
        assert got["non_tensor_keys"] == want["non_tensor_keys"], case
        mask = want["tensors"]["response_mask"].bool()
        for key, theirs in want["tensors"].items():
            ours = got["tensors"][key]
            where = f"{case}: {key}"
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
            if key in want["inputs"]:  # an input: untouched by both sides
                assert torch.equal(theirs, want["inputs"][key]), where
                assert torch.equal(ours, got["inputs"][key]), where
                assert torch.equal(ours, theirs), where
                continue
            assert key in ("advantages", "returns"), where
            n = int(mask.sum())
            tol = 2 * n * U * (2 * float(theirs[mask].abs().max()) + 1)
            diff = (ours - theirs).abs()
            assert float(diff[mask].max()) <= tol, (where, float(diff[mask].max()), tol)
            assert torch.all(ours[~mask] == 0), where
            if case.startswith("gae:") and key == "advantages":
                continue  # verl whitens GAE's masked positions too (documented above)
            assert torch.all(theirs[~mask] == 0), where
