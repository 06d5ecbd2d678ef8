"""``rlmath.compat.trl.install()`` inside TRL's real ``GRPOTrainer``: stock against patched.

Each side trains the same tiny Qwen2 model for four steps per loss type in its
own subprocess (``trl_trainer_run.py``), so the patch cannot leak into the
stock run or into the other peer tests. Runs in ``.venv-peers`` (TRL 0.24:
the log-prob functions are patched) and in ``.venv-peers-trl-new`` (TRL 1.16:
the fused LM head and ``GRPOTrainer._compute_loss``).

Tolerances. Both sides compute the same fp32 sums of the same per-token
terms; they differ only by rounding: a log-prob differs by a few ulp of
``|log p| + log V``, and after the first optimizer step the two models differ
by updates built from those differences, which Adam's per-element
normalisation can amplify over the four steps. ``2**8`` ulp of fp32 (3.1e-5)
relative bounds that (the largest difference measured is 1.1e-5, a
``grad_norm`` after two steps); a loss, a signed sum that can cancel to near
0, gets the same bound relative to the largest per-token term,
``max|A| · (1 + epsilon_high)`` with ``max|A| <= (G - 1)/sqrt(G)`` for
GRPO's group-normalised advantages (``G`` completions per prompt).
Generation-side metrics (rewards, lengths, token counts) must be equal: the
completions are sampled from identical weights on the first step, and a
sample would change only if a ulp moved a multinomial draw across a boundary.
Clip fractions may differ by one token, a ratio within a ulp of ``1 ± ε``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers.peer_helpers import SKIP_TRL

trl = pytest.importorskip("trl", reason=SKIP_TRL)
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs datasets")
pytest.importorskip("tokenizers", reason="the test builds a tokenizer with tokenizers")

ROOT = Path(__file__).resolve().parents[2]
NEW_TRL = int(trl.__version__.split(".")[0]) >= 1
RUNS = ["grpo", "dapo", "dr_grpo", "bnpo", "grpo:beta=0.04"]
if NEW_TRL:  # the loss is rlmath's there: every loss type, and the masks folded into it
    RUNS += [
        "cispo:epsilon_high=5.0", "sapo", "luspo:importance_sampling_level=sequence", "vespo",
        "grpo:importance_sampling_level=sequence", "grpo:beta=0.04,use_bias_correction_kl=false",
        "grpo:top_entropy_quantile=0.5", "dapo:off_policy_mask_threshold=0.02",
    ]  # fmt: skip

ULP = 2.0**-23
RTOL = 2**8 * ULP
G = 4  # trl_trainer_run.NUM_GENERATIONS
MAX_ADV = (G - 1) / math.sqrt(G)
GENERATION = ("num_tokens", "completions/", "rewards/", "reward", "frac_reward_zero_std", "epoch",
              "learning_rate")  # fmt: skip
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def _run(tmp: Path, patched: bool) -> dict:
    out = tmp / ("patched.json" if patched else "stock.json")
    cmd = [sys.executable, "-m", "tests.peers.trl_trainer_run", str(out), *RUNS]
    if patched:
        cmd.append("--patched")
    # This checkout's rlmath first (whichever rlmath the environment installed), and
    # the repository root for the runner modules under tests/.
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("trl_install")
    return _run(tmp, False), _run(tmp, True)


def test_the_patch_is_in_effect_and_only_in_the_patched_run(both):
    stock, patched = both
    assert stock["installed"] == [] and patched["installed"]
    if NEW_TRL:
        assert stock["used"]["add_fused_lm_head"] == "trl.trainer.utils"
        assert stock["used"]["_compute_loss"] == "trl.trainer.grpo_trainer"
        assert patched["used"]["add_fused_lm_head"] == "rlmath.compat._trl_install"
        assert patched["used"]["_compute_loss"] == "rlmath.compat._trl_install"
    else:
        assert stock["used"]["selective_log_softmax"] == "trl.trainer.utils"
        assert patched["used"]["selective_log_softmax"] == "rlmath.compat.trl"
        assert patched["used"]["entropy_from_logits"] == "rlmath.compat.trl"


def _scale(spec: str) -> float:
    eps_high = 5.0 if spec.startswith("cispo") else 0.28
    return MAX_ADV * (1 + eps_high)


@pytest.mark.parametrize("spec", RUNS)
def test_patched_trainer_logs_what_stock_trl_logs(both, spec):
    stock, patched = both[0]["runs"][spec], both[1]["runs"][spec]
    assert len(stock) == len(patched) == 5  # four steps and the summary
    tokens = 0.0
    for step, (ours, theirs) in enumerate(zip(patched, stock)):
        assert list(ours) == list(theirs), f"step {step}: metric keys differ"
        tokens = max(tokens, float(theirs.get("num_tokens", {}).get("value", tokens)))
        for key, want in theirs.items():
            got = ours[key]
            where = f"{spec}, step {step}, {key}"
            assert got["type"] == want["type"], where
            a, b = got["value"], want["value"]
            if key.startswith(TIMING):
                continue
            if key.startswith(GENERATION):
                assert a == b, where
            elif key in ("loss", "train_loss"):
                assert abs(a - b) <= RTOL * _scale(spec), where
            elif key.startswith(("clip_ratio", "cispo_clip_ratio")):
                assert abs(a - b) <= 1.0 / (G * 2 * 8) + RTOL, where  # one token of a batch
            else:  # grad_norm, entropy, kl
                assert a == pytest.approx(b, rel=RTOL, abs=RTOL), where
    assert tokens > 0


_INSTALL_ROUND_TRIP = r"""
import sys

