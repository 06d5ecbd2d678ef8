"""rlmath.compat.verl against verl 0.9.1 itself, on random inputs.

Every compat function is called with verl's positional conventions and its
``config`` given as verl's dataclass, a plain dict and an OmegaConf
``DictConfig`` (verl itself always gets its dataclass), and compared with
verl's function on the same inputs: loss values, gradients, the metric key
sets and values, advantages, returns, masks and weights. Deliberate
differences (``docs/migration.md``) are asserted in the tests whose names end
in ``_documented_difference``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.peers.peer_helpers import assert_close, import_verl, randn, random_mask

verl_core = import_verl("verl.trainer.ppo.core_algos")
verl_tf = import_verl("verl.utils.torch_functional")
verl_rc = import_verl("verl.trainer.ppo.rollout_corr_helper")
verl_cfg = import_verl("verl.workers.config")
verl_algo = import_verl("verl.trainer.config")
verl_proto = import_verl("verl.protocol")
omegaconf = pytest.importorskip("omegaconf")

import rlmath  # noqa: E402
import rlmath.compat.verl as cv  # noqa: E402


def assert_verl_types(ours, theirs, what=""):
    """Same keys, and each value of the type verl gives (float, tensor, ...)."""
    assert set(ours) == set(theirs), (what, set(ours) ^ set(theirs))
    for key, value in theirs.items():
        assert type(ours[key]) is type(value), (what, key, type(ours[key]), type(value))


TOL = dict(rtol=2e-5, atol=2e-6)
FORMS = ["dataclass", "dict", "omegaconf"]
POLICY_FIELDS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "dro_beta",
)


def actor_config(form: str, **fields):
    """An actor config in one of the three forms (the dataclass with verl's required fields)."""
    policy = {k: fields.pop(k) for k in list(fields) if k in POLICY_FIELDS}
    if form == "dataclass":
        return verl_cfg.ActorConfig(
            strategy="fsdp",
            rollout_n=1,
            ppo_micro_batch_size_per_gpu=1,
            policy_loss=verl_cfg.PolicyLossConfig(**policy),
            **fields,
        )
    plain = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0,
        "tau_pos": 1.0,
        "tau_neg": 1.05,
        "policy_loss": {
            "clip_cov_ratio": 0.0002,
            "clip_cov_lb": 1.0,
            "clip_cov_ub": 5.0,
            "kl_cov_ratio": 0.0002,
            "ppo_kl_coef": 0.1,
            "dro_beta": None,
            **policy,
        },
        "global_batch_info": {},
        **fields,
    }
    return plain if form == "dict" else omegaconf.OmegaConf.create(plain)


def make_inputs(seed: int, *, b: int = 6, t: int = 10, spread: float = 0.3, empty_row=False):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, t, gen, layout="right", p_gap=0.2)
    if empty_row:
        mask[1] = False
    old = -torch.rand(b, t, generator=gen) * 3 - 0.05
    logp = (old + randn(b, t, gen=gen, scale=spread)).clamp(max=-1e-4)
    adv = randn(b, t, gen=gen)
    weights = torch.rand(b, t, generator=gen) + 0.5
    return old, logp, adv, mask, weights


def run(fn, old, logp, adv, mask, *rest):
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, adv, mask, *rest)
    loss.backward()
    return loss.detach(), lp.grad, metrics


# --------------------------------------------------------------------------- signatures


def _params(fn):
    if inspect.isclass(fn):
        fn = fn.__init__
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    "module, ours",
    [(verl_tf, cv.torch_functional), (verl_core, cv.core_algos), (verl_rc, cv.rollout_corr_helper)],
    ids=["torch_functional", "core_algos", "rollout_corr_helper"],
)
def test_every_compat_function_has_verls_exact_signature(module, ours):
    assert ours.VERL_NAMES
    for name in ours.VERL_NAMES:
        assert hasattr(module, name), name
        assert _params(getattr(ours, name)) == _params(getattr(module, name)), name


def test_registries_cover_verls_names():
    assert set(cv.core_algos.POLICY_LOSSES) == set(verl_core.POLICY_LOSS_REGISTRY)
    assert set(cv.core_algos.ADV_ESTIMATORS) == set(verl_core.ADV_ESTIMATOR_REGISTRY)
    for name, fn in cv.core_algos.ADV_ESTIMATORS.items():
        assert _params(fn) == _params(verl_core.ADV_ESTIMATOR_REGISTRY[name]), name


# --------------------------------------------------------------------------- aggregation, value


MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "global_kw",
    [{}, {"dp_size": 3, "batch_num_tokens": 40, "global_batch_size": 11, "loss_scale_factor": 7}],
    ids=["local", "global"],
)
def test_agg_loss(mode, global_kw):
    gen = torch.Generator().manual_seed(3)
    mask = random_mask(5, 9, gen, p_gap=0.3).float()
    mask[2] = 0
    x = randn(5, 9, gen=gen)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = cv.agg_loss(a, mask, mode, *global_kw.values())
    theirs = verl_core.agg_loss(b, mask, mode, **global_kw)
    assert_close(ours, theirs, **TOL)
    ours.backward()
    theirs.backward()
    assert_close(a.grad, b.grad, **TOL)


