"""Every policy loss against an fp64 formula from its paper, hand-built clip regions, metrics, errors."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import rlmath.losses.registry as policy_loss_registry
from rlmath import (
    clip_cov_selection,
    compute_policy_loss_cispo,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss,
    kl_cov_selection,
    list_policy_losses,
    register_policy_loss,
)

from .helpers import LOSS_KWARGS, MODES, agg_extra, policy_batch, ref_agg
from .reference import REFERENCES, ref_covariance, ref_gspo_sequence, ref_kimi15_sequence_loss

VERL_NAMES = {
    "vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo",
    "dppo_tv", "dppo_kl", "dro",
}  # fmt: skip
NAMES = list_policy_losses()


def _run(name, old, logp, adv, mask, mode, weights=None, **kw):
    leaf = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss(name)(
        old, leaf, adv, mask, loss_agg_mode=mode, **agg_extra(mask),
        rollout_is_weights=weights, **kw,
    )  # fmt: skip
    loss.backward()
    return loss, metrics, leaf.grad


def _reference(name, old, logp, adv, mask, mode, weights=None, **kw):
    leaf = logp.clone().requires_grad_()
    per_token = REFERENCES[name](old, leaf, adv, mask, weights=weights, **kw)
    if weights is not None and name != "geo_mean":
        per_token = {c: v * float(weights[c]) for c, v in per_token.items()}
    want = ref_agg(per_token, mask, mode, mask.shape[1])
    want.backward()
    return want, leaf.grad


def _selection_kwargs(name, old, logp, adv, mask, kw):
    if name == "clip_cov":
        return {"selection": clip_cov_selection(old, logp, adv, mask, **kw)}
    if name == "kl_cov":
        return {"selection": kl_cov_selection(old, logp, adv, mask, **kw)}
    return {}


def test_every_registered_loss_has_an_fp64_reference():
    missing = sorted(set(NAMES) - set(REFERENCES))
    assert not missing, (
        f"no fp64 reference for {missing}: add one to REFERENCES in tests/losses/reference.py"
    )


def test_registry_holds_verls_names_and_ours():
    assert VERL_NAMES <= set(NAMES)
    assert {"gspo_token", "gspo_seq", "reinforce"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_signature_is_uniform(name):
    sig = inspect.signature(get_policy_loss(name))
    params = list(sig.parameters.values())
    assert [p.name for p in params[:4]] == [
        "old_log_prob",
        "log_prob",
        "advantages",
        "response_mask",
    ]
    kw_only = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"loss_agg_mode", "rollout_is_weights", "log_ratio_clamp"} <= kw_only
    assert sig.parameters["rollout_is_weights"].default is None
    # The aggregation arguments arrive as one **aggregation (AggregationKwargs).
    last = params[-1]
    assert last.kind is inspect.Parameter.VAR_KEYWORD and last.name == "aggregation"
    assert "AggregationKwargs" in str(last.annotation)
    fn = get_policy_loss(name)
    old, logp, adv, mask = policy_batch(2, 4, 1)
    kw = dict(LOSS_KWARGS[name])
    fn(old, logp, adv, mask, **kw, global_num_tokens=8, global_num_seqs=2, dp_size=1,
       norm_length=4)  # fmt: skip
    with pytest.raises(TypeError, match="unexpected keyword argument.*'global_num_token'"):
        fn(old, logp, adv, mask, **kw, global_num_token=8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seq_adv", [False, True])
def test_matches_paper_formula_fp64(name, mode, seq_adv):
    old, logp, adv, mask = policy_batch(5, 7, 3 + seq_adv, scale=0.6, seq_adv=seq_adv)
    kw = dict(LOSS_KWARGS[name])
    kw.update(_selection_kwargs(name, old, logp, adv, mask, kw))
    loss, metrics, grad = _run(name, old, logp, adv, mask, mode, **kw)
    want, want_grad = _reference(name, old, logp, adv, mask, mode, **kw)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert (grad[~mask] == 0).all()
    for key, value in metrics.items():
        assert value.dim() == 0 and not value.requires_grad, key


@pytest.mark.parametrize("name", NAMES)
def test_rollout_is_weights_multiply_the_token_loss(name):
    old, logp, adv, mask = policy_batch(4, 6, 8, scale=0.5, seq_adv=True)
    weights = (
        torch.rand(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.2
    )
    kw = dict(LOSS_KWARGS[name])
    kw.update(_selection_kwargs(name, old, logp, adv, mask, kw))
    w_leaf = weights.clone().requires_grad_()
    loss, _, grad = _run(name, old, logp, adv, mask, "seq-mean-token-mean", w_leaf, **kw)
    want, want_grad = _reference(name, old, logp, adv, mask, "seq-mean-token-mean", weights, **kw)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert w_leaf.grad is None  # importance weights are detached


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_compute_in_fp32(name, dtype):
    old, logp, adv, mask = policy_batch(6, 16, 4, scale=0.3, dtype=dtype)
    kw = dict(LOSS_KWARGS[name])
    kw.update(_selection_kwargs(name, old, logp, adv, mask, kw))
    loss, metrics, grad = _run(name, old, logp, adv, mask, "token-mean", **kw)
    # fp64 on the same (rounded) inputs: only the internal precision differs.
    want, want_grad = _reference(
        name, old.double(), logp.double(), adv.double(), mask, "token-mean", **kw
    )
    assert loss.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in metrics.values())
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    # The gradient has the leaf's dtype: one bf16 rounding (2^-8 relative) is all it may lose.
    grad_tol = 1e-4 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(grad.double(), want_grad, rtol=grad_tol, atol=1e-6)


def test_ppo_clip_regions_by_hand():
    # (ratio, A) per token; eps = 0.2, dual-clip c = 3.
    cases = [
        (1.1, 1.0, -1.1, -1.1),  # A > 0 inside the band: loss -rA, gradient -rA
        (1.5, 1.0, -1.2, 0.0),  # A > 0 above 1 + eps: clipped, no gradient
        (0.5, 1.0, -0.5, -0.5),  # A > 0 below 1 - eps: unclipped term is the min
        (0.9, -1.0, 0.9, 0.9),  # A < 0 inside
        (0.5, -1.0, 0.8, 0.0),  # A < 0 below 1 - eps: clipped
        (2.0, -1.0, 2.0, 2.0),  # A < 0 above 1 + eps, below c: unclipped
        (5.0, -1.0, 3.0, 0.0),  # A < 0 above c: dual clip at -cA
        (math.exp(5), 2.0, -2.4, 0.0),  # ratio far outside, A > 0
        (math.exp(-5), -2.0, 1.6, 0.0),  # ratio far outside, A < 0
        (3.0, 0.0, 0.0, 0.0),  # A = 0: nothing
    ]
    ratio = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    logp = old + ratio.log()
    mask = torch.ones_like(ratio, dtype=torch.bool)
    leaf = logp.clone().requires_grad_()
    loss, m = compute_policy_loss_vanilla(old, leaf, adv, mask, loss_agg_mode="token-sum")
    loss.backward()
    assert loss.item() == pytest.approx(sum(c[2] for c in cases))
    torch.testing.assert_close(
        leaf.grad[0], torch.tensor([c[3] for c in cases], dtype=torch.float64)
    )
    n = len(cases)
    assert m["pg_clipfrac_high"].item() == pytest.approx(2 / n)
    assert m["pg_clipfrac_low"].item() == pytest.approx(2 / n)
    assert m["pg_clipfrac"].item() == pytest.approx(4 / n)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / n)
    # Asymmetric ranges (clip-higher): with eps_high = 0.6, token 1 (ratio 1.5) is no longer clipped.
    leaf.grad = None
    loss2, m2 = compute_policy_loss_vanilla(
        old, leaf, adv, mask, loss_agg_mode="token-sum", clip_ratio_high=0.6
    )
    loss2.backward()
    assert leaf.grad[0, 1].item() == pytest.approx(-1.5)
    assert m2["pg_clipfrac_high"].item() == pytest.approx(1 / n)
    # Without dual clip the A < 0, ratio 5 token keeps its gradient.
    leaf.grad = None
    compute_policy_loss_vanilla(old, leaf, adv, mask, loss_agg_mode="token-sum", clip_ratio_c=None)[
        0
    ].backward()
    assert leaf.grad[0, 6].item() == pytest.approx(5.0)


def test_gspo_sequence_ratio_one_does_not_clip_while_ppo_does():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor([[0.5, -0.5]], dtype=torch.float64)  # token ratios e^±0.5
    adv = torch.ones_like(old)
    mask = torch.ones_like(old, dtype=torch.bool)
    for name in ("gspo", "gspo_token", "gspo_seq"):
        loss, m, grad = _run(name, old, logp, adv, mask, "seq-mean-token-mean")
        assert loss.item() == pytest.approx(-1.0)  # s = exp(mean log-ratio) = 1
        torch.testing.assert_close(grad, torch.full_like(grad, -0.5))
        assert m["pg_clipfrac"].item() == 0.0
    loss, m, grad = _run("vanilla", old, logp, adv, mask, "seq-mean-token-mean")
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == pytest.approx(-math.exp(-0.5) / 2)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("mode", MODES)
def test_gspo_gradient_is_the_sequence_level_gradient(mode):
    """Per-token straight-through == the true gradient of the per-sequence GSPO loss."""
    old, logp, adv, mask = policy_batch(6, 7, 31, scale=0.6)
    loss, _, grad = _run("gspo_seq", old, logp, adv, mask, mode)
    leaf = logp.clone().requires_grad_()
    want = ref_agg(ref_gspo_sequence(old, leaf, adv, mask), mask, mode, mask.shape[1])
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-12)


def test_gspo_ignores_padding_in_the_sequence_ratio():
    old = torch.tensor([[-1.0, -1.0, 0.0]], dtype=torch.float64)
    logp = torch.tensor([[-0.9, -1.1, 50.0]], dtype=torch.float64)  # padding holds garbage
    adv = torch.ones_like(old)
    mask = torch.tensor([[True, True, False]])
    loss, m = compute_policy_loss_gspo(old, logp, adv, mask)
    assert loss.item() == pytest.approx(-1.0)
    assert m["seq_log_ratio_mean"].item() == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_huge_log_ratio_with_zero_advantage(name):
    old = torch.tensor([[-1e4, -1.0, -3.0], [-1.0, -1e4, -2.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -1e4, -3.0], [-1e4, -1.0, -2.5]], dtype=torch.float64)
    adv = torch.zeros_like(old)
    mask = torch.ones_like(old, dtype=torch.bool)
    for mode in MODES:
        loss, m, grad = _run(name, old, logp, adv, mask, mode, **LOSS_KWARGS[name])
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in m.values())
        assert m["log_ratio_clamped_frac"].item() == pytest.approx(4 / 6)
        if name not in ("dro", "kl_cov", "kimi15", "ipo"):  # log-ratio penalties need no A
            assert loss.item() == 0.0
            assert (grad == 0).all()


def test_cispo_keeps_every_gradient_and_trl_variant():
    old = torch.zeros(1, 3, dtype=torch.float64) - 2
    logp = old + torch.tensor([[math.log(2.0), math.log(0.5), 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m, grad = _run("cispo", old, logp, adv, mask, "token-sum")
    torch.testing.assert_close(grad, -torch.tensor([[1.2, 0.8, 1.0]], dtype=torch.float64))
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 3)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 3)
    # TRL: truncation from above only (here at 1 + 0.2).
    loss, m, grad = _run("cispo", old, logp, adv, mask, "token-sum", upper_only=True)
    torch.testing.assert_close(grad, -torch.tensor([[1.2, 0.5, 1.0]], dtype=torch.float64))
    assert m["pg_clipfrac_low"].item() == 0.0
    with pytest.raises(TypeError, match="upper_only"):
        compute_policy_loss_cispo(old, logp, adv, mask, upper_only=1)


def test_dppo_trust_region_by_hand():
    # p_old = 0.5 for every token; p moves to 0.9 (TV 0.4 > 0.2) or 0.6 (TV 0.1).
    old = torch.full((1, 4), math.log(0.5), dtype=torch.float64)
    logp = torch.log(torch.tensor([[0.9, 0.6, 0.9, 0.1]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, m, grad = _run("dppo_tv", old, logp, adv, mask, "token-sum")
    # token 0: A > 0 and p rose by 0.4 -> masked. token 2: A < 0, p rose -> kept.
    # token 3: A < 0 and p fell by 0.4 -> masked.
    assert grad[0, 0].item() == 0.0 and grad[0, 3].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-1.2)  # -A * min(r, c) with r = 1.2
    assert grad[0, 2].item() == pytest.approx(1.8)  # r = 1.8 < c = 3
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 4)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 4)
    # Truncation: with c = 1.5, token 2's weight is 1.5 and it is counted.
    _, m, grad = _run("dppo_tv", old, logp, adv, mask, "token-sum", clip_ratio_c=1.5)
    assert grad[0, 2].item() == pytest.approx(1.5)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 4)


def test_clip_cov_selection_on_device_semantics():
    old, logp, adv, mask = policy_batch(8, 10, 21, scale=0.5)
    kw = {"clip_cov_lb": -1.0, "clip_cov_ub": 1.0}
    cov = ref_covariance(adv, logp, mask)
    r = torch.exp(logp - old)
    clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
    candidates = {c for c, v in cov.items() if -1.0 < v < 1.0 and not clipped[c]}
    # Ratio 1: k = N >= #candidates, so every candidate is chosen.
    everything = clip_cov_selection(old, logp, adv, mask, clip_cov_ratio=1.0, **kw)
    assert {tuple(c) for c in everything.nonzero().tolist()} == candidates
    # Ratio 0.1: exactly max(floor(0.1 N), 1) candidates, reproducible with the generator.
    k = max(int(0.1 * int(mask.sum())), 1)
    picks = [
        clip_cov_selection(
            old,
            logp,
            adv,
            mask,
            clip_cov_ratio=0.1,
            generator=torch.Generator().manual_seed(s),
            **kw,
        )
        for s in (0, 0, 1, 2, 3)
    ]
    for p in picks:
        assert int(p.sum()) == k
        assert {tuple(c) for c in p.nonzero().tolist()} <= candidates
    assert torch.equal(picks[0], picks[1])
    assert any(not torch.equal(picks[0], p) for p in picks[2:])
    # The loss with the same generator state makes the same choice.
    loss_a, _, _ = _run("clip_cov", old, logp, adv, mask, "token-mean", clip_cov_ratio=0.1,
                        generator=torch.Generator().manual_seed(0), **kw)  # fmt: skip
    loss_b, _, _ = _run("clip_cov", old, logp, adv, mask, "token-mean", clip_cov_ratio=0.1,
                        selection=picks[0], **kw)  # fmt: skip
    assert loss_a.item() == loss_b.item()


def test_kl_cov_selection_is_the_top_k_covariance():
    old, logp, adv, mask = policy_batch(8, 10, 22, scale=0.5)
    cov = ref_covariance(adv, logp, mask)
    for ratio in (1e-4, 0.1, 0.5):
        k = max(int(ratio * len(cov)), 1)
        want = set(sorted(cov, key=cov.get, reverse=True)[:k])
        got = kl_cov_selection(old, logp, adv, mask, kl_cov_ratio=ratio)
        assert {tuple(c) for c in got.nonzero().tolist()} == want


def test_kl_cov_ties_broken_by_generator():
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    adv = torch.zeros(2, 4, dtype=torch.float64)  # every covariance is 0: all tie
    mask = torch.ones(2, 4, dtype=torch.bool)
    picks = {
        tuple(kl_cov_selection(old, old, adv, mask, kl_cov_ratio=0.25,
                               generator=torch.Generator().manual_seed(s)).flatten().tolist())
        for s in range(8)
    }  # fmt: skip
    assert len(picks) > 1 and all(sum(p) == 2 for p in picks)
    plain = kl_cov_selection(old, old, adv, mask, kl_cov_ratio=0.25)
    assert plain.flatten().tolist()[:2] == [True, True]  # ties by position without generator


def test_register_policy_loss(monkeypatch):
    # A copy of the registry for this test: later tests see the library's losses only.
    monkeypatch.setattr(policy_loss_registry, "_REGISTRY", dict(policy_loss_registry._REGISTRY))

    @register_policy_loss("test_only_loss")
    def my_loss(old_log_prob, log_prob, advantages, response_mask, **kw):
        return (log_prob * 0).sum(), {}

    assert get_policy_loss("test_only_loss") is my_loss
    assert "test_only_loss" in list_policy_losses()
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("test_only_loss")(lambda *a, **k: None)
    register_policy_loss("test_only_loss", override=True)(compute_policy_loss_vanilla)
    assert get_policy_loss("test_only_loss") is compute_policy_loss_vanilla
    with pytest.raises(TypeError, match="callable"):
        register_policy_loss("other_name")(3)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'") as err:
        get_policy_loss("ppo")
    assert "vanilla" in str(err.value) and "gspo_token" in str(err.value)
    with pytest.raises(ValueError, match="rollout_correction"):
        get_policy_loss("bypass_mode")


BAD = [
    ("vanilla", {"clip_ratio": -0.1}, ValueError, "clip_ratio"),
    ("vanilla", {"clip_ratio_low": -0.1}, ValueError, "clip_ratio_low"),
    ("vanilla", {"clip_ratio_high": -1.0}, ValueError, "clip_ratio_high"),
    ("vanilla", {"clip_ratio_c": 1.0}, ValueError, "clip_ratio_c"),
    ("vanilla", {"clip_ratio_c": 0.5}, ValueError, "clip_ratio_c"),
    ("vanilla", {"log_ratio_clamp": 0.0}, ValueError, "log_ratio_clamp"),
    ("vanilla", {"loss_agg_mode": "mean"}, ValueError, "loss_agg_mode"),
    ("vanilla", {"dp_size": 2}, ValueError, "global_num_tokens"),
    ("gspo", {"clip_ratio_low": float("nan")}, ValueError, "clip_ratio_low"),
    ("cispo", {"clip_ratio_high": -0.2}, ValueError, "clip_ratio_high"),
    ("sapo", {"tau_pos": 0.0}, ValueError, "tau_pos"),
    ("sapo", {"tau_neg": -1.0}, ValueError, "tau_neg"),
    ("dro", {}, ValueError, "dro_beta"),
    ("dro", {"dro_beta": 0.0}, ValueError, "dro_beta"),
    ("clip_cov", {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, ValueError, "clip_cov_lb"),
    ("clip_cov", {"clip_cov_ratio": 0.0}, ValueError, "clip_cov_ratio"),
    ("kl_cov", {"kl_cov_ratio": 2.0}, ValueError, "kl_cov_ratio"),
    ("kl_cov", {"ppo_kl_coef": -1.0}, ValueError, "ppo_kl_coef"),
    ("dppo_tv", {"clip_ratio_c": 0.0}, ValueError, "clip_ratio_c"),
    ("dppo_kl", {"clip_ratio": -0.5}, ValueError, "clip_ratio"),
    ("geo_mean", {"clip_ratio_high": -0.5}, ValueError, "clip_ratio_high"),
    ("clip_cov", {"selection": torch.ones(2, 3)}, TypeError, "selection"),
    ("two_sided_clip", {"delta": 1.2}, ValueError, "delta"),
    ("two_sided_clip", {"delta": 2.0, "clip_ratio_high": 1.5}, ValueError, "delta"),
    ("luspo", {"clip_ratio": -0.2}, ValueError, "clip_ratio"),
    ("topr", {"ratio_level": "geometric"}, ValueError, "ratio_level"),
    ("topr", {"positive_weight": -1.0}, ValueError, "positive_weight"),
    ("topr", {"negative_weight": float("inf")}, ValueError, "negative_weight"),
    ("kimi15", {"tau": 0.0}, ValueError, "tau"),
    ("kimi15", {"penalty_level": "seq"}, ValueError, "penalty_level"),
    ("ipo", {"ipo_threshold": -0.1}, ValueError, "ipo_threshold"),
    ("ipo", {"adv_tau": -1.0}, ValueError, "adv_tau"),
    ("ipo", {"kl_tau": float("nan")}, ValueError, "kl_tau"),
    ("kl_cov", {"selection": torch.ones(3, 2, dtype=torch.bool)}, ValueError, "selection"),
]


@pytest.mark.parametrize(("name", "kw", "exc", "match"), BAD)
def test_bad_scalars(name, kw, exc, match):
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(exc, match=match):
        get_policy_loss(name)(x, x, x, m, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_bad_tensors(name):
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    kw = LOSS_KWARGS[name]
    fn = get_policy_loss(name)
    with pytest.raises(ValueError, match="old_log_prob must have the shape of log_prob"):
        fn(torch.zeros(2, 4), x, x, m, **kw)
    with pytest.raises(ValueError, match="advantages"):
        fn(x, x, torch.zeros(3), m, **kw)
    with pytest.raises(ValueError, match="response_mask"):
        fn(x, x, x, torch.ones(3, 2), **kw)
    with pytest.raises(TypeError, match="log_prob"):
        fn(x, torch.zeros(2, 3, dtype=torch.long), x, m, **kw)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        fn(x, x, x, m, rollout_is_weights=torch.ones(3, 3), **kw)


# The losses whose value depends on log π only through the ratio π/π_old (the
# others multiply log π itself, which is -inf there (reinforce, cispo, ...), or
# select tokens by statistics of log π (clip_cov, kl_cov)).
RATIO_LOSSES = [
    "vanilla", "gspo", "gspo_token", "gspo_seq", "sapo", "geo_mean", "two_sided_clip", "luspo",
]  # fmt: skip


@pytest.mark.parametrize("name", RATIO_LOSSES)
def test_infinite_log_ratio_on_a_valid_token_is_clamped_like_vanilla(name):
    """log π = −inf (or log π_old = −inf) on a valid token: the log-ratio is clamped to ±20
    before any exp, so the loss equals the one with a finite log-ratio beyond the clamp
    (±25 here), gradient included. GSPO's sequence mean and straight-through term used to
    give inf − inf = NaN."""
    inf = float("inf")
    old = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -inf, -2.0]], dtype=torch.float64)
    logp = torch.tensor([[-inf, -1.2, -2.0], [-1.1, -0.5, -1.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -0.5, 0.3], [-1.0, 0.7, 0.2]], dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    finite_old, finite_logp = old.clone(), logp.clone()
    finite_logp[0, 0] = old[0, 0] - 25  # log-ratio −25
    finite_old[1, 1] = logp[1, 1] - 25  # log-ratio +25
    for mode in MODES:
        loss, m, grad = _run(name, old, logp, adv, mask, mode, **LOSS_KWARGS[name])
        want, m_want, grad_want = _run(
            name, finite_old, finite_logp, adv, mask, mode, **LOSS_KWARGS[name]
        )
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (name, mode)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)
        torch.testing.assert_close(grad, grad_want, rtol=1e-12, atol=0)
        for k, v in m.items():
            torch.testing.assert_close(v, m_want[k], rtol=1e-12, atol=0)
        assert m["log_ratio_clamped_frac"].item() == pytest.approx(2 / 6)


def _hand(ratios, advs):
    """One row of tokens with the given ratios and advantages, log π_old = −1."""
    ratio = torch.tensor([ratios], dtype=torch.float64)
    adv = torch.tensor([advs], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    return old, old + ratio.log(), adv, torch.ones_like(ratio, dtype=torch.bool)


def test_two_sided_clip_by_hand():
    # δ = 4, ε = 0.2. (r, A): (5, −1) beyond δ: loss −δA = 4, no gradient; (3, −1) below δ:
    # the unclipped −rA = 3, gradient −A·r = 3; (5, +1) above 1 + ε: −1.2, no gradient.
    old, logp, adv, mask = _hand([5.0, 3.0, 5.0], [-1.0, -1.0, 1.0])
    loss, m, grad = _run("two_sided_clip", old, logp, adv, mask, "token-sum", delta=4.0)
    assert loss.item() == pytest.approx(4.0 + 3.0 - 1.2)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 3.0, 0.0]], dtype=torch.float64))
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    # It is vanilla's dual clip with c = δ, token for token.
    want, _, want_grad = _run("vanilla", old, logp, adv, mask, "token-sum", clip_ratio_c=4.0)
    assert loss.item() == want.item() and torch.equal(grad, want_grad)


def test_luspo_weights_each_sequence_by_its_length():
    # Sequence 0: 2 tokens, log-ratios ±0.1 → s = 1, A = 1: GSPO loss −1, times |y| = 2: −2.
    # Sequence 1: 3 tokens, log-ratios 0 → s = 1, A = −1: loss 1, times 3: 3.
    # LUSPO = (−2 + 3)/2 = 0.5; GSPO's mean over sequences = (−1 + 1)/2 = 0.
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logp = old + torch.tensor([[0.1, -0.1, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    luspo, _ = get_policy_loss("luspo")(old, logp, adv, mask)
    gspo, _ = get_policy_loss("gspo")(old, logp, adv, mask)
    assert luspo.item() == pytest.approx(0.5) and gspo.item() == pytest.approx(0.0)


def test_topr_by_hand():
    # Sequence 0: A = +1 (positive: plain update, gradient −A = −1 per token, whatever r).
    # Sequence 1: A = −1, token log-ratios −0.5, −0.5: ρ = e^{−1} < 1, gradient −ρ·A = e^{−1}.
    # Sequence 2: A = −1, log-ratios +0.5, +0.5: ρ = e^{1} truncated to 1: gradient 1.
    lr = torch.tensor([[1.0, 1.0], [-0.5, -0.5], [0.5, 0.5]], dtype=torch.float64)
    old = torch.full_like(lr, -2.0)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones_like(lr, dtype=torch.bool)
    _, m, grad = _run("topr", old, old + lr, adv, mask, "token-sum")
    e = math.exp(-1.0)
    want = torch.tensor([[-1.0, -1.0], [e, e], [1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=1e-15, atol=0)
    assert m["pg_clipfrac_low"].item() == pytest.approx(2 / 6)
    # ROLL's token-level ratio: sequence 1's tokens each get e^{−0.5}; weights scale the parts.
    _, _, grad = _run("topr", old, old + lr, adv, mask, "token-sum", ratio_level="token",
                      positive_weight=2.0, negative_weight=0.5)  # fmt: skip
    h = 0.5 * math.exp(-0.5)
    want = torch.tensor([[-2.0, -2.0], [h, h], [0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(grad, want, rtol=1e-15, atol=0)


def test_kimi15_penalty_levels():
    old, logp, adv, mask = policy_batch(5, 7, 41, scale=0.5, seq_adv=True)
    # The token form is verl's dro with dro_beta = τ.
    for mode in MODES:
        a, _, ga = _run("kimi15", old, logp, adv, mask, mode, tau=0.3)
        b, _, gb = _run("dro", old, logp, adv, mask, mode, dro_beta=0.3)
        torch.testing.assert_close(a, b, rtol=1e-15, atol=1e-15)
        torch.testing.assert_close(ga, gb, rtol=1e-15, atol=1e-15)
    # Hand-worked sequence form: log-ratios 0.2 and 0.1, A = 0, τ = 0.1: S = 0.3, the loss
    # (τ/2)·S² = 0.0045 and each token's gradient τ·S = 0.03 (d/d log π_t of (τ/2)·S²).
    o = torch.full((1, 2), -1.0, dtype=torch.float64)
    lp = o + torch.tensor([[0.2, 0.1]], dtype=torch.float64)
    z, ones = torch.zeros_like(o), torch.ones_like(o, dtype=torch.bool)
    loss, _, grad = _run("kimi15", o, lp, z, ones, "token-sum", penalty_level="sequence")
    assert loss.item() == pytest.approx(0.0045, rel=1e-13)
    torch.testing.assert_close(grad, torch.full_like(grad, 0.03), rtol=1e-13, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_kimi15_sequence_penalty_is_the_papers_per_sample_loss(mode):
    """Spread over tokens, the sequence penalty has the value and gradient of (τ/2)·S²."""
    # Every mode is linear in each sequence's token sum, so the per-sample loss may sit
    # on one token of the reference.
    old, logp, adv, mask = policy_batch(6, 7, 43, scale=0.6, seq_adv=True)
    loss, _, grad = _run("kimi15", old, logp, adv, mask, mode, penalty_level="sequence", tau=0.2)
    leaf = logp.clone().requires_grad_()
    want = ref_agg(ref_kimi15_sequence_loss(old, leaf, adv, mask, tau=0.2), mask, mode, 7)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-12, atol=1e-12)


def test_ipo_trust_region_by_hand():
    # p_old = 0.5 for every token. p = 0.7 (|Δp| = 0.2 > 0.1: policy term removed),
    # p = 0.55 (kept), p = 0.3 with A < 0 (|Δp| = 0.2: removed). kl_tau = 0.01.
    old = torch.full((1, 3), math.log(0.5), dtype=torch.float64)
    logp = torch.log(torch.tensor([[0.7, 0.55, 0.3]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m, grad = _run("ipo", old, logp, adv, mask, "token-sum", kl_tau=0.01)
    lr = [math.log(1.4), math.log(1.1), math.log(0.6)]
    # Loss: −A·r on the kept token (r = 1.1) plus 0.01·(log r)² on every token.
    assert loss.item() == pytest.approx(-1.1 + 0.01 * sum(x * x for x in lr), rel=1e-13)
    # Gradient: −A·r on the kept token, 2·0.01·log r from the penalty everywhere.
    want = [0.02 * lr[0], -1.1 + 0.02 * lr[1], 0.02 * lr[2]]
    torch.testing.assert_close(grad[0], torch.tensor(want, dtype=torch.float64))
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 3)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 3)
    assert m["ipo_masked_frac"].item() == pytest.approx(2 / 3)


OPTION_CASES = [
    ("kimi15", {"penalty_level": "sequence", "tau": 0.4}),
    ("topr", {"ratio_level": "token"}),
    ("topr", {"positive_weight": 0.5, "negative_weight": 2.0}),
    ("ipo", {"ipo_threshold": 0.2, "adv_tau": 0.5, "kl_tau": 0.1}),
    ("two_sided_clip", {"delta": 2.0, "clip_ratio": 0.3}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "kw"), OPTION_CASES, ids=lambda x: str(x))
def test_options_match_the_reference(name, kw, mode):
    old, logp, adv, mask = policy_batch(5, 7, 17, scale=0.7)
    loss, _, grad = _run(name, old, logp, adv, mask, mode, **kw)
    want, want_grad = _reference(name, old, logp, adv, mask, mode, **kw)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(0, 6), (3, 0)])
def test_empty_batch_gives_zero(name, shape):
    """An empty micro-batch (B = 0 on a rank, or T = 0) gives a loss of 0, a zero gradient
    and finite 0-d metrics, in every mode."""
    old = torch.zeros(shape, dtype=torch.float64)
    adv = torch.zeros(shape, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    kw = dict(LOSS_KWARGS[name])
    if name in ("clip_cov", "kl_cov"):
        kw["selection"] = torch.zeros(shape, dtype=torch.bool)
    for mode in MODES:
        leaf = old.clone().requires_grad_()
        loss, metrics = get_policy_loss(name)(
            old, leaf, adv, mask, loss_agg_mode=mode, **agg_extra(mask, 6), **kw
        )
        loss.backward()
        assert loss.item() == 0.0 and leaf.grad.shape == shape, mode
        assert all(v.dim() == 0 and torch.isfinite(v) for v in metrics.values()), mode
