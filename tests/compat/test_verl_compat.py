"""rlmath.compat.verl without verl: float64 references, config forms, errors, no host sync.

These run in the main environment (verl absent); the comparisons with verl
itself are in ``tests/peers/test_compat_verl_functions.py``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import rlmath
import rlmath.compat.verl as cv
from tests.host_sync import forbid_host_reads


def inputs(seed=0, b=5, t=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    mask[3] = False
    return old.to(dtype), logp.to(dtype), adv.to(dtype), mask


def ppo_reference(old, logp, adv, mask, lo, hi, c, denom, scale=1.0):
    """Per-token PPO clip with dual clip, summed over valid tokens / denom (fp64 loop)."""
    total = 0.0
    b, t = mask.shape
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            r = torch.exp(logp[i, j] - old[i, j])
            a = adv[i, j]
            loss = torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))
            if a < 0:
                loss = torch.minimum(loss, -a * c)
            total = total + loss
    return total / denom * scale


CONFIGS = {
    "dict": lambda **kw: {"clip_ratio": 0.2, **kw},
    "namespace": lambda **kw: SimpleNamespace(
        **{"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None, **kw}
    ),
}


@pytest.mark.parametrize("form", list(CONFIGS))
def test_vanilla_matches_a_float64_reference(form):
    old, logp, adv, mask = inputs(1)
    lp = logp.clone().requires_grad_(True)
    cfg = CONFIGS[form](clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=2.5)
    loss, metrics = cv.compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", cfg)
    lr = logp.clone().requires_grad_(True)
    ref = ppo_reference(old, lr, adv, mask, 0.1, 0.3, 2.5, mask.sum())
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(lp.grad, lr.grad, rtol=1e-12, atol=1e-12)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert all(type(v) is float for v in metrics.values())  # verl's type
    ppo_kl = (old - logp)[mask].mean()
    assert metrics["actor/ppo_kl"] == pytest.approx(float(ppo_kl), rel=1e-12, abs=1e-12)


def test_global_batch_info_scales_like_verl():
    old, logp, adv, mask = inputs(2)
    info = {
        "dp_size": 4,
        "batch_num_tokens": 100,
        "global_batch_size": 20,
        "loss_scale_factor": None,
    }
    cfg = {"clip_ratio": 0.2, "global_batch_info": info}
    loss, _ = cv.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg)
    ref = ppo_reference(old, logp, adv, mask, 0.2, 0.2, 3.0, 100, scale=4)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="unknown keys"):
        cv.compute_policy_loss_vanilla(
            old, logp, adv, mask, "token-mean", {"global_batch_info": {"dp": 2}}
        )
    with pytest.raises(TypeError, match="algorithm config"):
        cv.compute_policy_loss_vanilla(
            old, logp, adv, mask, "token-mean", {"adv_estimator": "grpo"}
        )


@pytest.mark.parametrize(
    "mode",
    [
        "token-mean",
        "token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ],
)
def test_agg_loss_reference(mode):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[2] = False
    n = mask.sum(-1)
    s = (x * mask).sum(-1)
    seqs = n > 0
    ref = {
        "token-mean": (x * mask).sum() / mask.sum(),
        "token-sum": (x * mask).sum(),
        "seq-mean-token-mean": (s[seqs] / n[seqs]).sum() / seqs.sum(),
        "seq-mean-token-sum": s.sum() / seqs.sum(),
        "seq-mean-token-sum-norm": s.sum() / seqs.sum() / 6,  # verl's fallback: the padded width
    }[mode]
    torch.testing.assert_close(cv.agg_loss(x, mask, mode), ref, rtol=1e-12, atol=1e-12)
    glob = cv.agg_loss(x, mask, mode, 2, 30, 9, 5)
    scaled = {
        "token-mean": (x * mask).sum() / 30 * 2,
        "token-sum": (x * mask).sum() * 2,
        "seq-mean-token-mean": (s[seqs] / n[seqs]).sum() / 9 * 2,
        "seq-mean-token-sum": s.sum() / 9 * 2,
        "seq-mean-token-sum-norm": s.sum() / 9 * 2 / 5,
    }[mode]
    torch.testing.assert_close(glob, scaled, rtol=1e-12, atol=1e-12)


def test_argument_errors():
    x, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(TypeError, match="dp_size"):
        cv.agg_loss(x, mask, "token-mean", True)
    with pytest.raises(TypeError, match="loss_agg_mode"):
        cv.agg_loss(x, mask, None)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        cv.agg_loss(x, mask, "mean")
    with pytest.raises(TypeError, match="batch_num_tokens"):
        cv.agg_loss(x, mask, "token-mean", 1, "12")
    with pytest.raises(ValueError, match="base estimator"):
        cv.kl_penalty_forward(x, x, "k3+")
    with pytest.raises(ValueError, match="cliprange"):
        cv.compute_policy_loss(x, x, x, mask)
    with pytest.raises(ValueError, match="dro_beta"):
        cv.compute_policy_loss_dro(x, x, x, mask, "token-mean", {"policy_loss": {"dro_beta": -1}})
    with pytest.raises(ValueError, match="rollout_correction"):
        cv.compute_policy_loss_bypass_mode(x, x, x, mask, "token-mean", {"policy_loss": {}})


def test_estimators_read_the_config_duck_typed():
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.bool)
    for cfg in ({"gamma": 0.5}, SimpleNamespace(gamma=0.5)):
        ours = cv.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=cfg)
        pure = rlmath.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
        for o, p in zip(ours, pure):
            torch.testing.assert_close(o, p)
    index = ["a", "a", "b", "b", "c", "c"]
    plain = cv.compute_grpo_passk_outcome_advantage(rewards, mask, index, 1e-6, False)
    read = cv.compute_grpo_passk_outcome_advantage(
        rewards, mask, index, 1e-6, True, {"norm_adv_by_std_in_grpo": False}
    )
    torch.testing.assert_close(plain[0], read[0])
    default = cv.compute_grpo_passk_outcome_advantage(rewards, mask, index, 1e-6, False, {})
    assert not torch.allclose(default[0], plain[0])  # the config's default (True) wins, as in verl


VERL_METRIC_KEYS = [
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_max",
    "rollout_corr/rollout_is_min",
    "rollout_corr/rollout_is_std",
    "rollout_corr/rollout_is_eff_sample_size",
    "rollout_corr/rollout_is_ratio_fraction_high",
    "rollout_corr/rollout_is_ratio_fraction_low",
    "rollout_corr/training_ppl",
    "rollout_corr/training_log_ppl",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/rollout_ppl",
    "rollout_corr/rollout_log_ppl",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min",
    "rollout_corr/ppl_ratio",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
]


def test_rollout_correction_weights_masks_and_metric_keys(monkeypatch):
    # Force the stand-in for verl's DataProto even where verl is installed.
    monkeypatch.setitem(sys.modules, "verl.protocol", None)
    old, rollout, _, mask = inputs(5)
    proto, kept, metrics = cv.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, "token", 1.5, False, "token_k1,seq_max_k2", "0.7_1.4,0.05"
    )
    assert isinstance(proto, cv.RolloutISWeights)
    w = proto.batch["rollout_is_weights"]
    ratio = torch.exp(old - rollout)
    torch.testing.assert_close(w, torch.where(mask, ratio.clamp(max=1.5), 0))
    ref = rlmath.rollout_rejection(
        old, rollout, mask, criteria={"token_k1": (0.7, 1.4), "seq_max_k2": 0.05}
    )
    assert torch.equal(kept, ref.response_mask)
    missing = [k for k in VERL_METRIC_KEYS if k not in metrics]
    assert not missing, missing  # verl's own completeness test returns instead of asserting
    for option in ("token_k1", "seq_max_k2"):
        assert f"rollout_corr/rollout_rs_{option}_mean" in metrics
    assert all(type(v) is float for v in metrics.values())  # verl's type
    # IcePop: weights out of [0.8, 1.25] are zeroed, the mask is returned unchanged.
    proto, kept, metrics = cv.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, "token", "0.8_1.25"
    )
    inside = (ratio >= 0.8) & (ratio <= 1.25)
    torch.testing.assert_close(
        proto.batch["rollout_is_weights"], torch.where(mask & inside, ratio, 0)
    )
    assert torch.equal(kept, mask) and kept is not mask
    oob = ((~inside) & mask).sum() / mask.sum()
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(float(oob), rel=1e-6)


def test_rollout_correction_batch_normalisation():
    old, rollout, _, mask = inputs(6)
    w, m = cv.compute_rollout_correction_weights(old - rollout, mask, "token", 3.0, True)
    torch.testing.assert_close(w[mask].mean(), torch.tensor(1.0, dtype=w.dtype))
    raw = torch.where(mask, torch.exp(old - rollout).clamp(max=3.0), 0)
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(float(raw[mask].mean()), rel=1e-12)
    w, _ = cv.compute_rollout_correction_weights(old - rollout, mask, "sequence", 50.0, True)
    seqs = mask.any(-1)
    per_seq = (w * mask).sum(-1)[seqs] / mask.sum(-1)[seqs]
    torch.testing.assert_close(per_seq.mean(), torch.tensor(1.0, dtype=w.dtype))


def test_compat_math_never_reads_the_host_and_modifies_no_input(monkeypatch):
    from rlmath.compat.verl import _state

    # verl's DataProto (used when verl is installed) reads the host itself: use the stand-in.
    monkeypatch.setitem(sys.modules, "verl.protocol", None)
    # Metrics as tensors (install(float_metrics=False)); verl's floats are host reads.
    monkeypatch.setattr(_state.OPTIONS, "float_metrics", False)
    old, logp, adv, mask = inputs(7, dtype=torch.float32)
    index = torch.tensor([0, 0, 1, 1, 2])
    rewards = torch.where(mask, adv, 0)
    copies = [x.clone() for x in (old, logp, adv, mask, rewards)]
    actor = {"clip_ratio": 0.2, "policy_loss": {"dro_beta": 0.1}}
    with forbid_host_reads():
        for name, fn in cv.core_algos.POLICY_LOSSES.items():
            if name in ("clip_cov", "kl_cov", "bypass_mode"):
                continue  # their token selection needs a count (documented in docs/losses.md)
            fn(old, logp, adv, mask, "seq-mean-token-mean", actor)
        cv.agg_loss(adv, mask, "token-mean")
        cv.compute_value_loss(logp, adv, old, mask, 0.2)
        cv.compute_gae_advantage_return(rewards, old, mask, 0.99, 0.95)
        for name in ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "gdpo"):
            cv.core_algos.ADV_ESTIMATORS[name](rewards, mask, index)
        cv.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.9})
        cv.compute_rollout_correction_and_rejection_mask(
            old, logp, mask, "sequence", "0.5_2.0", True, "token_k1,seq_mean_k3", "0.5_2.0,0.2"
        )
        cv.compute_offpolicy_metrics(old, logp, mask)
        cv.masked_whiten(adv, mask)
        cv.kl_penalty(logp, old, "k3+")
    for x, c in zip((old, logp, adv, mask, rewards), copies):
        assert torch.equal(x, c)


def test_float_metrics_option(monkeypatch):
    from rlmath.compat.verl import _state

    old, logp, adv, mask = inputs(8)
    assert _state.OPTIONS.float_metrics  # verl's types by default
    _, metrics = cv.compute_policy_loss_sapo(old, logp, adv, mask, "token-mean", {})
    assert all(type(v) is float for v in metrics.values())
    _, _, corr = cv.compute_rollout_correction_and_rejection_mask(old, logp, mask, "token")
    assert all(type(v) is float for v in corr.values())
    monkeypatch.setattr(_state.OPTIONS, "float_metrics", False)
    _, metrics = cv.compute_policy_loss_sapo(old, logp, adv, mask, "token-mean", {})
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())


def test_install_without_verl_raises_a_clear_importerror(monkeypatch):
    for name in ("verl", "verl.utils.torch_functional", "verl.trainer.ppo.core_algos"):
        monkeypatch.setitem(sys.modules, name, None)
    assert not cv.is_installed()
    with pytest.raises(ImportError, match=r"pip install verl==0\.9\.1"):
        cv.install()
    assert not cv.is_installed()
    assert cv.uninstall() == {}


def test_metrics_have_verls_types():
    """Python floats where verl 0.9.1 returns floats (its policy losses and rollout-correction
    helpers), tensors where it returns tensors (value loss, clip fraction, entropy loss)."""
    old, logp, adv, mask = inputs(9)
    rollout = old + 0.1 * torch.sin(torch.arange(old.numel(), dtype=old.dtype)).view(old.shape)
    correction = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1",
                  "rollout_rs_threshold": "0.5_2.0"}  # fmt: skip
    actor = {"clip_ratio": 0.2, "policy_loss": {"dro_beta": 0.1, "rollout_correction": correction}}
    for name, fn in cv.core_algos.POLICY_LOSSES.items():
        loss, metrics = fn(old, logp, adv, mask, "token-mean", actor)
        assert isinstance(loss, torch.Tensor), name
        assert all(type(v) is float for v in metrics.values()), (name, metrics)
        assert metrics or name == "gpg", name  # verl's GPG reports no metric either
    vf_loss, vf_clipfrac = cv.compute_value_loss(logp, adv, old, mask, 0.2)
    assert isinstance(vf_loss, torch.Tensor) and isinstance(vf_clipfrac, torch.Tensor)
    logits = torch.randn(*mask.shape, 7, dtype=torch.float64)
    assert isinstance(cv.compute_entropy_loss(logits, mask), torch.Tensor)
    log_ratio = old - rollout
    results = {
        "correction_and_rejection": cv.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, "sequence", "0.5_2.0", True, "token_k1,seq_max_k2", "0.6_1.5,0.1"
        )[2],
        "weights": cv.compute_rollout_correction_weights(log_ratio, mask, "token", 2.0, True)[1],
        "rejection": cv.compute_rollout_rejection_mask(log_ratio, mask, "seq_mean_k3", 0.1)[1],
        "offpolicy": cv.compute_offpolicy_metrics(old, rollout, mask),
        "from_logprobs": cv.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask),
    }
    for what, metrics in results.items():
        assert metrics and all(type(v) is float for v in metrics.values()), (what, metrics)
    assert isinstance(
        results["offpolicy"]["kl"], float
    )  # what verl's test_offpolicy_metrics asserts