def test_agg_loss_norm_fallback_is_the_padded_width_as_in_verl():
    # rlmath.agg_loss requires norm_length; the compat layer applies verl's documented fallback.
    gen = torch.Generator().manual_seed(4)
    mask = random_mask(4, 12, gen)
    x = randn(4, 12, gen=gen)
    with pytest.raises(ValueError, match="norm_length"):
        rlmath.agg_loss(x, mask, loss_agg_mode="seq-mean-token-sum-norm")
    assert_close(
        cv.agg_loss(x, mask, "seq-mean-token-sum-norm"),
        verl_core.agg_loss(x, mask.float(), "seq-mean-token-sum-norm"),
        **TOL,
    )


def test_agg_loss_dp_without_counts_raises_with_verls_names():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        cv.agg_loss(torch.ones(2, 3), mask, "token-mean", 2)
    with pytest.raises(ValueError, match="global_batch_size"):
        cv.agg_loss(torch.ones(2, 3), mask, "seq-mean-token-mean", 2)


@pytest.mark.parametrize("mode", MODES[:1] + MODES[2:])
def test_value_loss(mode):
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(6, 8, gen).float()
    vpreds, values, returns = (randn(6, 8, gen=gen) for _ in range(3))
    kw = {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 12, "loss_scale_factor": 9}
    a, b = vpreds.clone().requires_grad_(True), vpreds.clone().requires_grad_(True)
    ours = cv.compute_value_loss(a, returns, values, mask, 0.3, mode, *kw.values())
    theirs = verl_core.compute_value_loss(b, returns, values, mask, 0.3, mode, **kw)
    assert [type(o) for o in ours] == [type(t) for t in theirs]
    for o, t in zip(ours, theirs):
        assert_close(o, t, **TOL)
    ours[0].backward()
    theirs[0].backward()
    assert_close(a.grad, b.grad, **TOL)


