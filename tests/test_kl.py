"""KL estimators: closed forms, precision, straight-through gradients, and what each
estimator's expected gradient is, by exact enumeration over a categorical distribution."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import KL_ESTIMATORS, kl_penalty, masked_mean

BASE_NAMES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
PLUS_NAMES = [n + "+" for n in BASE_NAMES]
CANONICAL = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3"}
CANONICAL["low_var_kl"] = "k3"

# ---------------------------------------------------------------- references (Python floats)


def k3_series(x):
    """e^x − 1 − x = Σ_{n≥2} x^n / n!, summed smallest-last: accurate to rounding for |x| < 1."""
    terms = [x**n / math.factorial(n) for n in range(2, 30)]
    return math.fsum(terms)


def ref_value(name, logp, ref, k3_max=10.0, clamp=20.0):
    """The estimator's value from its definition, d = log π − log π_ref."""
    base = CANONICAL[name.rstrip("+")]
    d = logp - ref
    if base == "k1":
        return d
    if base == "abs":
        return abs(d)
    if base == "k2":
        return 0.5 * d * d
    x = min(max(-d, -clamp), clamp)  # log(π_ref/π), clamped
    k3 = k3_series(x) if abs(x) < 1 else math.exp(x) - 1.0 - x
    return k3 if k3_max is None else min(k3, k3_max)


def ref_grad_logp(name, logp, ref, k3_max=10.0):
    """∂ value / ∂ logprob from the definition (∂/∂ref_logprob is its negative)."""
    d = logp - ref
    if name.endswith("+"):
        return d  # k2's gradient
    base = CANONICAL[name]
    if base == "k1":
        return 1.0
    if base == "abs":
        return math.copysign(1.0, d) if d != 0 else 0.0
    if base == "k2":
        return d
    if k3_max is not None and ref_value("k3", logp, ref, k3_max=None) > k3_max:
        return 0.0  # the clamp's dead zone
    return 1.0 - math.exp(-d)


