"""Gradients of the fused head: fp64 gradcheck, low precision against fp64 autograd, masking."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from rlmath.fused_head import log_probs_and_entropy_from_hidden
from tests.fused_head.reference import make, make_labels, ref_from_logits, ref_fused

# Every test runs with the head's fp32 CPU matmuls in torch's BLAS and in oneDNN.
pytestmark = pytest.mark.usefixtures("matmul_library")

fused = log_probs_and_entropy_from_hidden

# Which outputs the loss uses: a function of (log_probs, entropy) to differentiate.
SUBSETS = {
    "log_probs": lambda lp, ent: lp,
    "entropy": lambda lp, ent: ent,
    "both": lambda lp, ent: (lp, ent),
}


@pytest.mark.parametrize("subset", sorted(SUBSETS))
@pytest.mark.parametrize("tiles", [(4, 5), (100, 100)])
def test_gradcheck(subset, tiles):
    N, H, V = 7, 4, 11
    hidden = make((N, H), requires_grad=True)
    weight = make((V, H), seed=1, requires_grad=True)
    bias = make((V,), seed=2, requires_grad=True)
    labels = make_labels((N,), V, ignore=[2, 5])
    t = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    rows, tile = tiles
    want_entropy = subset != "log_probs"

    def f(h, w, b):
        lp, ent = fused(
            h, w, labels, bias=b, temperature=t, return_entropy=want_entropy, chunk_size=rows,
            vocab_chunk_size=tile,
        )  # fmt: skip
        return SUBSETS[subset](lp, ent)

    assert gradcheck(f, (hidden, weight, bias))


def test_gradcheck_with_one_row_elementwise_slices(monkeypatch):
    # Every block reduced and differentiated one row at a time (the CPU path slices
    # blocks for the elementwise passes; 1-row slices put a boundary between all rows).
    import rlmath.engine.torch_backend.head_blocks as fn

    monkeypatch.setattr(fn, "elementwise_rows", lambda rows, width, device=None: 1)
    N, H, V = 6, 3, 10
    hidden = make((N, H), requires_grad=True)
    weight = make((V, H), seed=1, requires_grad=True)
    bias = make((V,), seed=2, requires_grad=True)
    labels = make_labels((N,), V, ignore=[4])
    t = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5

    def f(h, w, b):
        return fused(h, w, labels, bias=b, temperature=t, chunk_size=4, vocab_chunk_size=6)

    assert gradcheck(f, (hidden, weight, bias))


def test_gradcheck_log_probs_only_with_entropy_computed_and_float_temperature():
    hidden = make((5, 3), requires_grad=True)
    weight = make((9, 3), seed=1, requires_grad=True)
    labels = make_labels((5,), 9, ignore=[0])
    assert gradcheck(
        lambda h, w: fused(h, w, labels, temperature=0.6, chunk_size=2, vocab_chunk_size=4)[0],
        (hidden, weight),
    )


def grads(fn, tensors, seed=11):
    """Gradients of Σ r·out for random r (the same r for every implementation)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    g = torch.Generator().manual_seed(seed)
    total = sum(
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs
    )
    total.backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("subset", sorted(SUBSETS))
def test_fp32_grads_match_fp64(subset):
    N, H, V = 29, 48, 700
    hidden = make((N, H), torch.float32)
    weight = make((V, H), torch.float32, scale=0.3, seed=1)
    bias = make((V,), torch.float32, seed=2)
    labels = make_labels((N,), V, ignore=[3, 17])
    t = torch.rand(N, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5

    def pick(lp, ent):
        out = SUBSETS[subset](lp, ent)
        return out if isinstance(out, tuple) else (out,)

    ours = grads(
        lambda h, w, b: pick(
            *fused(h, w, labels, bias=b, temperature=t, chunk_size=8, vocab_chunk_size=128)
        ),
        (hidden, weight, bias),
    )
    ref = grads(
        lambda h, w, b: pick(*ref_fused(h, w, labels, b, t)),
        (hidden.double(), weight.double(), bias.double()),
    )
    for name, a, b in zip(("hidden", "weight", "bias"), ours, ref):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=name)
    assert ours[0][[3, 17]].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_grads(dtype):
    # Against fp64 math on the half-precision logits the forward computed.
    N, H, V = 20, 32, 500
    hidden = make((N, H), dtype)
    weight = make((V, H), dtype, scale=0.3, seed=1)
    bias = make((V,), dtype, seed=2)
    labels = make_labels((N,), V, ignore=[5])
    ours = grads(
        lambda h, w, b: fused(h, w, labels, bias=b, chunk_size=8, vocab_chunk_size=128),
        (hidden, weight, bias),
    )
    z = torch.addmm(bias, hidden, weight.T).double()  # the forward's logits, rounded once

    def as_forward(h, w, b):  # the value z with the gradient of h @ w.T + b
        x = h @ w.T + b
        return z + x - x.detach()

    ref = grads(
        lambda h, w, b: ref_from_logits(as_forward(h, w, b), labels),
        (hidden.double(), weight.double(), bias.double()),
    )
    for name, a, b in zip(("hidden", "weight", "bias"), ours, ref):
        assert a.dtype == dtype, name
        scale = float(b.abs().max())
        torch.testing.assert_close(
            a.double(), b, atol=2 * torch.finfo(dtype).eps * scale, rtol=0, msg=name
        )