def test_entropy_loss_and_deprecated_policy_loss():
    gen = torch.Generator().manual_seed(6)
    logits = randn(3, 5, 17, gen=gen, scale=2)
    mask = random_mask(3, 5, gen).float()
    ours = cv.compute_entropy_loss(logits, mask, "seq-mean-token-mean")
    theirs = verl_core.compute_entropy_loss(logits, mask, "seq-mean-token-mean")
    assert type(ours) is type(theirs)
    assert_close(ours, theirs, **TOL)
    old, logp, adv, mask, _ = make_inputs(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = verl_core.compute_policy_loss(old, logp, adv, mask.float(), 0.2, 0.1, 0.3, 2.0)
    ours = cv.compute_policy_loss(old, logp, adv, mask, 0.2, 0.1, 0.3, 2.0)
    assert [type(o) for o in ours] == [type(t) for t in theirs]
    for o, t in zip(ours, theirs):
        assert_close(o, t, **TOL)


# --------------------------------------------------------------------------- policy losses

COMMON = {"clip_ratio": 0.2, "clip_ratio_low": 0.15, "clip_ratio_high": 0.28}
CASES = {
    "vanilla": {**COMMON, "clip_ratio_c": 2.0},
    "dppo_tv": {**COMMON, "clip_ratio_c": 1.5},
    "dppo_kl": {"clip_ratio": 0.05, "clip_ratio_low": 0.03, "clip_ratio_high": 0.06},
    "gspo": {"clip_ratio": 0.2, "clip_ratio_low": 0.003, "clip_ratio_high": 0.004},
    "sapo": {"tau_pos": 1.3, "tau_neg": 2.0},
    "gpg": {},
    "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5},
    "clip_cov": {**COMMON, "clip_cov_ratio": 1.0, "clip_cov_lb": -1.0, "clip_cov_ub": 0.3},
    "geo_mean": {**COMMON},
    "dro": {"dro_beta": 0.05},
    "cispo": {**COMMON},
}
# verl ignores loss_agg_mode for these two and always uses the sequence mean.
ONE_MODE = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
# verl's GMPO clip fractions count every clamped token whatever the advantage's sign.
# verl's GMPO also ignores global_batch_info (a plain mean over the local rows): not exact
# under data parallelism, so it is compared with local counts only.
SKIP_METRICS = {"geo_mean": {"actor/pg_clipfrac", "actor/pg_clipfrac_lower"}}
GLOBAL = {"dp_size": 2, "batch_num_tokens": 70, "global_batch_size": 13, "loss_scale_factor": 11}


@pytest.mark.parametrize(
    "name, global_info",
    [(n, g) for n in CASES for g in (False, True) if not (n == "geo_mean" and g)],
    ids=lambda v: {False: "local", True: "dp"}.get(v, v) if isinstance(v, bool) else v,
)
@pytest.mark.parametrize("form", FORMS)
def test_policy_losses_match_verl(name, form, global_info):
    old, logp, adv, mask, weights = make_inputs(7, spread=0.3 if name != "gspo" else 0.01)
    modes = [ONE_MODE[name]] if name in ONE_MODE else ["token-mean", "seq-mean-token-sum-norm"]
    fields = dict(CASES[name])
    if global_info:
        fields["global_batch_info"] = dict(GLOBAL)
    ours_cfg = actor_config(form, **dict(fields))
    theirs_cfg = actor_config("dataclass", **dict(fields))
    for mode in modes:
        for w in (None, weights):
            lo, go, mo = run(
                cv.core_algos.POLICY_LOSSES[name], old, logp, adv, mask, mode, ours_cfg, w
            )
            lt, gt, mt = run(
                verl_core.POLICY_LOSS_REGISTRY[name],
                old,
                logp,
                adv,
                mask.float(),
                mode,
                theirs_cfg,
                w,
            )
            assert_close(lo, lt, **TOL, msg=f"{name} {mode} loss")
            assert_close(go, gt, **TOL, msg=f"{name} {mode} grad")
            assert_verl_types(mo, mt, name)
            for key in set(mt) - SKIP_METRICS.get(name, set()):
                assert_close(mo[key], mt[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def test_policy_loss_metrics_are_floats_as_in_verl():
    old, logp, adv, mask, _ = make_inputs(8)
    cfg = actor_config("dataclass")
    _, mo = cv.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", cfg)
    _, mt = verl_core.compute_policy_loss_vanilla(old, logp, adv, mask.float(), "token-mean", cfg)
    assert mt and all(type(v) is float for v in mt.values())
    assert_verl_types(mo, mt)


def test_sapo_and_geo_mean_honour_loss_agg_mode_documented_difference():
    old, logp, adv, mask, _ = make_inputs(9)
    cfg = actor_config("dataclass")
    for name in ("sapo", "geo_mean"):
        ours, _ = cv.core_algos.POLICY_LOSSES[name](old, logp, adv, mask, "token-mean", cfg)
        theirs, _ = verl_core.POLICY_LOSS_REGISTRY[name](
            old, logp, adv, mask.float(), "token-mean", cfg
        )
        pure = getattr(rlmath, f"compute_policy_loss_{name}")(
            old, logp, adv, mask, loss_agg_mode="token-mean"
        )[0]
        assert_close(ours, pure, **TOL)
        assert not torch.allclose(ours, theirs, rtol=1e-3)


def test_geo_mean_data_parallel_scaling_documented_difference():
    # With dp_size = 2 and global counts, rlmath scales GMPO like every other loss (exact
    # under data parallelism); verl's GMPO returns the local row mean whatever the config says.
    old, logp, adv, mask, _ = make_inputs(9)
    cfg = actor_config("dataclass", global_batch_info=dict(GLOBAL))
    ours, _ = cv.compute_policy_loss_geo_mean(old, logp, adv, mask, "seq-mean-token-mean", cfg)
    theirs, _ = verl_core.compute_policy_loss_geo_mean(
        old, logp, adv, mask.float(), "seq-mean-token-mean", cfg
    )
    local, _ = verl_core.compute_policy_loss_geo_mean(
        old, logp, adv, mask.float(), "seq-mean-token-mean", actor_config("dataclass")
    )
    assert_close(theirs, local, rtol=0, atol=0)
    pure, _ = rlmath.compute_policy_loss_geo_mean(
        old, logp, adv, mask, loss_agg_mode="seq-mean-token-mean", dp_size=2, global_num_seqs=13
    )
    assert_close(ours, pure, **TOL)
    assert_close(ours, local * 2 * mask.any(-1).sum() / 13, **TOL)


def test_dro_requires_a_positive_beta():
    old, logp, adv, mask, _ = make_inputs(10)
    for form in FORMS:
        with pytest.raises(ValueError, match="dro_beta"):
            cv.compute_policy_loss_dro(old, logp, adv, mask, "token-mean", actor_config(form))


def test_algorithm_config_is_refused():
    old, logp, adv, mask, _ = make_inputs(11)
    with pytest.raises(TypeError, match="algorithm config"):
        cv.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", verl_algo.AlgoConfig())


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
@pytest.mark.parametrize("form", FORMS)
def test_bypass_mode(loss_type, form):
    old, logp, adv, mask, _ = make_inputs(12, spread=0.4)
    rc = {
        "loss_type": loss_type,
        "rollout_is": "token",
        "rollout_is_threshold": 1.5,
        "rollout_rs": "token_k1,seq_max_k3",
        "rollout_rs_threshold": "0.6_1.7,0.5",
    }
    theirs_cfg = verl_cfg.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=verl_cfg.PolicyLossConfig(
            rollout_correction=verl_algo.RolloutCorrectionConfig(**rc)
        ),
    )
    ours_cfg = theirs_cfg if form == "dataclass" else actor_config(form)
    if form == "dict":
        ours_cfg["policy_loss"]["rollout_correction"] = rc
    elif form == "omegaconf":
        ours_cfg = omegaconf.OmegaConf.merge(ours_cfg, {"policy_loss": {"rollout_correction": rc}})
    lo, go, mo = run(
        cv.compute_policy_loss_bypass_mode, old, logp, adv, mask, "token-mean", ours_cfg
    )
    lt, gt, mt = run(
        verl_core.compute_policy_loss_bypass_mode,
        old,
        logp,
        adv,
        mask.float(),
        "token-mean",
        theirs_cfg,
    )
    assert_close(lo, lt, **TOL)
    assert_close(go, gt, **TOL)
    assert_verl_types(mo, mt, "bypass_mode")
    for key in mt:
        assert_close(mo[key], mt[key], rtol=1e-4, atol=1e-5, msg=key)


# --------------------------------------------------------------------------- advantages


def make_groups(seed: int, b: int = 12, t: int = 8):
    gen = torch.Generator().manual_seed(seed)
    labels = np.array([f"p{i % 4}" for i in range(b)], dtype=object)
    index = labels[torch.randperm(b, generator=gen).numpy()]
    mask = random_mask(b, t, gen, p_gap=0.2)
    rewards = torch.where(mask, randn(b, t, gen=gen) * 0.5, 0.0)
    return index, mask, rewards, gen


OUTCOME = [
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "gdpo",
]


@pytest.mark.parametrize("name", OUTCOME)
def test_outcome_estimators(name):
    index, mask, rewards, _ = make_groups(13)
    ours = cv.core_algos.ADV_ESTIMATORS[name](
        token_level_rewards=rewards, response_mask=mask, index=index
    )
    theirs = verl_core.ADV_ESTIMATOR_REGISTRY[name](
        token_level_rewards=rewards, response_mask=mask.float(), index=index
    )
    for o, t in zip(ours, theirs):
        assert_close(o, t, **TOL, msg=name)


@pytest.mark.parametrize("form", ["dataclass", "dict", "omegaconf", "namespace"])
def test_estimators_that_read_the_algorithm_config(form):
    index, mask, rewards, gen = make_groups(14)

    def algo(**kw):
        if form == "dataclass":
            return verl_algo.AlgoConfig(**kw)
        if form == "dict":
            return dict(kw)
        if form == "omegaconf":
            return omegaconf.OmegaConf.create(kw)
        return SimpleNamespace(**kw)

    # REINFORCE++ reads gamma.
    ours = cv.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=algo(gamma=0.9))
    theirs = verl_core.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask.float(), config=verl_algo.AlgoConfig(gamma=0.9)
    )
    for o, t in zip(ours, theirs):
        assert_close(o, t, **TOL)
    # grpo_passk reads norm_adv_by_std_in_grpo from the config, ignoring the argument.
    ours = cv.compute_grpo_passk_outcome_advantage(
        rewards, mask, index, 1e-6, True, algo(norm_adv_by_std_in_grpo=False)
    )
    theirs = verl_core.compute_grpo_passk_outcome_advantage(
        rewards,
        mask.float(),
        index,
        1e-6,
        True,
        verl_algo.AlgoConfig(norm_adv_by_std_in_grpo=False),
    )
    for o, t in zip(ours, theirs):
        assert_close(o, t, **TOL)
    # GDPO reads the component keys and weights; verl places each component on the last
    # response token of a right-padded response.
    b, t = mask.shape
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t) < lengths[:, None]
    batch = {
        "prompts": torch.zeros(b, 3, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(b, 3, dtype=torch.long), mask.long()], -1),
    }
    non_tensor = {
        "acc": np.random.default_rng(0).random(b).astype(np.float32),
        "fmt": [float(x) for x in np.random.default_rng(1).integers(0, 2, b)],
    }
    keys = {"gdpo_reward_keys": ["acc", "fmt"], "gdpo_reward_weights": [1.0, 0.5]}
    ours = cv.compute_gdpo_outcome_advantage(
        rewards, mask, index, config=algo(**keys), non_tensor_batch=non_tensor, batch=batch
    )
    theirs = verl_core.compute_gdpo_outcome_advantage(
        rewards, mask.float(), index, config=verl_algo.AlgoConfig(**keys),
        non_tensor_batch=non_tensor, batch=batch,
    )  # fmt: skip
    for o, t in zip(ours, theirs):
        assert_close(o, t, **TOL)


