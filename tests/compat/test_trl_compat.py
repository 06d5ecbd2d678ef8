"""rlmath.compat.trl against float64 references written from TRL's definitions (no TRL needed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmath.compat import trl as ct
from tests.host_sync import forbid_host_reads


def test_selective_log_softmax_and_entropy_against_float64():
    g = torch.Generator().manual_seed(0)
    logits64 = torch.randn(3, 5, 300, generator=g, dtype=torch.float64) * 4
    index = torch.randint(0, 300, (3, 5), generator=g)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 2e-5)):
        logits = logits64.to(dtype)
        ref_in = logits.double()  # the fp64 reference of the same (rounded) inputs
        logp = torch.log_softmax(ref_in, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        p = torch.softmax(ref_in, -1)
        ent = -(p * torch.log(p)).sum(-1)
        out = ct.selective_log_softmax(logits, index)
        assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(out.double(), logp, rtol=tol, atol=tol)
        for chunk in (1, 4, 128):
            h = ct.entropy_from_logits(logits, chunk_size=chunk)
            assert h.dtype == out.dtype and h.shape == (3, 5)
            torch.testing.assert_close(h.double(), ent, rtol=tol, atol=tol)
    # One row (TRL accepts logits of shape (V,)).
    h = ct.entropy_from_logits(logits64[0, 0])
    assert h.shape == ()


def test_gradients_flow():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 20, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 20, (2, 3), generator=g)
    torch.autograd.gradcheck(lambda x: ct.selective_log_softmax(x, index), (logits,))
    torch.autograd.gradcheck(lambda x: ct.entropy_from_logits(x, 2), (logits,))


# ------------------------------------------------------------------------- grpo_loss


def trl_reference(logp, old, adv, mask, *, loss_type, eps=0.2, eps_high=None, delta=None,
                  level="token", beta=0.0, ref=None, bias_kl=False, isr=None, L=None,
                  n_items=None, P=1, G=1, tau_pos=1.0, tau_neg=1.05,
                  k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):  # fmt: skip
    """TRL GRPOTrainer._compute_loss, written from its definitions in float64."""
    eh = eps if eps_high is None else eps_high
    m = mask.double()
    lr = logp - old
    if level == "token":
        liw = lr
    else:
        liw = (lr * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    coef1 = torch.exp(liw)
    if loss_type == "cispo":
        per = -coef1.clamp(max=eh).detach() * adv * logp
    elif loss_type == "sapo":
        f64 = torch.float64
        tau = torch.where(
            adv > 0, torch.tensor(tau_pos, dtype=f64), torch.tensor(tau_neg, dtype=f64)
        )
        per = -torch.sigmoid(tau * (coef1 - 1)) * 4 / tau * adv
    elif loss_type == "vespo":
        seq = (lr.clamp(-20, 20) * m).sum(-1, keepdim=True)
        if isr is not None:
            seq = seq + torch.log(torch.where(mask, isr, 1.0)).clamp(math.log(1e-8), 20).sum(
                -1, keepdim=True
            )
        log_w = seq.clamp(math.log(1e-8), 20)
        nonneg = adv >= 0
        f64 = torch.float64
        k = torch.where(nonneg, torch.tensor(k_pos, dtype=f64), torch.tensor(k_neg, dtype=f64))
        lam = torch.where(
            nonneg, torch.tensor(lam_pos, dtype=f64), torch.tensor(lam_neg, dtype=f64)
        )
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        per = -phi.detach() * adv * logp
    else:
        c2 = coef1.clamp(1 - eps, 1 + eh)
        c1 = coef1 if delta is None else coef1.clamp(max=delta)
        per = -torch.minimum(c1 * adv, c2 * adv)
    if isr is not None and loss_type != "vespo":
        per = per * isr
    if beta:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if bias_kl:
            kl = kl * coef1
        per = per + beta * kl
    per = per.expand(mask.shape) * m
    B = mask.shape[0]
    if loss_type in ("grpo", "sapo"):
        return (per.sum(-1) / m.sum(-1).clamp(min=1)).mean() / G
    if loss_type == "bnpo":
        return per.sum() / m.sum().clamp(min=1) / G
    if loss_type == "dr_grpo":
        return per.sum() / (B * L) / G
    if loss_type == "luspo":
        return per.sum() / B / G
    n = m.sum() if n_items is None else torch.tensor(float(n_items))
    return per.sum() / (n.clamp(min=1) / P)


def batch(seed, b=6, t=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    mask[2] = False  # a row without valid tokens
    ref = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.2
    isr = torch.rand(b, t, generator=g, dtype=torch.float64) * 0.5 + 0.75
    return logp, old, adv, mask, ref, isr


CASES = [
    ("grpo", {}),
    ("grpo", {"level": "sequence", "eps": 0.003, "eps_high": 0.004}),
    ("grpo", {"delta": 1.5, "G": 2}),
    ("bnpo", {"G": 3}),
    ("dr_grpo", {"L": 12}),
    ("dapo", {"eps_high": 0.28, "n_items": 70, "P": 4}),
    ("dapo", {"level": "sequence", "eps": 0.01}),
    ("dapo", {"beta": 0.04, "bias_kl": True, "isr": True}),
    ("cispo", {"eps_high": 1.1}),
    ("sapo", {"tau_pos": 1.2, "tau_neg": 2.0, "isr": True}),
    ("luspo", {"level": "sequence", "eps": 0.01, "G": 2}),
    ("vespo", {}),
    ("vespo", {"isr": True, "k_pos": 1.5, "lam_neg": 1.0}),
    ("bnpo", {"beta": 0.1}),
]

RENAME = {
    "eps": "epsilon", "eps_high": "epsilon_high", "level": "importance_sampling_level",
    "bias_kl": "use_bias_correction_kl", "L": "max_completion_length", "n_items": "num_items_in_batch",
    "P": "num_processes", "G": "gradient_accumulation_steps", "tau_pos": "sapo_temperature_pos",
    "tau_neg": "sapo_temperature_neg", "k_pos": "vespo_k_pos", "lam_pos": "vespo_lambda_pos",
    "k_neg": "vespo_k_neg", "lam_neg": "vespo_lambda_neg",
}  # fmt: skip


@pytest.mark.parametrize(
    "loss_type, kw", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(v)
)
def test_grpo_loss_matches_trls_definition(loss_type, kw):
    logp, old, adv, mask, ref, isr = batch(2)
    kw = dict(kw)
    ref_kw = dict(kw)
    if kw.pop("isr", False):
        ref_kw["isr"] = isr
        kw["importance_sampling_ratio"] = isr
    if kw.get("beta"):
        ref_kw["ref"] = ref
        kw["ref_per_token_logps"] = ref
    ours_kw = {RENAME.get(k, k): v for k, v in kw.items()}
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss, metrics = ct.grpo_loss(a, old, adv, mask, loss_type=loss_type, **ours_kw)
    expected = trl_reference(b, old, adv.unsqueeze(-1), mask, loss_type=loss_type, **ref_kw)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(
            metrics
        )
        torch.testing.assert_close(
            metrics["clip_ratio/region_mean"],
            metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"],
        )
    if kw.get("beta"):
        assert "kl" in metrics


def test_clip_metrics_count_what_trl_counts():
    logp, old, adv, mask, _, _ = batch(3)
    _, m = ct.grpo_loss(logp, old, adv, mask, loss_type="dapo", epsilon=0.1, epsilon_high=0.15)
    r = torch.exp(logp - old)
    a = adv.unsqueeze(-1).expand_as(r)
    low = ((r < 0.9) & (a < 0))[mask].double().mean()
    high = ((r > 1.15) & (a > 0))[mask].double().mean()
    assert 0 < low < 1 and 0 < high < 1
    torch.testing.assert_close(m["clip_ratio/low_mean"], low.float())
    torch.testing.assert_close(m["clip_ratio/high_mean"], high.float())
    _, m = ct.grpo_loss(logp, old, adv, mask, loss_type="cispo", epsilon_high=1.1)
    torch.testing.assert_close(m["cispo_clip_ratio"], ((r > 1.1) & (a > 0))[mask].float().mean())


def test_defaults_are_trls():
    logp, old, adv, mask, _, _ = batch(4)
    loss, _ = ct.grpo_loss(logp, old, adv, mask)  # dapo, epsilon 0.2, local token count
    expected = trl_reference(logp, old, adv.unsqueeze(-1), mask, loss_type="dapo")
    torch.testing.assert_close(loss, expected)
    # On-policy: old_per_token_logps=None is the detached current log-probs (ratio 1).
    loss, _ = ct.grpo_loss(logp, None, adv, mask, loss_type="grpo")
    expected = trl_reference(logp, logp.detach(), adv.unsqueeze(-1), mask, loss_type="grpo")
    torch.testing.assert_close(loss, expected)


@settings(max_examples=20, deadline=None)
@given(
    junk=st.sampled_from([float("nan"), float("inf"), 1e30]),
    loss_type=st.sampled_from(ct.TRL_LOSS_TYPES),
)
def test_masked_positions_change_nothing(junk, loss_type):
    logp, old, adv, mask, _, _ = batch(5)
    kw = {"max_completion_length": 9} if loss_type == "dr_grpo" else {}
    if loss_type == "luspo":
        kw["importance_sampling_level"] = "sequence"
    if loss_type == "cispo":
        kw["epsilon_high"] = 2.0
    clean, _ = ct.grpo_loss(logp, old, adv, mask, loss_type=loss_type, **kw)
    dirty, _ = ct.grpo_loss(
        torch.where(mask, logp, junk),
        torch.where(mask, old, -junk),
        adv,
        mask,
        loss_type=loss_type,
        **kw,
    )
    torch.testing.assert_close(clean, dirty, rtol=0, atol=0)


def test_no_host_reads_and_inputs_unchanged():
    logp, old, adv, mask, ref, isr = batch(6)
    copies = [x.clone() for x in (logp, old, adv, mask, ref, isr)]
    with forbid_host_reads():
        for loss_type in ct.TRL_LOSS_TYPES:
            kw = {"max_completion_length": 9} if loss_type == "dr_grpo" else {}
            if loss_type == "luspo":
                kw["importance_sampling_level"] = "sequence"
            if loss_type == "cispo":
                kw["epsilon_high"] = 2.0
            ct.grpo_loss(
                logp, old, adv, mask, loss_type=loss_type, beta=0.1, ref_per_token_logps=ref,
                importance_sampling_ratio=isr, **kw,
            )  # fmt: skip
    for x, c in zip((logp, old, adv, mask, ref, isr), copies):
        assert torch.equal(x, c)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"loss_type": "ppo"}, ValueError, "loss_type"),
        ({"importance_sampling_level": "seq"}, ValueError, "importance_sampling_level"),
        ({"loss_type": "luspo"}, ValueError, "luspo"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, ValueError, "vespo"),
        ({"loss_type": "cispo", "importance_sampling_level": "sequence"}, ValueError, "cispo"),
        ({"loss_type": "dr_grpo"}, ValueError, "max_completion_length"),
        ({"delta": 1.1}, ValueError, "delta"),
        ({"beta": 0.1}, ValueError, "ref_per_token_logps"),
        ({"loss_type": "cispo", "epsilon_high": 0.5}, ValueError, "epsilon_high"),
        ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
        ({"epsilon": -0.1}, ValueError, "epsilon"),
    ],
)
def test_bad_arguments(kw, error, match):
    logp, old, adv, mask, _, _ = batch(7)
    with pytest.raises(error, match=match):
        ct.grpo_loss(logp, old, adv, mask, **kw)


def test_bad_tensors():
    logp, old, adv, mask, _, _ = batch(8)
    with pytest.raises(ValueError, match="advantages"):
        ct.grpo_loss(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match="completion_mask"):
        ct.grpo_loss(logp, old, adv, mask[:, :3])
    with pytest.raises(ValueError, match="per_token_logps"):
        ct.grpo_loss(logp[0], old[0], adv, mask[0])