def test_bf16_weight_gradient_is_accumulated_in_fp32():
    # Exactly representable inputs and logits (multiples of 1/32 below 1): the
    # bf16 gradient must be the fp64 one rounded once, although it sums 128
    # chunks (a bf16 running sum would be off by several ulps).
    N, H, V = 1024, 8, 64
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randint(-1, 2, (N, H), generator=g) * 0.25).to(torch.bfloat16)
    weight = (torch.randint(-1, 2, (V, H), generator=g) * 0.125).to(torch.bfloat16)
    labels = make_labels((N,), V)
    ours = grads(lambda h, w: fused(h, w, labels, chunk_size=8), (hidden, weight))
    ref = grads(lambda h, w: ref_fused(h, w, labels), (hidden.double(), weight.double()))
    ulp = torch.finfo(torch.bfloat16).eps
    for a, b in zip(ours, ref):
        assert ((a.double() - b).abs() <= ulp * b.abs() + 1e-6).all()


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_gradient_for_one_input_only(which):
    N, H, V = 6, 5, 30
    tensors = {
        "hidden": make((N, H), torch.float32),
        "weight": make((V, H), torch.float32, seed=1),
        "bias": make((V,), torch.float32, seed=2),
    }
    labels = make_labels((N,), V)
    full = grads(
        lambda h, w, b: fused(h, w, labels, bias=b, chunk_size=4, vocab_chunk_size=7),
        list(tensors.values()),
    )
    leaf = tensors[which].clone().requires_grad_()
    args = {**tensors, which: leaf}
    lp, ent = fused(
        args["hidden"], args["weight"], labels, bias=args["bias"], chunk_size=4,
        vocab_chunk_size=7,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    r = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in (lp, ent)]
    ((lp.double() * r[0]).sum() + (ent.double() * r[1]).sum()).backward()
    index = list(tensors).index(which)
    torch.testing.assert_close(leaf.grad, full[index])


def test_ignored_rows_get_no_gradient_even_with_nan():
    N, H, V = 6, 4, 20
    hidden = make((N, H), torch.float32)
    weight = make((V, H), torch.float32, seed=1)
    bias = make((V,), torch.float32, seed=2)
    labels = make_labels((N,), V, ignore=[1, 4])
    dirty = hidden.clone()
    dirty[1] = float("nan")
    dirty[4] = float("inf")
    upstream = torch.rand(N, generator=torch.Generator().manual_seed(0))
    dirty_upstream = upstream.clone()
    dirty_upstream[1] = float("nan")  # a NaN upstream gradient on an ignored row is ignored too

    def run(h, up):
        leaves = [x.clone().requires_grad_() for x in (h, weight, bias)]
        lp, ent = fused(
            leaves[0], leaves[1], labels, bias=leaves[2], chunk_size=4, vocab_chunk_size=6
        )
        torch.autograd.backward([lp, ent], [up, up.flip(0)])
        return [x.grad for x in leaves]

    got = run(dirty, dirty_upstream)
    want = run(hidden, upstream)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert got[0][[1, 4]].eq(0).all()