def test_gae_remax_and_optimal_token_baselines():
    index, mask, rewards, gen = make_groups(15)
    values = randn(*mask.shape, gen=gen)
    valid = mask
    ours = cv.compute_gae_advantage_return(rewards, values, mask, 0.99, torch.tensor(0.9))
    theirs = verl_core.compute_gae_advantage_return(rewards, values, mask.float(), 0.99, 0.9)
    for o, t in zip(ours, theirs):
        assert_close(o[valid], t[valid], **TOL)
    baselines = randn(mask.shape[0], gen=gen)
    ours = cv.compute_remax_outcome_advantage(rewards, baselines, mask)
    theirs = verl_core.compute_remax_outcome_advantage(rewards, baselines, mask.float())
    for o, t in zip(ours, theirs):
        assert_close(o[valid], t[valid], **TOL)
    old = -torch.rand(*mask.shape, generator=gen) * 2
    spi = torch.rand(*mask.shape, generator=gen) * 0.5 + 0.1
    w = torch.rand(*mask.shape, generator=gen) + 0.5
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        kw = dict(token_level_rewards=rewards, index=index, old_log_probs=old, sum_pi_squared=spi)
        ours = cv.core_algos.ADV_ESTIMATORS[name](response_mask=mask, rollout_is_weights=w, **kw)
        theirs = verl_core.ADV_ESTIMATOR_REGISTRY[name](
            response_mask=mask.float(), rollout_is_weights=w, **kw
        )
        assert_close(ours[0], theirs[0], rtol=1e-4, atol=1e-5, msg=name)
        assert_close(ours[1][valid], theirs[1][valid], **TOL, msg=name)


def test_masked_positions_are_zero_documented_difference():
    index, mask, rewards, gen = make_groups(18)
    values = randn(*mask.shape, gen=gen)
    ours = cv.compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    theirs = verl_core.compute_gae_advantage_return(rewards, values, mask.float(), 1.0, 0.95)
    baselines = randn(mask.shape[0], gen=gen)
    ours += cv.compute_remax_outcome_advantage(rewards, baselines, mask)[1:]
    theirs += verl_core.compute_remax_outcome_advantage(rewards, baselines, mask.float())[1:]
    for o, t in zip(ours, theirs):
        assert torch.all(o[~mask] == 0)
        assert torch.any(
            t[~mask] != 0
        )  # verl leaves A + V, the carried advantage, the running return


def test_singleton_groups_give_zero_documented_difference():
    index, mask, rewards, _ = make_groups(16)
    index = index.copy()
    index[0] = "alone"
    ours, _ = cv.compute_grpo_outcome_advantage(rewards, mask, index)
    theirs, _ = verl_core.compute_grpo_outcome_advantage(rewards, mask.float(), index)
    assert torch.all(ours[0] == 0)
    assert_close(theirs[0], rewards[0].sum() * mask[0], **TOL)  # verl: the raw score