import torch
import trl.trainer.utils as U
import rlmath.compat.trl as ct

new = sys.argv[1] == "1"
names = [n for n in ("selective_log_softmax", "entropy_from_logits",
                     "selective_log_softmax_and_entropy", "add_fused_lm_head") if hasattr(U, n)]
before = {n: getattr(U, n) for n in names}
if new:
    import trl.trainer.grpo_trainer as G

    loss_before, fused_before = G.GRPOTrainer._compute_loss, G.add_fused_lm_head
first = ct.install()
assert ct.install() == first and ct.is_installed()
assert first["trl.trainer.utils.selective_log_softmax"] is before["selective_log_softmax"]
assert U.selective_log_softmax is ct.selective_log_softmax
assert U.entropy_from_logits is ct.entropy_from_logits
if new:
    assert G.add_fused_lm_head is not fused_before and G.GRPOTrainer._compute_loss is not loss_before

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 37, generator=gen, dtype=torch.float64) * 3
    index = torch.randint(0, 37, (3, 5), generator=gen)
    row_mask = torch.rand(3, 5, generator=gen) > 0.3
    close = dict(rtol=1e-12, atol=1e-12)
    for t in (1.0, 0.7):
        # TRL's own combined function, called through the patched module, against the stock one.
        lp, ent = U.selective_log_softmax_and_entropy(logits, index, temperature=t, row_mask=row_mask)
        slp, sent = before["selective_log_softmax_and_entropy"](
            logits, index, temperature=t, row_mask=row_mask)
        assert torch.allclose(lp, slp, **close) and torch.allclose(ent, sent, **close)
        lp = U.selective_log_softmax(logits, index, temperature=t, row_mask=row_mask)
        slp = before["selective_log_softmax"](logits, index, temperature=t, row_mask=row_mask)
        assert torch.allclose(lp, slp, **close)
    topk = torch.randint(0, 37, (3, 5, 4), generator=gen)
    assert torch.allclose(U.selective_log_softmax(logits, topk),
                          before["selective_log_softmax"](logits, topk), **close)
ct.uninstall()
ct.uninstall()
assert not ct.is_installed()
assert all(getattr(U, n) is before[n] for n in names)
if new:
    assert G.GRPOTrainer._compute_loss is loss_before and G.add_fused_lm_head is fused_before
print("ok")
"""


def test_install_uninstall_round_trip_in_a_fresh_process():
    # This checkout's rlmath first (whichever rlmath the environment installed), and
    # the repository root for the runner modules under tests/.
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-c", _INSTALL_ROUND_TRIP, "1" if NEW_TRL else "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