FIXED_LOGP = [-1.0, -2.0, -0.5, -3.0, -0.1, -4.0, -0.7]
FIXED_REF = [-1.5, -1.0, -0.5, -0.2, -0.1 - 1e-6, -0.05, -2.9]


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", BASE_NAMES + PLUS_NAMES)
def test_closed_form_values_and_gradients_fp64(name):
    logp = torch.tensor(FIXED_LOGP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(FIXED_REF, dtype=torch.float64, requires_grad=True)
    out = kl_penalty(logp, ref, name)
    assert out.dtype == torch.float64
    expected = [ref_value(name, a, b) for a, b in zip(FIXED_LOGP, FIXED_REF)]
    torch.testing.assert_close(
        out, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-15
    )
    g_logp, g_ref = torch.autograd.grad(out.sum(), [logp, ref])
    expected_g = torch.tensor(
        [ref_grad_logp(name, a, b) for a, b in zip(FIXED_LOGP, FIXED_REF)], dtype=torch.float64
    )
    torch.testing.assert_close(g_logp, expected_g, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g_ref, -expected_g, rtol=1e-12, atol=1e-15)


def test_hand_computed_numbers():
    logp = torch.tensor([-1.0, -1.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)  # d = +0.5, −0.5
    assert kl_penalty(logp, ref, "k1").tolist() == [0.5, -0.5]
    assert kl_penalty(logp, ref, "abs").tolist() == [0.5, 0.5]
    assert kl_penalty(logp, ref, "k2").tolist() == [0.125, 0.125]
    # k3 = e^{−d} − 1 + d: e^{−0.5} − 0.5 = 0.1065306597..., e^{0.5} − 1.5 = 0.1487212707...
    torch.testing.assert_close(
        kl_penalty(logp, ref, "k3"),
        torch.tensor([0.10653065971263342, 0.14872127070012819], dtype=torch.float64),
    )


def test_every_name_is_listed_and_aliases_agree():
    assert set(KL_ESTIMATORS) == set(BASE_NAMES + PLUS_NAMES)
    logp = torch.randn(4, 6, dtype=torch.float64)
    ref = torch.randn(4, 6, dtype=torch.float64)
    for a, b in [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")]:
        for suffix in ("", "+"):
            assert torch.equal(kl_penalty(logp, ref, a + suffix), kl_penalty(logp, ref, b + suffix))


def test_default_is_k1_and_verl_keywords_live_in_compat():
    from rlmath.compat.verl import kl_penalty as verl_kl_penalty

    logp, ref = torch.randn(3, 5), torch.randn(3, 5)
    assert torch.equal(kl_penalty(logp, ref), logp - ref)
    assert torch.equal(
        kl_penalty(log_prob=logp, ref_log_prob=ref, estimator="low_var_kl"),
        kl_penalty(logp, ref, "k3"),
    )
    # verl's call sites: kl_penalty(logprob=..., ref_logprob=..., kl_penalty="low_var_kl")
    assert torch.equal(
        verl_kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty="low_var_kl"),
        kl_penalty(logp, ref, "k3"),
    )


@pytest.mark.parametrize("name", BASE_NAMES)
def test_plus_keeps_the_exact_value(name):
    logp = torch.randn(5, 7) * 3
    ref = torch.randn(5, 7) * 3
    assert torch.equal(kl_penalty(logp, ref, name + "+"), kl_penalty(logp, ref, name))


# ---------------------------------------------------------------- k3 details


def test_k3_clamps_and_dead_zone():
    # x = ref − logp: 2.6 is just inside the default k3_max=10 (k3(2.61087) = 10), 2.62 just outside.
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0, 30.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([2.6, 2.62, -10.9, -11.1, 0.0], dtype=torch.float64)
    out = kl_penalty(logp, ref, "k3")
    (grad,) = torch.autograd.grad(out.sum(), [logp])
    assert out[0].item() == pytest.approx(math.exp(2.6) - 3.6)
    assert out[1].item() == 10.0 and out[3].item() == 10.0 and out[4].item() == 10.0
    assert out[2].item() == pytest.approx(math.exp(-10.9) + 9.9)
    assert grad[0].item() == pytest.approx(1 - math.exp(2.6))
    assert grad[1].item() == 0.0 and grad[3].item() == 0.0  # the documented dead zone
    # Disabled upper clamp: value keeps growing, gradient is alive; the ±20 exponent clamp remains.
    out = kl_penalty(logp, ref, "k3", k3_max=None)
    assert out[1].item() == pytest.approx(math.exp(2.62) - 3.62)
    assert out[4].item() == pytest.approx(math.exp(-20.0) + 19.0)  # x = −30 clamped to −20
    big = kl_penalty(torch.tensor([0.0]), torch.tensor([50.0]), "k3", k3_max=None)
    assert big.item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)
    # k3+ keeps k2's gradient inside the dead zone.
    (grad_plus,) = torch.autograd.grad(kl_penalty(logp, ref, "k3+").sum(), [logp])
    torch.testing.assert_close(grad_plus, (logp - ref).detach())
    narrow = kl_penalty(logp.detach(), ref, "k3", log_ratio_clamp=1.0, k3_max=None)
    assert narrow[1].item() == pytest.approx(math.e - 2.0)


def test_k3_is_accurate_for_tiny_log_ratios():
    """expm1(x) − x: absolute error of order eps·|x| and never negative, where the textbook
    exp(x) − 1 − x loses everything below eps (k3 ≈ x²/2 is far below eps here)."""
    x = torch.tensor([1e-9, -1e-7, 1e-5, -1e-3, 3e-2], dtype=torch.float64)
    logp = torch.zeros(5, dtype=torch.float64)
    exact = torch.tensor([ref_value("k3", 0.0, v) for v in x.tolist()], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        eps = torch.finfo(dtype).eps
        out = kl_penalty(logp.to(dtype), x.to(dtype), "k3")
        # Reference on the rounded inputs, so only the computation's error is measured.
        exact = torch.tensor(
            [ref_value("k3", 0.0, v) for v in x.to(dtype).double().tolist()], dtype=torch.float64
        )
        assert (out >= 0).all()
        assert ((out.double() - exact).abs() <= 2 * eps * x.abs()).all(), (dtype, out, exact)


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", BASE_NAMES + PLUS_NAMES)
def test_low_precision_inputs_against_fp64(dtype, name):
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(64, generator=g, dtype=torch.float64) * 4).to(dtype)
    ref = (logp.double() + torch.randn(64, generator=g, dtype=torch.float64) * 0.05).to(dtype)
    out = kl_penalty(logp, ref, name)
    assert out.dtype == torch.float32
    # Reference on the *rounded* inputs: measures the computation, not the input quantization.
    expected = torch.tensor(
        [ref_value(name, a, b) for a, b in zip(logp.double().tolist(), ref.double().tolist())],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=2e-7)


# ---------------------------------------------------------------- masks, NaN, purity


masked_fill = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 100.0])


