"""``rlmath.compat.verl.install()`` inside verl's trainer code: stock against patched.

Each side runs in its own fresh subprocess, stock or patched, so the patch can
leak neither into the other side nor into the differential tests of this
session (which compare rlmath with the *original* verl).

``ray_trainer.compute_advantage`` (``verl_advantage_run.py``) is called for
every advantage estimator verl 0.9.1 registers, enumerated at run time from
its ``AdvantageEstimator`` enum and ``ADV_ESTIMATOR_REGISTRY``. verl's actor
and critic workers (``verl_worker_run.py``) compute old log-probs, entropy and
values and do one ``update_actor`` / ``update_critic`` step on CPU; their
tolerances are derived before their tests below.

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

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers.peer_helpers import import_verl

import_verl("verl.trainer.ppo.core_algos")
# What verl's ray_trainer and workers import beyond its math modules; a .venv-peers built
# before setup_peers_env.sh installed them lacks them.
for _module in ("torchdata", "tqdm", "uvicorn", "fastapi", "dill", "peft", "PIL", "cachetools"):
    pytest.importorskip(
        _module,
        reason=f"verl's trainer and workers import {_module}: rebuild .venv-peers "
        "(rm -rf .venv-peers && bash tests/peers/setup_peers_env.sh)",
    )

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
U = 2.0**-24  # fp32 unit roundoff


def _run(module: str, out: Path, *args: str, timeout: int = 600) -> dict:
    cmd = [sys.executable, "-m", f"tests.peers.{module}", *args, str(out)]
    # This checkout's rlmath first (whichever rlmath the environment installed), and
    # the repository root for the runner modules under tests/.
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
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


# --------------------------------------------------------------------------- actor and critic
#
# verl 0.9.1's workers (``verl_worker_run.py``): a ``TrainingWorker`` on the FSDP2 engine
# for the actor and one for the critic, on CPU in fp32, driven as ``RayPPOTrainer`` drives
# them for one step, with ``use_remove_padding`` False and True.
#
# Tolerances. Both sides run the same model on the same weights; only rlmath's functions
# (log-probs, entropy, the policy and value losses and their aggregation) round differently.
# With u = 2**-24 (fp32's unit roundoff) and N the valid response tokens of the batch:
# - a log-prob ``z_y - logsumexp(z)`` and an entropy ``logsumexp(z) - sum p z`` are a few
#   roundings of quantities bounded by ``|value| + log V``: 2**4 u (|value| + log V);
# - a metric is a token mean of per-token terms bounded by S (|A| (1 + eps_high) for the
#   policy loss, log V for the entropy, the log-ratio for the KL, the k3 term for the KL
#   loss, (|v| + |R| + clip)^2 for the value loss): recursive summation errs by at most
#   N u S per side, doubled;
# - a clip fraction (one per micro-batch, or their mean) may differ by one token whose ratio
#   is within rounding of 1 +- eps: at most 1 / (the shortest response), a micro-batch
#   holding at least one response;
# - a gradient is the same backward pass applied to per-token loss gradients that differ by
#   a few roundings: per tensor 2 N u max|g|; ``grad_norm`` then differs by at most the norm
#   of the gradient differences, 2 N u |g|;
# - the update is AdamW's first step, theta - lr (g / (|g| + eps) + wd theta): a parameter
#   differs by lr |f(g) - f(g')| with f(g) = g / (|g| + eps), evaluated on the two sides'
#   gradients, plus a few roundings of |theta| + lr. Near g = 0 that step is steep (a
#   gradient of 1e-8 moves a weight by lr / 2), so the bound is computed per element.
# The critic's forward pass uses no rlmath function: its values must be bitwise equal.


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("verl_workers")
    stock = _run("verl_worker_run", tmp / "stock.pt")
    patched = _run("verl_worker_run", tmp / "patched.pt", "--patched")
    return stock, patched


SETTINGS = ["remove_padding=False", "remove_padding=True"]
NON_MATH = ("perf/", "mfu")  # memory and throughput: differ between any two runs


def test_worker_math_is_rlmath_only_when_patched(workers):
    stock, patched = workers
    assert stock["installed"] == [] and patched["installed"]
    for name, module in stock["used"].items():
        assert module.startswith("verl."), name
    for name, module in patched["used"].items():
        assert module.startswith("rlmath.compat.verl."), name


@pytest.mark.parametrize("setting", SETTINGS)
def test_old_log_probs_entropy_and_values(workers, setting):
    stock, patched = (side["results"][setting] for side in workers)
    mask = stock["response_mask"]
    assert torch.equal(mask, patched["response_mask"])
    log_v = math.log(workers[0]["vocab"])
    for key in ("old_log_probs", "entropys"):
        theirs, ours = stock[key], patched[key]
        assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape, key
        tol = 2**4 * U * (theirs.abs() + log_v)
        assert torch.all((ours - theirs).abs()[mask] <= tol[mask]), (key, setting)
        assert torch.equal(ours[~mask], theirs[~mask]), key  # verl's padding, untouched
    assert torch.equal(patched["values"], stock["values"]), setting


def _metric_scales(run: dict, meta: dict) -> dict[str, float]:
    """The bound S on the per-token terms each metric averages (see the tolerances above)."""
    adv = float(run["inputs"]["advantages"].abs().max())
    returns = float(run["inputs"]["returns"].abs().max())
    values = float(run["values"].abs().max())
    log_v = math.log(meta["vocab"])
    value = (values + returns + meta["cliprange_value"]) ** 2
    # The update's first forward uses the weights the old log-probs came from: the log-ratio
    # to the behaviour policy is its shift, and the reference's k3 term exp(d) - d - 1 is
    # bounded by exp(|d|) + |d| + 1 with d the reference's shift.
    shift = float((run["inputs"]["old_log_probs"] - run["old_log_probs"]).abs().max())
    ref = float((run["inputs"]["ref_log_prob"] - run["old_log_probs"]).abs().max())
    kl = math.exp(ref) + ref + 1
    pg = adv * (1 + meta["clip_ratio_high"])
    policy = pg + meta["entropy_coeff"] * log_v + meta["kl_loss_coef"] * kl
    return {
        "actor/pg_loss": pg, "actor/entropy_loss": log_v, "actor/ppo_kl": shift,
        "actor/kl_loss": kl, "actor/loss": policy, "critic/vf_loss": value,
        "critic/loss": value, "critic/vpred_mean": values,
    }  # fmt: skip


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_update_metrics(workers, setting, role):
    stock, patched = (side["results"][setting] for side in workers)
    theirs, ours = stock[f"{role}_metrics"], patched[f"{role}_metrics"]
    assert list(ours) == list(theirs), "metric keys differ"
    n = int(stock["response_mask"].sum())
    shortest = int(stock["response_mask"].sum(-1).min())
    scales = _metric_scales(stock, workers[0])
    for key, want in theirs.items():
        got = ours[key]
        assert got["type"] == want["type"], key
        assert len(got["value"]) == len(want["value"]), key
        if key.startswith(NON_MATH):
            continue
        for a, b in zip(got["value"], want["value"], strict=True):
            if key in ("lr", "kl_coef"):  # configuration, passed through
                assert a == b, key
            elif "clipfrac" in key:
                assert abs(a - b) <= 1.0 / shortest, key
            elif key == "grad_norm":
                assert abs(a - b) <= 2 * n * U * abs(b), (key, a, b)
            else:
                scale = scales[key if "/" in key else f"{role}/{key}"]
                tol = 2 * n * U * scale
                assert abs(a - b) <= tol, (key, a, b, tol)


def _adam_first_step(g: torch.Tensor, eps: float) -> torch.Tensor:
    return g / (g.abs() + eps)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_gradients_and_updated_parameters(workers, setting, role):
    stock, patched = (side["results"][setting] for side in workers)
    n = int(stock["response_mask"].sum())
    optim = stock["optimizer"][role]
    assert stock["optimizer"] == patched["optimizer"] and stock["optimizer"]["name"] == "AdamW"
    g_theirs, g_ours = stock[f"{role}_grads"], patched[f"{role}_grads"]
    assert sorted(g_ours) == sorted(g_theirs) == sorted(stock[f"{role}_params"])
    assert any(float(g.abs().max()) > 0 for g in g_theirs.values()), "no gradient reached"
    lr, eps, wd = optim["lr"], optim["eps"], optim["weight_decay"]
    for name, theirs in g_theirs.items():
        ours = g_ours[name]
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.float32, name
        tol = 2 * n * U * float(theirs.abs().max())
        assert float((ours - theirs).abs().max()) <= tol, (name, setting)
        before = stock[f"{role}_params_before"][name]
        assert torch.equal(before, patched[f"{role}_params_before"][name]), name
        p_theirs, p_ours = stock[f"{role}_params"][name], patched[f"{role}_params"][name]
        step = (_adam_first_step(ours, eps) - _adam_first_step(theirs, eps)).abs()
        p_tol = lr * step + 2**3 * U * (p_theirs.abs() * (1 + lr * wd) + lr)
        assert torch.all((p_ours - p_theirs).abs() <= p_tol), (name, setting)
    before = stock[f"{role}_params_before"]
    moved = [k for k, p in stock[f"{role}_params"].items() if not torch.equal(p, before[k])]
    assert moved, "the update changed no parameter"


def test_the_cpu_harness_packs_sequences_as_verl_pads_them(workers):
    # A check of the runner, not of rlmath: stock verl's remove-padding path (sequences packed
    # into one row, sdpa attention told apart by position ids) gives the padded path's
    # log-probs and entropy. Only the hidden states' rounding differs (matmuls of other
    # shapes, sums of a few dozen terms per layer): 2**6 u (|value| + log V).
    padded, packed = (workers[0]["results"][s] for s in SETTINGS)
    mask = padded["response_mask"]
    log_v = math.log(workers[0]["vocab"])
    for key in ("old_log_probs", "entropys"):
        tol = 2**6 * U * (padded[key].abs() + log_v)
        assert torch.all((packed[key] - padded[key]).abs()[mask] <= tol[mask]), key


# --------------------------------------------------------------------------- bf16
#
# The same step under verl's default mixed precision (``--bf16``: fp32 master weights, bf16
# forward under autocast), stock and patched, against the fp32 stock run above as the
# reference. Two sources of error add up in a bf16 log-prob: the model's bf16 forward pass
# (its logits), which rlmath does not touch, and the log-softmax of those logits. The
# runner records the logits each log-prob and entropy call received and a float64
# log-softmax of them, which separates the two:
# - the logits are bitwise equal stock and patched (the model part is the same);
# - rlmath's log-softmax of bf16 logits is computed in fp32: within 2**4 u (|value| + log V)
#   of the float64 one, as in fp32 above; verl's runs in bf16 on a CPU and is further off;
# - so the whole log-prob and entropy, and the entropy the update reports, are closer to the
#   fp32 reference patched than stock.
# On CUDA, autocast runs ``log_softmax`` in fp32 and verl's log-softmax part is then as
# accurate as rlmath's; the model part is the same on both sides either way.


@pytest.fixture(scope="module")
def workers_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("verl_workers_bf16")
    stock = _run("verl_worker_run", tmp / "stock.pt", "--bf16")
    patched = _run("verl_worker_run", tmp / "patched.pt", "--patched", "--bf16")
    assert stock["bf16"] and patched["bf16"]
    return stock, patched


@pytest.mark.parametrize("setting", SETTINGS)
def test_bf16_log_softmax_part(workers_bf16, setting):
    stock, patched = (side["results"][setting] for side in workers_bf16)
    log_v = math.log(workers_bf16[0]["vocab"])
    for kind in ("log_probs", "entropy"):
        theirs, ours = stock["log_softmax_calls"][kind], patched["log_softmax_calls"][kind]
        assert theirs and len(ours) == len(theirs), kind
        for call_theirs, call_ours in zip(theirs, ours, strict=True):
            assert call_ours["logits"].dtype == torch.bfloat16, kind
            assert torch.equal(call_ours["logits"], call_theirs["logits"]), kind
            ref = call_ours["ref"]
            ours_err = (call_ours["out"] - ref).abs()
            assert torch.all(ours_err <= 2**4 * U * (ref.abs() + log_v)), kind
            theirs_err = (call_theirs["out"] - call_theirs["ref"]).abs()
            assert float(ours_err.max()) < float(theirs_err.max()), kind


@pytest.mark.parametrize("setting", SETTINGS)
def test_bf16_log_probs_and_entropy_closer_to_fp32(workers, workers_bf16, setting):
    reference = workers[0]["results"][setting]  # stock verl in fp32
    stock, patched = (side["results"][setting] for side in workers_bf16)
    mask = reference["response_mask"]
    for key in ("old_log_probs", "entropys"):
        theirs = (stock[key] - reference[key]).abs()[mask]
        ours = (patched[key] - reference[key]).abs()[mask]
        assert float(ours.max()) < float(theirs.max()), key
        assert float(ours.mean()) < float(theirs.mean()), key
    assert torch.equal(patched["values"], stock["values"])  # no rlmath function in the critic


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_bf16_update_metrics(workers, workers_bf16, setting, role):
    stock, patched = (side["results"][setting] for side in workers_bf16)
    theirs, ours = stock[f"{role}_metrics"], patched[f"{role}_metrics"]
    assert list(ours) == list(theirs), "metric keys differ"
    for key, want in theirs.items():
        assert ours[key]["type"] == want["type"], key
        assert all(math.isfinite(v) for v in ours[key]["value"]), key
    if role == "actor":
        reference = workers[0]["results"][setting]["actor_metrics"]["actor/entropy_loss"]["value"]
        want = theirs["actor/entropy_loss"]["value"]
        got = ours["actor/entropy_loss"]["value"]
        for r, a, b in zip(reference, got, want, strict=True):
            assert abs(a - r) < abs(b - r), (a, b, r)