def test_gpg_ignores_alpha_as_verl_does():
    index, mask, rewards, _ = make_groups(17)
    ours = cv.compute_gpg_outcome_advantage(rewards, mask, index, 1e-6, 1.0, 123.0)
    theirs = verl_core.compute_gpg_outcome_advantage(rewards, mask.float(), index, 1e-6, 1.0, 123.0)
    assert_close(ours[0], theirs[0], **TOL)


# --------------------------------------------------------------------------- KL, rewards, controllers


@pytest.mark.parametrize(
    "name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"]
)
def test_kl_penalty(name):
    gen = torch.Generator().manual_seed(18)
    a, r = randn(4, 6, gen=gen), randn(4, 6, gen=gen)
    x, y = a.clone().requires_grad_(True), a.clone().requires_grad_(True)
    ours, theirs = cv.kl_penalty(x, r, name), verl_core.kl_penalty(y, r, name)
    assert_close(ours, theirs, **TOL)
    ours.sum().backward()
    theirs.sum().backward()
    assert_close(x.grad, y.grad, **TOL)
    if not name.endswith("+"):
        assert_close(
            cv.kl_penalty_forward(a, r, name), verl_core.kl_penalty_forward(a, r, name), **TOL
        )


def test_rewards_and_kl_controllers():
    gen = torch.Generator().manual_seed(19)
    s, o, r = (randn(3, 5, gen=gen) for _ in range(3))
    assert_close(cv.compute_rewards(s, o, r, 0.2), verl_core.compute_rewards(s, o, r, 0.2), **TOL)
    kl = {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.1, "horizon": 500}
    for cfg in (kl, omegaconf.OmegaConf.create(kl), SimpleNamespace(**kl)):
        ours, theirs = cv.get_kl_controller(cfg), verl_core.get_kl_controller(SimpleNamespace(**kl))
        for current in (0.02, 0.3, 0.11):
            ours.update(current, 64)
            theirs.update(current, 64)
            assert ours.value == pytest.approx(theirs.value, rel=1e-12)
    fixed = cv.get_kl_controller({"type": "fixed", "kl_coef": 0.3})
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        cv.get_kl_controller({"type": "pid", "kl_coef": 0.3})


# --------------------------------------------------------------------------- torch_functional


def test_masked_statistics_and_utilities():
    gen = torch.Generator().manual_seed(20)
    x = randn(5, 7, gen=gen)
    mask = random_mask(5, 7, gen).float()
    for axis in (None, -1):
        assert_close(cv.masked_sum(x, mask, axis), verl_tf.masked_sum(x, mask, axis), **TOL)
        assert_close(cv.masked_mean(x, mask, axis), verl_tf.masked_mean(x, mask, axis), **TOL)
    for unbiased in (True, False):
        assert_close(cv.masked_var(x, mask, unbiased), verl_tf.masked_var(x, mask, unbiased), **TOL)
    valid = mask.bool()
    for shift in (True, False):
        assert_close(
            cv.masked_whiten(x, mask, shift)[valid],
            verl_tf.masked_whiten(x, mask, shift)[valid],
            **TOL,
        )
    ids = torch.randint(0, 6, (4, 9), generator=gen)
    for eos in (2, [1, 3]):
        assert torch.equal(cv.get_response_mask(ids, eos), verl_tf.get_response_mask(ids, eos))
    lo, hi = x - 0.3, x + randn(5, 7, gen=gen).abs()
    y = randn(5, 7, gen=gen)
    assert torch.equal(cv.clip_by_value(y, lo, hi), verl_tf.clip_by_value(y, lo, hi))
    rows = [[1, 2, 3], [4], [5, 6]]
    assert torch.equal(
        cv.pad_2d_list_to_length(rows, 0, 5), verl_tf.pad_2d_list_to_length(rows, 0, 5)
    )
    for left in (False, True):
        assert torch.equal(
            cv.pad_sequence_to_length(ids, 12, -1, left),
            verl_tf.pad_sequence_to_length(ids, 12, -1, left),
        )
    attn = random_mask(4, 9, gen, layout="left").long()
    for o, t in zip(cv.get_unpad_data(attn), verl_tf.get_unpad_data(attn)):
        assert (o == t) if isinstance(t, int) else torch.equal(o, t)


def test_log_probs_entropy_and_sum_pi_squared():
    gen = torch.Generator().manual_seed(21)
    logits = randn(3, 6, 50, gen=gen, scale=3)
    labels = torch.randint(0, 50, (3, 6), generator=gen)
    for fn in ("logprobs_from_logits", "logprobs_from_logits_naive", "logprobs_from_logits_v2"):
        assert_close(getattr(cv, fn)(logits, labels), getattr(verl_tf, fn)(logits, labels), **TOL)
    assert_close(cv.entropy_from_logits(logits), verl_tf.entropy_from_logits(logits), **TOL)
    flat = logits.reshape(-1, 50)
    assert_close(
        cv.entropy_from_logits_with_chunking(flat, 4),
        verl_tf.entropy_from_logits_with_chunking(flat, 4),
        **TOL,
    )
    assert_close(
        cv.calculate_sum_pi_squared_from_logits(logits),
        verl_tf.calculate_sum_pi_squared_from_logits(logits),
        **TOL,
    )
    ids = torch.randint(0, 50, (3, 6), generator=gen)
    assert_close(
        cv.log_probs_from_logits_response(ids, logits, 4),
        verl_tf.log_probs_from_logits_response(ids, logits, 4),
        **TOL,
    )