@given(
    fill=masked_fill,
    name=st.sampled_from(BASE_NAMES + PLUS_NAMES),
    seed=st.integers(0, 2**16),
    importance=st.booleans(),
)
def test_masked_values_never_leak(fill, name, seed, importance):
    importance = importance and name in ("k3", "low_var_kl")  # the option is k3-only
    g = torch.Generator().manual_seed(seed)
    shape = (3, 6)
    mask = torch.rand(shape, generator=g) < 0.6
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3

    def run(a, b, c):
        a = a.clone().requires_grad_()
        b = b.clone().requires_grad_()
        c = c.clone().requires_grad_()
        kw = {"old_log_prob": c} if importance else {}
        out = kl_penalty(a, b, name, response_mask=mask, **kw)
        loss = masked_mean(out, mask)
        grads = torch.autograd.grad(loss, [a, b, c], allow_unused=True)
        return out, [torch.zeros_like(a) if gr is None else gr for gr in grads]

    clean_out, clean_grads = run(logp, ref, old)
    dirty = [torch.where(mask, t, torch.full_like(t, fill)) for t in (logp, ref, old)]
    out, grads = run(*dirty)
    assert torch.equal(out, clean_out)
    assert (out[~mask] == 0).all()
    for a, b in zip(grads, clean_grads):
        assert torch.equal(a, b)
        assert (a[~mask] == 0).all()


def test_elementwise_nan_stays_local_and_inputs_untouched():
    logp = torch.randn(4, 5)
    ref = torch.randn(4, 5)
    logp[1, 2] = float("nan")
    copies = logp.clone(), ref.clone()
    out = kl_penalty(logp, ref, "k3")
    assert out[1, 2].isnan()
    assert out.isnan().sum() == 1
    assert torch.equal(logp.nan_to_num(0.5), copies[0].nan_to_num(0.5))
    assert torch.equal(ref, copies[1])


# ---------------------------------------------------------------- what the gradients estimate


