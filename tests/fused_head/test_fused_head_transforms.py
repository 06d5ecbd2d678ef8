"""The head's logit transforms (scale, soft-cap), a padded vocabulary, mixed dtypes and autocast."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from rlmath import log_probs_and_entropy_from_hidden as fused
from tests.fused_head.reference import make, make_labels

# Every test runs with the head's fp32 CPU matmuls in torch's BLAS and in oneDNN.
pytestmark = pytest.mark.usefixtures("matmul_library")

N, H, V = 9, 5, 23


def reference(h, w, b, labels, *, scale=1.0, softcap=None, temperature=1.0, vocab=None):
    """fp64 log-probs and entropy from the definition (autograd gives the gradients)."""
    z = h @ w.T + (b if b is not None else 0)
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if vocab is not None:
        z = z[..., :vocab]
    ls = torch.log_softmax(z / temperature, -1)
    valid = labels != -100
    lp = ls.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return torch.where(valid, lp, 0), torch.where(valid, ent, 0)


def _inputs(dtype=torch.float64):
    h = make((N, H), dtype, requires_grad=True)
    w = make((V, H), dtype, seed=1, requires_grad=True)
    b = make((V,), dtype, seed=2, requires_grad=True)
    return h, w, b, make_labels((N,), V, ignore=[3])


@pytest.mark.parametrize(
    "kw",
    [
        {"softcap": 2.0},
        {"logit_scale": 0.25},
        {"logit_scale": 3.0, "softcap": 1.5},
        {"softcap": 50.0},
    ],
)
def test_transforms_match_the_definition(kw):
    h, w, b, labels = _inputs()
    t = torch.rand(N, dtype=torch.float64) + 0.5
    lp, ent = fused(h, w, labels, bias=b, temperature=t, chunk_size=4, vocab_chunk_size=7, **kw)
    rlp, rent = reference(
        h, w, b, labels, scale=kw.get("logit_scale", 1.0), softcap=kw.get("softcap"),
        temperature=t[:, None],
    )  # fmt: skip
    torch.testing.assert_close(lp, rlp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, rent, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad((lp.sum() - 0.3 * ent.sum()), (h, w, b))
    rg = torch.autograd.grad((rlp.sum() - 0.3 * rent.sum()), (h, w, b))
    for a, c in zip(g, rg, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_softcap_and_scale():
    h, w, b, labels = _inputs()
    assert gradcheck(
        lambda h, w, b: fused(
            h, w, labels, bias=b, softcap=1.5, logit_scale=2.0, temperature=0.8,
            chunk_size=4, vocab_chunk_size=6,
        ),
        (h, w, b),
    )  # fmt: skip


def test_softcap_on_float32_matches_fp64():
    h, w, b, labels = _inputs(torch.float32)
    lp, ent = fused(h, w, labels, bias=b, softcap=3.0)
    rlp, rent = reference(h.double(), w.double(), b.double(), labels, softcap=3.0)
    # One fp32 rounding of each logit, of its tanh and of the sums: a few ulps of |z|.
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=5e-6)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=5e-6)


def test_padded_vocabulary_is_left_out():
    h, w, b, labels = _inputs()
    real = 17
    labels = labels.clamp_max(real - 1)
    labels[3] = -100
    lp, ent = fused(h, w, labels, bias=b, vocab_size=real, vocab_chunk_size=5)
    rlp, rent = reference(h, w, b, labels, vocab=real)
    torch.testing.assert_close(lp, rlp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, rent, rtol=1e-12, atol=1e-12)
    (lp.sum() + ent.sum()).backward()
    assert (w.grad[real:] == 0).all() and (b.grad[real:] == 0).all()
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 17\)"):
        fused(h, w, torch.full((N,), 20), vocab_size=real, validate=True)


def test_bf16_hidden_with_fp32_master_weight():
    h32 = make((N, H), torch.float32, seed=4)
    h = h32.to(torch.bfloat16).requires_grad_()
    w = make((V, H), torch.float32, seed=5, requires_grad=True)
    labels = make_labels((N,), V, ignore=[0])
    lp, ent = fused(h, w, labels)
    (lp.sum() + ent.sum()).backward()
    assert (
        lp.dtype == torch.float32
        and h.grad.dtype == torch.bfloat16
        and w.grad.dtype == torch.float32
    )
    # The bf16 hidden states are promoted exactly: fp32 math on the same values.
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    rlp, rent = reference(h64, w64, None, labels)
    (rlp.sum() + rent.sum()).backward()
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=2e-6)
    torch.testing.assert_close(ent.double(), rent, rtol=0, atol=2e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=0, atol=2e-6)
    # grad_hidden is rounded once to bf16: within half an ulp of bf16 (2^-8 relative).
    err = (h.grad.double() - h64.grad).abs().max().item()
    assert err <= 2**-8 * h64.grad.abs().max().item()


def test_autocast_runs_the_head_in_the_autocast_dtype():
    h = make((N, H), torch.float32, seed=6, requires_grad=True)
    w = make((V, H), torch.float32, seed=7, requires_grad=True)
    labels = make_labels((N,), V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = fused(h, w, labels)
        want = torch.log_softmax((h @ w.T).float(), -1)  # what F.linear gives under autocast
    (lp.sum() + ent.sum()).backward()
    assert (
        lp.dtype == torch.float32
        and h.grad.dtype == torch.float32
        and w.grad.dtype == torch.float32
    )
    rlp = want.gather(-1, labels[:, None]).squeeze(-1)
    # The same bf16 logits as the plain path under autocast, reduced in fp32.
    torch.testing.assert_close(lp, rlp, rtol=0, atol=2e-6)
    # And different from the fp32 head by bf16 rounding: autocast really applied.
    assert (fused(h, w, labels)[0] - lp).abs().max() > 1e-4


@pytest.mark.parametrize("piece", [1, 3])
@pytest.mark.parametrize("transform", [{}, {"scale": 0.7, "softcap": 2.0}])
def test_small_matmul_pieces(monkeypatch, piece, transform):
    # On a CPU a block's matmuls and elementwise passes run in pieces of rows
    # (and, for the weight gradient, of vocabulary entries), one worker task
    # each: pieces of 1 and 3 put a boundary inside every block, uneven last
    # pieces included, with and without the transform's own block buffer.
    import rlmath.engine.torch_backend.head_blocks as fn

    monkeypatch.setattr(fn, "matmul_piece", lambda length, device=None: piece)
    h, w, b, labels = _inputs()
    t = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    kw = {"temperature": t, "chunk_size": 5, "vocab_chunk_size": 7}
    if transform:
        kw |= {"logit_scale": transform["scale"], "softcap": transform["softcap"]}

    def f(h, w, b):
        return fused(h, w, labels, bias=b, **kw)

    assert gradcheck(f, (h, w, b))
    got = f(h, w, b)
    want = reference(h, w, b, labels, temperature=t[:, None], **transform)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