def _lrs(make, steps):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_step_by_step():
    cases = [
        ("get_cosine_schedule_with_warmup", (5, 40, 0.1, 0.5, -1, 0.05, False)),
        ("get_constant_schedule_with_warmup", (7,)),
        ("get_wsd_schedule_with_warmup", (4, 40, 0.1, 0.5, -1, 0.5)),
    ]
    for name, args in cases:
        ours = _lrs(lambda o, n=name, a=args: getattr(cv, n)(o, *a), 40)
        theirs = _lrs(lambda o, n=name, a=args: getattr(verl_tf, n)(o, *a), 40)
        assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-12), name


def test_distributed_helpers_outside_torch_distributed():
    gen = torch.Generator().manual_seed(22)
    x = randn(17, gen=gen)
    mean, vmax, vmin, std = cv.distributed_mean_max_min_std(x)
    assert_close(mean, x.mean(), **TOL)
    assert_close(vmax, x.max(), **TOL)
    assert_close(vmin, x.min(), **TOL)
    assert_close(std, x.std(), **TOL)
    mask = (torch.rand(17, generator=gen) > 0.4).float()
    assert_close(cv.distributed_masked_mean(x, mask), (x * mask).sum() / mask.sum(), **TOL)


# --------------------------------------------------------------------------- rollout correction


def make_rollout(seed: int, b: int = 6, t: int = 9, scale: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, t, gen, p_gap=0.2).float()
    mask[4] = 0  # a row without valid tokens
    old = -torch.rand(b, t, generator=gen) * 3
    rollout = old + randn(b, t, gen=gen, scale=scale)
    return old, rollout, mask


RS = [
    ("token_k1", "0.7_1.4"),
    ("token_k1", 1.3),
    ("token_k2", 0.02),
    ("token_k3", 0.02),
    ("seq_sum_k1", "0.5_1.8"),
    ("seq_sum_k2", 0.1),
    ("seq_sum_k3", 0.1),
    ("seq_mean_k1", "0.9_1.1"),
    ("seq_mean_k2", 0.03),
    ("seq_mean_k3", 0.03),
    ("seq_max_k2", 0.1),
    ("seq_max_k3", 0.1),
    ("token_k1,seq_max_k3", "0.4_1.8,0.1"),
    ("seq_mean_k1, token_k2,seq_sum_k3", "0.8_1.25,0.05,0.3"),
]
IS = [
    ("token", 1.5, False),
    ("token", "0.8_1.25", False),
    ("sequence", 2.0, False),
    ("sequence", "0.5_5.0", True),
    ("token", 1.2, True),
]


def compare_correction(kw, seed=23):
    old, rollout, mask = make_rollout(seed)
    po, mo_mask, mo = cv.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kw)
    pt, mt_mask, mt = verl_rc.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, **kw
    )
    assert (po is None) == (pt is None)
    if pt is not None:
        assert isinstance(po, verl_proto.DataProto)
        assert_close(po.batch["rollout_is_weights"], pt.batch["rollout_is_weights"], **TOL)
    assert mo_mask.dtype == mt_mask.dtype
    assert torch.equal(mo_mask, mt_mask)
    assert_verl_types(mo, mt, "compute_rollout_correction_and_rejection_mask")
    for key in mt:
        assert_close(mo[key], mt[key], rtol=1e-4, atol=2e-5, msg=key)
    return mo_mask, mask


@pytest.mark.parametrize("option, threshold", RS)
def test_rejection_options_match_verl(option, threshold):
    kept, mask = compare_correction(
        {"rollout_is": None, "rollout_rs": option, "rollout_rs_threshold": threshold}
    )
    assert 0 < kept.sum() < mask.sum(), "thresholds chosen so that some tokens are rejected"


@pytest.mark.parametrize("level, threshold, normalize", IS)
def test_importance_weights_match_verl(level, threshold, normalize):
    compare_correction(
        {
            "rollout_is": level,
            "rollout_is_threshold": threshold,
            "rollout_is_batch_normalize": normalize,
        }
    )


def test_weights_and_rejection_together():
    compare_correction(
        {
            "rollout_is": "token",
            "rollout_is_threshold": "0.5_2.0",
            "rollout_rs": "seq_max_k2,token_k1",
            "rollout_rs_threshold": "0.08,0.6_1.6",
        }
    )