@pytest.mark.parametrize(("scale", "temperature"), [(1.0, 1.0), (1e3, 1.0), (50.0, 0.25)])
def test_masked_vocabulary_gradients_are_finite_and_zero_there(scale, temperature):
    # -inf bias entries (padded vocabulary), with upstream gradients far outside
    # [-1, 1] and a temperature < 1 (both scale the entropy term that multiplies
    # the clamped log-probabilities of the masked entries in backward).
    N, H, V = 6, 5, 40
    hidden = make((N, H), torch.float32, requires_grad=True)
    weight = make((V, H), torch.float32, seed=1, requires_grad=True)
    bias = make((V,), torch.float32, seed=2)
    bias[30:] = float("-inf")
    bias.requires_grad_()
    labels = make_labels((N,), 30)
    lp, ent = fused(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature,
        chunk_size=4,
        vocab_chunk_size=10,
    )
    g = (torch.rand(N, generator=torch.Generator().manual_seed(0)) * 2 - 1) * scale
    torch.autograd.backward([lp, ent], [g, g.flip(0)])
    for t in (hidden.grad, weight.grad, bias.grad):
        assert torch.isfinite(t).all()
    assert weight.grad[30:].eq(0).all() and bias.grad[30:].eq(0).all()
    # The finite part equals the fp64 gradient of the same function on the unmasked vocabulary.
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach()[:30].double().requires_grad_()
    b64 = bias.detach()[:30].double().requires_grad_()
    z = (h64 @ w64.T + b64) / temperature
    ls = torch.log_softmax(z, -1)
    rlp = ls.gather(-1, labels[:, None]).squeeze(-1)
    rent = -(ls.exp() * ls).sum(-1)
    torch.autograd.backward([rlp, rent], [g.double(), g.flip(0).double()])
    for got, want in (
        (hidden.grad, h64.grad),
        (weight.grad[:30], w64.grad),
        (bias.grad[:30], b64.grad),
    ):
        torch.testing.assert_close(got.double(), want, atol=1e-4 * scale, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_unchanged_after_forward_and_backward(dtype):
    N, H, V = 9, 6, 50
    hidden = make((N, H), dtype, requires_grad=True)
    weight = make((V, H), dtype, seed=1, requires_grad=True)
    bias = make((V,), dtype, seed=2, requires_grad=True)
    labels = make_labels((N,), V, ignore=[0])
    t = torch.rand(N, generator=torch.Generator().manual_seed(3)) + 0.5
    before = [x.detach().clone() for x in (hidden, weight, bias, labels, t)]
    lp, ent = fused(
        hidden, weight, labels, bias=bias, temperature=t, chunk_size=4, vocab_chunk_size=16
    )
    (lp.sum() + ent.sum()).backward()
    for x, y in zip((hidden, weight, bias, labels, t), before):
        assert torch.equal(x.detach(), y)


def test_no_grad_and_detached_inputs():
    hidden = make((4, 3), torch.float32, requires_grad=True)
    weight = make((7, 3), torch.float32, seed=1, requires_grad=True)
    labels = make_labels((4,), 7)
    with torch.no_grad():
        lp, ent = fused(hidden, weight, labels)
    assert not lp.requires_grad and not ent.requires_grad
    lp, ent = fused(hidden.detach(), weight.detach(), labels)
    assert not lp.requires_grad
    lp, _ = fused(hidden, weight, labels, return_entropy=False)
    lp.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


def test_half_precision_backward_matmuls(monkeypatch):
    # The accelerator path (half-precision backward matmuls, fp32 accumulation),
    # forced on the CPU: gradients within bf16 rounding of the fp64 reference
    # (one rounding of the block gradient and one of each block's product).
    import rlmath.engine.policy as policy

    monkeypatch.setattr(policy, "half_matmuls_pay", lambda device: True)
    N, H, V = 37, 16, 300
    hidden = make((N, H), torch.bfloat16, requires_grad=True)
    weight = make((V, H), torch.bfloat16, seed=1, requires_grad=True)
    bias = make((V,), torch.bfloat16, seed=2, requires_grad=True)
    labels = make_labels((N,), V, ignore=[3])
    g = torch.randn(N, generator=torch.Generator().manual_seed(0))
    before = [x.detach().clone() for x in (hidden, weight, bias, labels)]
    lp, ent = fused(hidden, weight, labels, bias=bias, chunk_size=8, vocab_chunk_size=64)
    torch.autograd.backward([lp, ent], [g, g.flip(0)])
    for x, y in zip((hidden, weight, bias, labels), before):
        assert torch.equal(x.detach(), y)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    ls = torch.log_softmax(h64 @ w64.T + b64, -1)
    valid = labels != -100
    rlp = ls.gather(-1, labels.clamp_min(0)[:, None]).squeeze(-1) * valid
    rent = -(ls.exp() * ls).sum(-1) * valid
    torch.autograd.backward([rlp, rent], [g.double(), g.flip(0).double()])
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
    for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad), (bias.grad, b64.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 3 * 2**-8 * want.abs().max().item(), err
    assert hidden.grad[3].eq(0).all()
