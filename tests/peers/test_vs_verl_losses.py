"""Differential tests, losses: rlmath vs verl 0.9.1's ``core_algos``.

``agg_loss`` in every mode (also with ``dp_size > 1`` and global counts), every
policy loss of verl's registry under verl's default ``ActorConfig`` (plus a few
non-default settings that reach every clip region), ``compute_value_loss`` and
``compute_entropy_loss``: loss values, gradients w.r.t. ``log_prob`` (or the
loss matrix / logits) and the metrics both sides report.

Pinned differences (docs/design.md "Losses and aggregation"):
- ``seq-mean-token-sum-norm`` needs ``norm_length`` in rlmath (verl silently
  uses the padded width ``loss_mask.shape[-1]``);
- fully masked sequences do not count as sequences (verl's GMPO averages over
  every row with ``torch.mean``);
- verl metrics are Python floats, rlmath's are 0-d tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.peers.peer_helpers import assert_close, import_verl, randn, random_mask

verl_core = import_verl("verl.trainer.ppo.core_algos")
verl_cfg = import_verl("verl.workers.config")

import rlmath  # noqa: E402

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = dict(rtol=2e-5, atol=1e-6)


def actor_config(**kw):
    policy_kw = {
        k: kw.pop(k)
        for k in list(kw)
        if k
        in (
            "clip_cov_ratio",
            "clip_cov_lb",
            "clip_cov_ub",
            "kl_cov_ratio",
            "ppo_kl_coef",
            "dro_beta",
        )
    }
    return verl_cfg.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=verl_cfg.PolicyLossConfig(**policy_kw),
        **kw,
    )


def make_inputs(seed: int, *, b: int = 6, t: int = 11, spread: float = 0.3, empty_row=False):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, t, gen, layout="right", p_gap=0.2)
    if empty_row:
        mask[1] = False
    old = -torch.rand(b, t, generator=gen) * 3 - 0.05
    logp = old + randn(b, t, gen=gen, scale=spread)
    logp = logp.clamp(max=-1e-4)  # log-probs stay <= 0 (DPPO uses exp(log_prob))
    adv = randn(b, t, gen=gen)
    return old, logp, adv, mask, gen


def _run(fn, old, logp, adv, mask, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, adv, mask, **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _check_metrics(ours: dict, theirs: dict, keys) -> None:
    for k in keys:
        assert f"actor/{k}" in theirs, (k, sorted(theirs))
        assert_close(ours[k], theirs[f"actor/{k}"], rtol=1e-5, atol=1e-6, msg=f"metric {k}")


# --------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize("mode", [*MODES, "token-sum"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("empty_row", [False, True])
def test_agg_loss(mode, seed, empty_row):
    gen = torch.Generator().manual_seed(seed)
    b, t = 5, 9
    mask = random_mask(b, t, gen, p_gap=0.3)
    if empty_row:
        mask[2] = False
    loss_mat = randn(b, t, gen=gen)
    norm = {"seq-mean-token-sum-norm": 7.0}.get(mode)
    x1, x2 = loss_mat.clone().requires_grad_(True), loss_mat.clone().requires_grad_(True)
    ours = rlmath.agg_loss(x1, mask, loss_agg_mode=mode, norm_length=norm)
    theirs = verl_core.agg_loss(x2, mask.float(), mode, loss_scale_factor=norm)
    assert_close(ours, theirs, **TOL, msg=mode)
    ours.backward()
    theirs.backward()
    assert_close(x1.grad, x2.grad, **TOL, msg=f"{mode} grad")


def test_agg_loss_norm_length_documented_difference(gen):
    # docs/design.md: norm_length is required; verl silently defaults to the padded width
    # of each micro-batch. With norm_length = padded width both agree.
    mask = random_mask(4, 10, gen)
    loss_mat = randn(4, 10, gen=gen)
    with pytest.raises(ValueError, match="norm_length"):
        rlmath.agg_loss(loss_mat, mask, loss_agg_mode="seq-mean-token-sum-norm")
    assert_close(
        rlmath.agg_loss(loss_mat, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=10),
        verl_core.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm"),
        **TOL,
    )


@pytest.mark.parametrize("mode", [*MODES, "token-sum"])
def test_agg_loss_data_parallel_scaling(mode, gen):
    # One rank's micro-batch of a dp_size=4 global batch: both scale the local sum by
    # dp_size / global count, so DDP's gradient average gives the full-batch gradient.
    dp, b, t = 4, 3, 8
    mask = random_mask(b, t, gen)
    loss_mat = randn(b, t, gen=gen)
    tokens, seqs = 57, 11
    norm = 8.0 if mode == "seq-mean-token-sum-norm" else None
    ours = rlmath.agg_loss(
        loss_mat,
        mask,
        loss_agg_mode=mode,
        global_num_tokens=tokens,
        global_num_seqs=seqs,
        dp_size=dp,
        norm_length=norm,
    )
    theirs = verl_core.agg_loss(
        loss_mat,
        mask.float(),
        mode,
        dp_size=dp,
        batch_num_tokens=tokens,
        global_batch_size=seqs,
        loss_scale_factor=norm,
    )
    assert_close(ours, theirs, **TOL, msg=mode)


# --------------------------------------------------------------------------- policy losses

# (name, rlmath kwargs, verl ActorConfig kwargs, metric keys to compare, loss modes)
CLIP = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
POLICY_CASES = [
    ("vanilla", {}, {}, ["pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"], MODES),
    ("vanilla", CLIP | {"clip_ratio_c": 1.5}, CLIP | {"clip_ratio_c": 1.5}, None, MODES),
    (
        "dppo_tv",
        dict(clip_ratio=0.1, clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=1.5),
        dict(clip_ratio=0.1, clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=1.5),
        ["pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"],
        MODES,
    ),
    ("dppo_tv", {}, {}, ["pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"], ["token-mean"]),
    (
        "dppo_kl",
        dict(clip_ratio=0.02, clip_ratio_low=0.01, clip_ratio_high=0.03),
        dict(clip_ratio=0.02, clip_ratio_low=0.01, clip_ratio_high=0.03),
        ["pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"],
        MODES,
    ),
    ("gspo", {}, {}, ["ppo_kl"], MODES),
    (
        "gspo",
        dict(clip_ratio_low=3e-2, clip_ratio_high=4e-2),
        dict(clip_ratio_low=3e-2, clip_ratio_high=4e-2),
        ["pg_clipfrac", "ppo_kl"],
        MODES,
    ),
    ("sapo", {}, {}, ["ppo_kl"], ["seq-mean-token-mean"]),
    (
        "sapo",
        dict(tau_pos=2.0, tau_neg=3.0),
        dict(tau_pos=2.0, tau_neg=3.0),
        None,
        ["seq-mean-token-mean"],
    ),
    ("gpg", {}, {}, [], MODES),
    # GMPO clip fractions: rlmath's are sign-aware (docs/design.md, "Metrics"), verl
    # counts every out-of-band token: see test_geo_mean_clipfrac_*.
    ("geo_mean", {}, {}, ["ppo_kl"], ["seq-mean-token-mean"]),
    ("geo_mean", CLIP, CLIP, None, ["seq-mean-token-mean"]),
    ("dro", dict(dro_beta=0.5), dict(dro_beta=0.5), ["ppo_kl"], MODES),
    ("cispo", {}, {}, ["pg_clipfrac", "ppo_kl"], MODES),
    ("cispo", CLIP, CLIP, None, MODES),
    ("kl_cov", {}, {}, [], MODES),
    (
        "kl_cov",
        dict(kl_cov_ratio=0.2, ppo_kl_coef=1.0),
        dict(kl_cov_ratio=0.2, ppo_kl_coef=1.0),
        [],
        MODES,
    ),
]


def _ids(case):
    return f"{case[0]}-{'default' if not case[1] else 'custom'}"


@pytest.mark.parametrize("case", POLICY_CASES, ids=_ids)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_is", [False, True])
def test_policy_loss(case, seed, with_is):
    name, ours_kw, verl_kw, metric_keys, modes = case
    old, logp, adv, mask, gen = make_inputs(seed)
    if name == "geo_mean":
        # GMPO: verl "only support[s] sequence level" advantages.
        adv = adv[:, :1].expand_as(adv).contiguous()
    is_w = (0.5 + torch.rand(mask.shape, generator=gen)) if with_is else None
    cfg = actor_config(**verl_kw)
    for mode in modes:
        norm = 11 if mode == "seq-mean-token-sum-norm" else None  # verl: padded width
        loss, grad, met = _run(
            rlmath.get_policy_loss(name),
            old,
            logp,
            adv,
            mask,
            loss_agg_mode=mode,
            rollout_is_weights=is_w,
            norm_length=norm,
            **ours_kw,
        )
        loss_v, grad_v, met_v = _run(
            verl_core.get_policy_loss_fn(name),
            old,
            logp,
            adv,
            mask.float(),
            loss_agg_mode=mode,
            config=cfg,
            rollout_is_weights=is_w,
        )
        assert_close(loss, loss_v, **TOL, msg=f"{name} {mode} loss")
        assert_close(grad, grad_v, **TOL, msg=f"{name} {mode} grad")
        if metric_keys:
            _check_metrics(met, met_v, metric_keys)


def test_policy_loss_extreme_ratios_vanilla(gen):
    # Log-ratios far outside the band (dual-clip region, ratio clamp at +-20).
    old, logp, adv, mask, _ = make_inputs(5, spread=6.0)
    cfg = actor_config()
    loss, grad, met = _run(rlmath.get_policy_loss("vanilla"), old, logp, adv, mask)
    loss_v, grad_v, met_v = _run(
        verl_core.get_policy_loss_fn("vanilla"), old, logp, adv, mask.float(), config=cfg
    )
    assert_close(loss, loss_v, rtol=1e-5, atol=1e-5)
    assert_close(grad, grad_v, rtol=1e-5, atol=1e-5)
    _check_metrics(met, met_v, ["pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_clip_cov_deterministic_regime(seed):
    # verl picks clip_num random candidates with the global RNG; with clip_cov_ratio so
    # large that clip_num >= #candidates every candidate is taken on both sides.
    old, logp, adv, mask, _ = make_inputs(seed, spread=0.6)
    adv = adv * 3
    kw = dict(clip_cov_ratio=0.9, clip_cov_lb=0.2, clip_cov_ub=5.0)
    cfg = actor_config(**kw)
    for mode in MODES:
        norm = 11 if mode == "seq-mean-token-sum-norm" else None
        loss, grad, met = _run(
            rlmath.get_policy_loss("clip_cov"),
            old,
            logp,
            adv,
            mask,
            loss_agg_mode=mode,
            norm_length=norm,
            **kw,
        )
        loss_v, grad_v, met_v = _run(
            verl_core.get_policy_loss_fn("clip_cov"),
            old,
            logp,
            adv,
            mask.float(),
            loss_agg_mode=mode,
            config=cfg,
        )
        assert_close(loss, loss_v, **TOL, msg=f"clip_cov {mode}")
        assert_close(grad, grad_v, **TOL, msg=f"clip_cov {mode} grad")
        _check_metrics(met, met_v, ["ppo_kl"])


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce(seed):
    # verl 0.9.1 has compute_policy_loss_reinforce but does not register it.
    old, logp, adv, mask, gen = make_inputs(seed)
    cfg = actor_config()
    for is_w in (None, 0.5 + torch.rand(mask.shape, generator=gen)):
        for mode in MODES:
            norm = 11 if mode == "seq-mean-token-sum-norm" else None
            loss, grad, met = _run(
                rlmath.get_policy_loss("reinforce"),
                old,
                logp,
                adv,
                mask,
                loss_agg_mode=mode,
                rollout_is_weights=is_w,
                norm_length=norm,
            )
            loss_v, grad_v, met_v = _run(
                verl_core.compute_policy_loss_reinforce,
                old,
                logp,
                adv,
                mask.float(),
                loss_agg_mode=mode,
                config=cfg,
                rollout_is_weights=is_w,
            )
            assert_close(loss, loss_v, **TOL, msg=mode)
            assert_close(grad, grad_v, **TOL, msg=mode)
            _check_metrics(met, met_v, ["ppo_kl"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [dict(clip_ratio_low=3e-2, clip_ratio_high=4e-2), {}])
def test_gspo_token_vs_verl_gspo(seed, clip):
    # Per-token advantages (GAE): verl's registry "gspo" is GSPO-token (rlmath's
    # gspo.py docstring: "gspo_token ... this is what verl's registry calls gspo").
    old, logp, adv, mask, gen = make_inputs(seed)
    cfg = actor_config(**clip)
    for is_w in (None, 0.5 + torch.rand(mask.shape, generator=gen)):
        for mode in MODES:
            norm = 11 if mode == "seq-mean-token-sum-norm" else None
            kw = dict(loss_agg_mode=mode, rollout_is_weights=is_w)
            loss, grad, met = _run(
                rlmath.get_policy_loss("gspo_token"),
                old,
                logp,
                adv,
                mask,
                norm_length=norm,
                **kw,
                **clip,
            )
            loss_v, grad_v, met_v = _run(
                verl_core.get_policy_loss_fn("gspo"), old, logp, adv, mask.float(), config=cfg, **kw
            )
            assert_close(loss, loss_v, **TOL, msg=f"gspo_token {mode}")
            assert_close(grad, grad_v, **TOL, msg=f"gspo_token {mode} grad")
            _check_metrics(met, met_v, ["pg_clipfrac", "ppo_kl"])


def test_gspo_seq_differs_from_verl_gspo_with_token_advantages():
    # rlmath's `gspo` and `gspo_token` are verl's `gspo` (GSPO-token, per-token
    # advantages); `gspo_seq` is the paper's one-advantage-per-sequence form, an
    # rlmath addition, so with per-token advantages it differs from verl's `gspo`.
    old, logp, adv, mask, _ = make_inputs(0)
    _, grad_seq, _ = _run(rlmath.get_policy_loss("gspo_seq"), old, logp, adv, mask)
    _, grad, _ = _run(rlmath.get_policy_loss("gspo"), old, logp, adv, mask)
    _, grad_v, _ = _run(
        verl_core.get_policy_loss_fn("gspo"), old, logp, adv, mask.float(), config=actor_config()
    )
    assert_close(grad, grad_v, **TOL, msg="gspo grad")
    assert not torch.allclose(grad_seq, grad_v, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mean_clipfrac_sign_aware_documented_difference(seed):
    # docs/design.md "Metrics": pg_clipfrac is sign-aware: rlmath counts a token only
    # where the clip removed its gradient (A > 0 above 1+eps_high, A < 0 below 1-eps_low).
    # verl's GMPO counts every out-of-band token: pg_clipfrac for A > 0 and
    # pg_clipfrac_lower for A < 0, whichever side of the band it is on.
    old, logp, adv, mask, _ = make_inputs(seed)
    adv = adv[:, :1].expand_as(adv).contiguous()
    _, _, met = _run(rlmath.get_policy_loss("geo_mean"), old, logp, adv, mask)
    _, _, met_v = _run(
        verl_core.get_policy_loss_fn("geo_mean"),
        old,
        logp,
        adv,
        mask.float(),
        config=actor_config(),
    )
    lr = logp - old
    n = mask.sum()
    out_of_band = (lr > 0.2) | (lr < -0.2)
    assert_close(met["pg_clipfrac_high"], ((lr > 0.2) & (adv > 0) & mask).sum() / n)
    assert_close(met["pg_clipfrac_low"], ((lr < -0.2) & (adv < 0) & mask).sum() / n)
    assert_close(met_v["actor/pg_clipfrac"], (out_of_band & (adv > 0) & mask).sum() / n)
    assert_close(met_v["actor/pg_clipfrac_lower"], (out_of_band & (adv < 0) & mask).sum() / n)


def test_geo_mean_fully_masked_rows_documented_difference():
    # docs/design.md: fully masked sequences do not count as sequences; verl's GMPO takes
    # torch.mean over all rows, so an empty row dilutes the loss by B/(B-1).
    old, logp, adv, mask, _ = make_inputs(3, empty_row=True)
    adv = adv[:, :1].expand_as(adv).contiguous()
    loss, _, _ = _run(rlmath.get_policy_loss("geo_mean"), old, logp, adv, mask)
    loss_v, _, _ = _run(
        verl_core.get_policy_loss_fn("geo_mean"),
        old,
        logp,
        adv,
        mask.float(),
        config=actor_config(),
    )
    b = mask.shape[0]
    assert_close(loss * (b - 1) / b, loss_v, **TOL)


def test_registry_covers_verl():
    missing = sorted(set(verl_core.POLICY_LOSS_REGISTRY) - set(rlmath.list_policy_losses()))
    # bypass_mode is verl's dispatcher (rollout correction + vanilla/reinforce), not a loss;
    # rlmath exposes the pieces (rollout_correction, vanilla, reinforce) instead.
    assert missing == ["bypass_mode"], missing


# --------------------------------------------------------------------------- value and entropy


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cliprange", [0.2, 0.5, None])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss(mode, cliprange, seed):
    gen = torch.Generator().manual_seed(seed)
    b, t = 5, 10
    mask = random_mask(b, t, gen)
    values = randn(b, t, gen=gen)
    vpreds = values + randn(b, t, gen=gen, scale=0.5)
    returns = values + randn(b, t, gen=gen)
    norm = 10 if mode == "seq-mean-token-sum-norm" else None
    v1, v2 = vpreds.clone().requires_grad_(True), vpreds.clone().requires_grad_(True)
    loss, metrics = rlmath.compute_value_loss(
        v1, returns, values, mask, cliprange_value=cliprange, loss_agg_mode=mode, norm_length=norm
    )
    frac = metrics["vf_clipfrac"]
    # verl has no "off" switch: a huge clip range is the same as no clipping.
    loss_v, frac_v = verl_core.compute_value_loss(
        v2, returns, values, mask.float(), 1e9 if cliprange is None else cliprange, mode
    )
    assert_close(loss, loss_v, **TOL)
    assert_close(frac, frac_v, rtol=1e-6, atol=1e-7)
    loss.backward()
    loss_v.backward()
    assert_close(v1.grad, v2.grad, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_entropy_loss(mode, gen):
    b, t, v = 4, 6, 37
    mask = random_mask(b, t, gen)
    logits = randn(b, t, v, gen=gen, scale=2.0)
    l1, l2 = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    norm = {"norm_length": t} if mode == "seq-mean-token-sum-norm" else {}
    ours, _ = rlmath.compute_entropy_loss(l1, mask, loss_agg_mode=mode, **norm)
    theirs = verl_core.compute_entropy_loss(l2, mask.float(), mode)
    assert_close(ours, theirs, **TOL)
    ours.backward()
    theirs.backward()
    assert_close(l1.grad, l2.grad, **TOL)