def test_offpolicy_and_metric_helpers_match_verl():
    old, rollout, mask = make_rollout(24)
    for r in (rollout, None):
        mo = cv.compute_offpolicy_metrics(old, r, mask)
        mt = verl_rc.compute_offpolicy_metrics(old, r, mask)
        assert_verl_types(mo, mt, "compute_offpolicy_metrics")
        for k in mt:
            assert_close(mo[k], mt[k], rtol=1e-5, atol=1e-6, msg=k)
    lr = old - rollout
    for level in ("token", "sequence"):
        for th in (2.0, "0.6_1.5"):
            wo, mo = cv.compute_rollout_correction_weights(lr, mask, level, th)
            wt, mt = verl_rc.compute_rollout_correction_weights(lr, mask, level, th)
            assert_close(wo, wt, **TOL)
            assert_verl_types(mo, mt, "compute_rollout_correction_weights")
            for k in mt:
                assert_close(mo[k], mt[k], rtol=1e-4, atol=2e-5, msg=k)
    mo_mask, mo = cv.compute_rollout_rejection_mask(lr, mask, "seq_sum_k2,token_k1", "0.2,0.6_1.5")
    mt_mask, mt = verl_rc.compute_rollout_rejection_mask(
        lr, mask, "seq_sum_k2,token_k1", "0.2,0.6_1.5"
    )
    assert torch.equal(mo_mask, mt_mask)
    assert_verl_types(mo, mt, "compute_rollout_rejection_mask")
    o = cv.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
    t = verl_rc.compute_rollout_corr_metrics_from_logprobs(old, rollout, mask)
    assert_verl_types(o, t, "compute_rollout_corr_metrics_from_logprobs")
    # The metric helpers called directly, as verl's tests do.
    raw = torch.tensor([[1.0, 6.0], [0.9, 1.1]])
    args = (raw.clamp(max=2.0), raw, torch.log(raw), torch.ones_like(raw), "token", 2.0)
    mo, mt = cv.compute_is_metrics(*args), verl_rc.compute_is_metrics(*args)
    assert_verl_types(mo, mt, "compute_is_metrics")
    stat, valid = torch.log(raw).abs(), torch.ones(2, dtype=torch.bool)
    for level, per_seq in (("token", None), ("sequence", stat.sum(-1))):
        kw = {
            "level": level,
            "per_sequence_values": per_seq,
            "rollout_rs_threshold": 0.5,
            "rollout_rs_threshold_lower": 0.1,
            "apply_lower_threshold": True,
        }
        mo = cv.compute_rs_metrics("token_k1", stat, torch.ones_like(raw), valid, **kw)
        mt = verl_rc.compute_rs_metrics("token_k1", stat, torch.ones_like(raw), valid, **kw)
        assert_verl_types(mo, mt, f"compute_rs_metrics {level}")
        for k in mt:
            assert_close(mo[k], mt[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in mt:
        assert_close(mo[k], mt[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("form", ["dataclass", "dict", "omegaconf"])
def test_add_to_batch_with_every_config_form(form):
    old, rollout, mask = make_rollout(25)
    fields = {
        "rollout_is": "token",
        "rollout_is_threshold": 1.5,
        "rollout_rs": "token_k2",
        "rollout_rs_threshold": 0.02,
    }
    if form == "dataclass":
        cfg = verl_algo.RolloutCorrectionConfig(**fields)
    elif form == "dict":
        cfg = dict(fields)
    else:
        cfg = omegaconf.OmegaConf.create(fields)

    def batch():
        return verl_proto.DataProto.from_dict(
            tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
        )

    bo, mo = cv.compute_rollout_correction_and_add_to_batch(batch(), cfg)
    bt, mt = verl_rc.compute_rollout_correction_and_add_to_batch(
        batch(), verl_algo.RolloutCorrectionConfig(**fields)
    )
    assert torch.equal(bo.batch["response_mask"], bt.batch["response_mask"])
    assert_close(bo.batch["rollout_is_weights"], bt.batch["rollout_is_weights"], **TOL)
    assert_verl_types(mo, mt, "compute_rollout_correction_and_add_to_batch")
    assert all(isinstance(v, float) for v in mo.values())
    for k in mt:
        assert mo[k] == pytest.approx(mt[k], rel=1e-4, abs=2e-5), k


def test_threshold_errors():
    old, rollout, mask = make_rollout(26)
    with pytest.raises(TypeError, match="not a boolean"):
        cv.compute_rollout_correction_and_rejection_mask(old, rollout, mask, "token", True)
    with pytest.raises(ValueError, match="Invalid rollout_rs option"):
        cv.compute_rollout_rejection_mask(old - rollout, mask, "token_k9", 2.0)
    with pytest.raises(ValueError, match="exactly 2 thresholds"):
        cv.compute_rollout_rejection_mask(old - rollout, mask, "token_k1,token_k2", "1.2,0.1,0.3")
    with pytest.raises(ValueError, match="single upper"):
        cv.compute_rollout_rejection_mask(old - rollout, mask, "token_k2", "0.1_0.2")
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        cv.compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_rs="token_k2")


def test_icepop_keeps_the_mask_documented_difference():
    # verl's IcePop: weights outside [lower, upper] are zeroed, the mask is unchanged, so the
    # rejected token still counts in token-mean (verl's own test: -0.748). rlmath's
    # rollout_correction(mode="mask") also drops it from the mask: -1.122.
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-0.5, -3.5, -0.8]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3)
    cfg = actor_config("dict")
    proto, kept, _ = cv.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, "token", "0.5_5.0"
    )
    w = proto.batch["rollout_is_weights"]
    assert torch.equal(kept, mask)
    verl_loss, _ = cv.compute_policy_loss_vanilla(old, old.clone(), adv, kept, "token-mean", cfg, w)
    assert verl_loss.item() == pytest.approx(-0.7480, abs=1e-4)
    pure = rlmath.rollout_correction(
        old, rollout, mask, mode="mask", threshold_low=0.5, threshold_high=5.0
    )
    ours, _ = rlmath.compute_policy_loss_vanilla(
        old, old.clone(), adv, pure.response_mask, rollout_is_weights=pure.weights
    )
    assert ours.item() == pytest.approx(-1.1220, abs=1e-4)
    same, _ = rlmath.compute_policy_loss_vanilla(
        old, old.clone(), adv, mask, rollout_is_weights=pure.weights
    )
    assert same.item() == pytest.approx(verl_loss.item(), abs=1e-6)


