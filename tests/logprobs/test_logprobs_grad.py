"""Gradients: fp64 gradcheck of every custom function, low-precision grads against fp64 autograd."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from rlmath import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
)
from tests.logprobs.reference import ref_entropy, ref_kl, ref_log_probs


def leaf(shape, dtype=torch.float64, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def labels_for(shape, V, seed=1):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


TEMPERATURES = {
    "one": lambda shape: 1.0,
    "float": lambda shape: 0.6,
    "tensor": lambda shape: (
        torch.rand(shape, generator=torch.Generator().manual_seed(2)).double() + 0.5
    ),
}


@pytest.mark.parametrize("temp", sorted(TEMPERATURES))
@pytest.mark.parametrize("k", [None, 3])
def test_gradcheck_log_probs(temp, k):
    x = leaf((2, 3, 7))
    labels = labels_for((2, 3) if k is None else (2, 3, k), 7)
    t = TEMPERATURES[temp]((2, 3))
    assert gradcheck(lambda x: log_probs_from_logits(x, labels, temperature=t, chunk_size=2), (x,))


@pytest.mark.parametrize("temp", sorted(TEMPERATURES))
def test_gradcheck_entropy(temp):
    x = leaf((5, 6))
    t = TEMPERATURES[temp]((5,))
    assert gradcheck(lambda x: entropy_from_logits(x, temperature=t, chunk_size=2), (x,))


@pytest.mark.parametrize("temp", sorted(TEMPERATURES))
@pytest.mark.parametrize("k", [None, 2])
def test_gradcheck_log_probs_and_entropy(temp, k):
    x = leaf((5, 6))
    labels = labels_for((5,) if k is None else (5, k), 6)
    t = TEMPERATURES[temp]((5,))
    assert gradcheck(
        lambda x: log_probs_and_entropy_from_logits(x, labels, temperature=t, chunk_size=3), (x,)
    )
    # Each output alone (the other's gradient is None).
    assert gradcheck(
        lambda x: log_probs_and_entropy_from_logits(x, labels, temperature=t, chunk_size=3)[1],
        (x,),
    )
    assert gradcheck(
        lambda x: log_probs_and_entropy_from_logits(x, labels, temperature=t, chunk_size=3)[0],
        (x,),
    )


@pytest.mark.parametrize("temp", sorted(TEMPERATURES))
def test_gradcheck_kl(temp):
    x, r = leaf((4, 6)), leaf((4, 6), seed=3)
    t = TEMPERATURES[temp]((4,))
    assert gradcheck(lambda x, r: kl_from_logits(x, r, temperature=t, chunk_size=3), (x, r))
    r_const = r.detach()
    assert gradcheck(lambda x: kl_from_logits(x, r_const, temperature=t, chunk_size=3), (x,))
    x_const = x.detach()
    assert gradcheck(lambda r: kl_from_logits(x_const, r, temperature=t, chunk_size=3), (r,))


def test_gradcheck_with_neg_inf_columns():
    # gradcheck perturbs finite entries only; the -inf ones must get exactly 0 gradient.
    base = leaf((4, 8)).detach()
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[:, 6:] = True
    mask[1, :3] = True
    labels = torch.tensor([0, 4, 2, 5])

    def with_inf(x):
        return torch.where(mask, torch.tensor(float("-inf"), dtype=x.dtype), x)

    x = base.clone().requires_grad_()
    assert gradcheck(
        lambda x: log_probs_and_entropy_from_logits(with_inf(x), labels, chunk_size=3), (x,)
    )
    r = leaf((4, 8), seed=4).detach()
    assert gradcheck(lambda x: kl_from_logits(with_inf(x), with_inf(r), chunk_size=3), (x,))
    z = with_inf(base).requires_grad_()
    lp, ent = log_probs_and_entropy_from_logits(z, labels)
    (lp.sum() + ent.sum() + kl_from_logits(z, with_inf(r)).sum()).backward()
    assert torch.isfinite(z.grad).all() and z.grad[mask].eq(0).all()


def grads_of(fn, x, *rest):
    x = x.detach().clone().requires_grad_()
    out = fn(x, *rest)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(11)
    total = sum(
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs
    )
    total.backward()
    return x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temp", ["one", "tensor"])
def test_low_precision_grads_match_fp64(dtype, temp):
    N, V = 10, 513
    x = leaf((N, V), dtype=dtype, scale=3.0).detach()
    labels = labels_for((N,), V)
    t = TEMPERATURES[temp]((N,))
    r = leaf((N, V), dtype=dtype, seed=8).detach()

    ours = grads_of(
        lambda z: log_probs_and_entropy_from_logits(z, labels, temperature=t, chunk_size=4), x
    )
    ref = grads_of(lambda z: (ref_log_probs(z, labels, t), ref_entropy(z, t)), x.double())
    assert ours.dtype == dtype
    # one rounding to the gradient's dtype on top of fp32 math
    atol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(
        ours.double(), ref, atol=atol, rtol=1e-2 if dtype != torch.float32 else 1e-5
    )

    ours_kl = grads_of(lambda z: kl_from_logits(z, r, temperature=t, chunk_size=4), x)
    ref_kl_grad = grads_of(lambda z: ref_kl(z, r, t), x.double())
    torch.testing.assert_close(
        ours_kl.double(), ref_kl_grad, atol=atol, rtol=1e-2 if dtype != torch.float32 else 1e-5
    )


def test_bf16_grad_is_fp32_grad_rounded_once():
    # The gradient is formed in fp32 and rounded to bf16 once: it equals the fp32
    # gradient of the same (upcast) logits, rounded.
    x = leaf((6, 300), dtype=torch.bfloat16, scale=4.0).detach()
    labels = labels_for((6,), 300)
    for fn in (
        lambda z: log_probs_from_logits(z, labels, chunk_size=4),
        lambda z: log_probs_and_entropy_from_logits(z, labels, chunk_size=4),
    ):
        g16 = grads_of(fn, x)
        g32 = grads_of(fn, x.float())
        torch.testing.assert_close(g16, g32.to(torch.bfloat16), rtol=0, atol=0)


def test_fp16_extreme_grads_are_finite():
    x = torch.zeros(3, 50, dtype=torch.float16)
    x[0] = -65504.0
    x[0, 1] = 65504.0
    x[1] = 65504.0
    x[2, ::3] = -65504.0
    x.requires_grad_()
    labels = torch.tensor([1, 0, 2])
    lp, ent = log_probs_and_entropy_from_logits(x, labels)
    (lp.sum() + ent.sum() + kl_from_logits(x, x.detach().flip(-1)).sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_non_contiguous_logits_grad():
    base = leaf((3, 8, 40), dtype=torch.float32).detach()
    x = base.clone().requires_grad_()
    sliced = x[:, 2:-1, ::2]  # neither mergeable nor unit-stride
    labels = labels_for(sliced.shape[:-1], 20)
    lp, ent = log_probs_and_entropy_from_logits(sliced, labels, chunk_size=3)
    (lp.sum() + ent.sum()).backward()
    y = base.double().clone().requires_grad_()
    lp_r = ref_log_probs(y[:, 2:-1, ::2], labels)
    ent_r = ref_entropy(y[:, 2:-1, ::2])
    (lp_r.sum() + ent_r.sum()).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-6, rtol=1e-5)


def test_no_grad_and_detached_paths():
    x = leaf((4, 9), dtype=torch.float32)
    labels = labels_for((4,), 9)
    with torch.no_grad():
        lp = log_probs_from_logits(x, labels)
    assert not lp.requires_grad
    lp, ent = log_probs_and_entropy_from_logits(x.detach(), labels)
    assert not lp.requires_grad and not ent.requires_grad
    kl = kl_from_logits(x.detach(), x)
    kl.sum().backward()
    assert x.grad is not None