def categorical(seed, k=6, spread=0.8):
    """Policy logits θ (the parameters), reference and sampling log-probs: all fp64."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(k, generator=g, dtype=torch.float64) * spread
    log_ref = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * spread, -1)
    log_old = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * spread, -1)
    return theta, log_ref, log_old


def analytic_grad_forward_kl(theta, log_ref):
    """∇_θ KL(π‖π_ref) = π ⊙ (log π − log π_ref − KL) for π = softmax(θ)."""
    log_pi = torch.log_softmax(theta, -1)
    pi = log_pi.exp()
    kl = (pi * (log_pi - log_ref)).sum()
    return pi * (log_pi - log_ref - kl)


def analytic_grad_reverse_kl(theta, log_ref):
    """∇_θ KL(π_ref‖π) = −Σ_x π_ref(x) ∇log π(x) = π − π_ref."""
    return torch.softmax(theta, -1) - log_ref.exp()


def expected_direct_gradient(name, theta, log_ref, log_sample=None, **kw):
    """E_{x~q}[∇_θ estimator(log π_θ(x), log π_ref(x))] by enumerating all x, q = π by default.

    Only the direct gradient through log π_θ(x) is taken (the weights q(x) are
    constants), which is what a trainer does with sampled tokens.
    """
    theta = theta.clone().requires_grad_()
    log_pi = torch.log_softmax(theta, -1)
    q = (log_pi if log_sample is None else log_sample).detach().exp()
    per_token = kl_penalty(log_pi, log_ref, name, **kw)
    (grad,) = torch.autograd.grad((q * per_token).sum(), [theta])
    return grad, (q * per_token).sum().detach()


@pytest.mark.parametrize("seed", range(4))
def test_expected_gradients_by_exact_enumeration(seed):
    theta, log_ref, _ = categorical(seed)
    forward = analytic_grad_forward_kl(theta, log_ref)
    reverse = analytic_grad_reverse_kl(theta, log_ref)
    assert forward.abs().max() > 1e-2 and (forward - reverse).abs().max() > 1e-2
    log_pi = torch.log_softmax(theta, -1)
    kl = (log_pi.exp() * (log_pi - log_ref)).sum()

    # k2 and every "+" estimator: E[∇] = ∇KL(π‖π_ref), exactly.
    for name in ["k2", "mse", *PLUS_NAMES]:
        grad, _ = expected_direct_gradient(name, theta, log_ref)
        torch.testing.assert_close(grad, forward, rtol=1e-10, atol=1e-12)
    # k1: E[∇log π] = Σ ∇π = 0 — no expected gradient at all, although E[k1] = KL.
    grad, value = expected_direct_gradient("k1", theta, log_ref)
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-12)
    torch.testing.assert_close(value, kl, rtol=1e-12, atol=0)
    # k3: E[k3] = KL(π‖π_ref) but E[∇k3] = ∇KL(π_ref‖π), the reverse KL's gradient.
    grad, value = expected_direct_gradient("k3", theta, log_ref)
    torch.testing.assert_close(grad, reverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(value, kl, rtol=1e-12, atol=0)
    assert (grad - forward).abs().max() > 1e-2
    # abs: neither.
    grad, _ = expected_direct_gradient("abs", theta, log_ref)
    assert (grad - forward).abs().max() > 1e-3 and (grad - reverse).abs().max() > 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_importance_corrected_k3_is_unbiased_off_policy(seed):
    """Tokens sampled from π_old ≠ π: weighting k3 by π/π_old, with the gradient flowing
    through the weight, gives E_{π_old}[w·k3] = KL(π‖π_ref) and E[∇(w·k3)] = ∇KL(π‖π_ref)."""
    theta, log_ref, log_old = categorical(seed)
    log_pi = torch.log_softmax(theta, -1)
    kl = (log_pi.exp() * (log_pi - log_ref)).sum()
    forward = analytic_grad_forward_kl(theta, log_ref)

    grad, value = expected_direct_gradient(
        "k3", theta, log_ref, log_sample=log_old, old_log_prob=log_old
    )
    torch.testing.assert_close(value, kl, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, forward, rtol=1e-10, atol=1e-12)
    # Uncorrected k3 on π_old's samples estimates neither the value nor the gradient.
    grad, value = expected_direct_gradient("k3", theta, log_ref, log_sample=log_old)
    assert abs(value - kl) > 1e-3 and (grad - forward).abs().max() > 1e-3


def test_importance_corrected_k3_closed_form():
    logp = torch.tensor([-1.0, -0.3], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.4, -0.2], dtype=torch.float64)
    old = torch.tensor([-0.8, -0.3], dtype=torch.float64)
    out = kl_penalty(logp, ref, "k3", old_log_prob=old)
    d = [-1.0 + 1.4, -0.3 + 0.2]
    w = [math.exp(-1.0 + 0.8), 1.0]
    k3 = [math.exp(-x) - 1 + x for x in d]
    torch.testing.assert_close(
        out, torch.tensor([w[i] * k3[i] for i in range(2)], dtype=torch.float64)
    )
    (grad,) = torch.autograd.grad(out.sum(), [logp])
    # ∂(w·k3)/∂logp = w·k3 + w·(1 − e^{−d})
    expected = [w[i] * k3[i] + w[i] * (1 - math.exp(-d[i])) for i in range(2)]
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"])
def test_monte_carlo_sampled_gradients(name):
    """Sample tokens from π like a trainer, average the per-token gradients, compare with
    ∇KL(π‖π_ref) within 5 standard errors: k2-gradient estimators agree, k1/k3/abs do not."""
    theta, log_ref, _ = categorical(seed=7, k=5, spread=1.0)
    forward = analytic_grad_forward_kl(theta, log_ref)
    # Per-category direct gradients g_x = ∇_θ estimator(log π(x), log π_ref(x)), by autograd.
    theta_req = theta.clone().requires_grad_()
    log_pi = torch.log_softmax(theta_req, -1)
    per_token = kl_penalty(log_pi, log_ref, name)
    g_x = torch.stack(
        [torch.autograd.grad(per_token[x], [theta_req], retain_graph=True)[0] for x in range(5)]
    )
    n = 20000
    samples = torch.multinomial(
        log_pi.detach().exp(), n, replacement=True, generator=torch.Generator().manual_seed(3)
    )
    per_sample = g_x[samples]  # (n, K)
    mean = per_sample.mean(0)
    stderr = per_sample.std(0) / math.sqrt(n) + 1e-12
    within = ((mean - forward).abs() <= 5 * stderr).all().item()
    assert within == (name in ("k2", "k1+", "k3+", "abs+")), (name, mean, forward, stderr)


# ---------------------------------------------------------------- bad input


def test_bad_input_messages():
    logp, ref = torch.randn(2, 3), torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"estimator.*valid values are: .*k3\+"):
        kl_penalty(logp, ref, "k4")
    with pytest.raises(ValueError, match="kl_from_logits"):
        kl_penalty(logp, ref, "full")
    with pytest.raises(ValueError, match="kl_from_logits"):
        kl_penalty(logp, ref, estimator="full")
    with pytest.raises(TypeError, match="log_prob"):
        kl_penalty(torch.ones(2, 3, dtype=torch.int64), ref)
    with pytest.raises(TypeError, match="ref_log_prob"):
        kl_penalty(logp, [1.0, 2.0])
    with pytest.raises(ValueError, match="ref_log_prob"):
        kl_penalty(logp, torch.randn(3, 2))
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_penalty(logp, ref, "k3", log_ratio_clamp=0.0)
    with pytest.raises(ValueError, match="k3_max"):
        kl_penalty(logp, ref, "k3", k3_max=-1.0)
    with pytest.raises(ValueError, match="old_log_prob"):
        kl_penalty(logp, ref, "k1", old_log_prob=logp)
    with pytest.raises(ValueError, match="old_log_prob"):
        kl_penalty(logp, ref, "k3", old_log_prob=torch.randn(2, 4))
    with pytest.raises(ValueError, match="response_mask"):
        kl_penalty(logp, ref, "k3", response_mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match="kl_penalty"):
        kl_penalty(logp, ref, "k2", kl_penalty="k3")  # verl's keyword: rlmath.compat.verl


def test_the_default_k1_call_equals_the_general_path_and_checks_as_much():
    logp, ref = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5)
    plain = kl_penalty(logp, ref)
    general = kl_penalty(logp, ref, "k1", response_mask=torch.ones(4, 5, dtype=torch.bool))
    assert torch.equal(plain, general)
    (g_plain,) = torch.autograd.grad(plain.sum(), logp)
    (g_general,) = torch.autograd.grad(general.sum(), logp)
    assert torch.equal(g_plain, g_general)
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_penalty(logp, ref, "k1", log_ratio_clamp=0.0)
    with pytest.raises(ValueError, match="k3_max"):
        kl_penalty(logp, ref, "k1", k3_max=-1.0)
    with pytest.raises(ValueError, match="ref_log_prob"):
        kl_penalty(logp, torch.randn(5, 4))
    with pytest.raises(TypeError, match="ref_log_prob"):
        kl_penalty(logp, torch.ones(4, 5, dtype=torch.int64))