def test_empty_mask_and_huge_log_ratios_documented_difference():
    old, rollout, mask = make_rollout(27)
    empty = torch.zeros_like(mask)
    with pytest.raises(ValueError, match="at least one valid token"):
        verl_rc.compute_rollout_correction_and_rejection_mask(old, rollout, empty, "token")
    _, kept, metrics = cv.compute_rollout_correction_and_rejection_mask(
        old, rollout, empty, "token"
    )
    assert not kept.any() and all(math.isfinite(v) for v in metrics.values())
    far = rollout.clone()
    far[0, 0] = old[0, 0] - 100.0  # log-ratio +100 on one valid token
    assert math.isinf(verl_rc.compute_offpolicy_metrics(old, far, mask)["k3_kl"])
    assert math.isfinite(cv.compute_offpolicy_metrics(old, far, mask)["k3_kl"])


# --------------------------------------------------------------------------- install / uninstall


def _snapshot():
    import verl.workers.rollout.hf_rollout as hf_rollout

    mods = (verl_tf, verl_core, verl_rc, hf_rollout)
    return {
        "attrs": {(m.__name__, k): v for m in mods for k, v in vars(m).items()},
        "policy": dict(verl_core.POLICY_LOSS_REGISTRY),
        "adv": dict(verl_core.ADV_ESTIMATOR_REGISTRY),
    }


def test_install_and_uninstall_restore_exactly():
    import verl.workers.rollout.hf_rollout as hf_rollout  # binds get_response_mask by name

    before = _snapshot()
    original_mask_fn = hf_rollout.get_response_mask
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # verl 0.9.1: no version warning
            replaced = cv.install()
        assert cv.is_installed()
        assert (
            replaced["verl.trainer.ppo.core_algos.agg_loss"]
            is before["attrs"][("verl.trainer.ppo.core_algos", "agg_loss")]
        )
        assert "verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY['vanilla']" in replaced
        assert replaced["verl.workers.rollout.hf_rollout.get_response_mask"] is original_mask_fn
        assert hf_rollout.get_response_mask is cv.get_response_mask
        assert verl_core.get_policy_loss_fn("gspo") is cv.compute_policy_loss_gspo
        assert verl_core.get_adv_estimator_fn("rloo") is cv.compute_rloo_outcome_advantage
        assert verl_tf.masked_whiten is cv.masked_whiten
        assert verl_rc.compute_rs_metrics is cv.compute_rs_metrics
        assert cv.install() == replaced  # idempotent
        with pytest.raises(ValueError, match="another selection"):
            cv.install(torch_functional=False)
        # A verl function that calls a replaced one by module attribute now runs rlmath.
        old, rollout, mask = make_rollout(28)
        batch = verl_proto.DataProto.from_dict(
            tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
        )
        _, metrics = verl_rc.compute_rollout_correction_and_add_to_batch(
            batch, {"rollout_is": "token", "rollout_is_threshold": 2.0}
        )
        assert "rollout_corr/rollout_is_mean" in metrics
    finally:
        restored = cv.uninstall()
    assert restored == replaced
    assert not cv.is_installed()
    assert cv.uninstall() == {}
    after = _snapshot()
    assert after["policy"] == before["policy"] and after["adv"] == before["adv"]
    for key, value in before["attrs"].items():
        assert after["attrs"][key] is value, key
    assert set(after["attrs"]) == set(before["attrs"])


def test_install_gives_verls_metric_types_and_tensors_on_request():
    old, logp, adv, mask, _ = make_inputs(29)
    rollout = old + 0.1
    try:
        cv.install()
        _, metrics = verl_core.get_policy_loss_fn("vanilla")(
            old, logp, adv, mask, "token-mean", actor_config("dict")
        )
        assert metrics and all(type(v) is float for v in metrics.values())
        off = verl_rc.compute_offpolicy_metrics(old, rollout, mask)
        assert isinstance(off["kl"], float)  # what verl's test_offpolicy_metrics asserts
        _, _, corr = verl_rc.compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, "sequence", "0.5_2.0", True, "token_k1", 1.5
        )
        assert all(type(v) is float for v in corr.values())
    finally:
        cv.uninstall()
    try:
        cv.install(float_metrics=False)
        _, metrics = verl_core.get_policy_loss_fn("vanilla")(
            old, logp, adv, mask, "token-mean", actor_config("dict")
        )
        assert metrics and all(isinstance(v, torch.Tensor) for v in metrics.values())
        off = verl_rc.compute_offpolicy_metrics(old, rollout, mask)
        assert all(isinstance(v, torch.Tensor) for v in off.values())
    finally:
        cv.uninstall()
    _, metrics = cv.compute_policy_loss_vanilla(old, logp, adv, mask, "token-mean", {})
    assert metrics and all(type(v) is float for v in metrics.values())


def test_partial_install():
    try:
        replaced = cv.install(core_algos=False, rollout_corr_helper=False)
        assert "verl.utils.torch_functional.masked_mean" in replaced
        assert not any(
            k.startswith(("verl.trainer.ppo.core_algos.", "verl.trainer.ppo.rollout_corr_helper."))
            for k in replaced
        ), sorted(replaced)
        assert verl_tf.masked_mean is cv.masked_mean
        assert verl_core.agg_loss is not cv.agg_loss
    finally:
        cv.uninstall()
    assert verl_tf.masked_mean is not cv.masked_mean
