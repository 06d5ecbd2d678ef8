"""Values of the fused head against fp64 references of the unfused computation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath.engine.torch_backend import cpu_matmul
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import log_probs_and_entropy_from_logits
from tests.fused_head.reference import (
    logits64,
    make,
    make_labels,
    ref_from_logits,
    ref_fused,
)

# Every test runs with the head's fp32 CPU matmuls in torch's BLAS and in oneDNN.
pytestmark = pytest.mark.usefixtures("matmul_library")

fused = log_probs_and_entropy_from_hidden


def tol(dtype):
    # fp32: a bar of 1e-5 against the fp64 reference (fp32 matmul + fp32 softmax).
    return {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 0}


def temperature_of(kind, shape):
    if kind == "one":
        return 1.0
    if kind == "float":
        return 0.7
    return torch.rand(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("temp", ["one", "float", "tensor"])
def test_matches_fp64_reference(dtype, with_bias, temp):
    B, T, H, V = 3, 7, 24, 517
    hidden = make((B, T, H), dtype)
    weight = make((V, H), dtype, scale=0.4, seed=1)
    bias = make((V,), dtype, seed=2) if with_bias else None
    labels = make_labels((B, T), V, ignore=[(0, 0), (2, 6)])
    t = temperature_of(temp, (B, T))
    lp, ent = fused(
        hidden, weight, labels, bias=bias, temperature=t, chunk_size=4, vocab_chunk_size=100
    )
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lp.dtype == ent.dtype == out_dtype and lp.shape == ent.shape == (B, T)
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, bias, t)
    torch.testing.assert_close(lp.double(), ref_lp, **tol(dtype))
    torch.testing.assert_close(ent.double(), ref_ent, **tol(dtype))
    assert lp[0, 0] == 0 and ent[0, 0] == 0 and lp[2, 6] == 0 and ent[2, 6] == 0
    # Automatic chunking gives the same values.
    lp2, ent2 = fused(hidden, weight, labels, bias=bias, temperature=t)
    torch.testing.assert_close(lp2.double(), ref_lp, **tol(dtype))
    torch.testing.assert_close(ent2.double(), ref_ent, **tol(dtype))


def test_equals_the_unfused_rlmath_path():
    N, H, V = 40, 64, 3001
    hidden = make((N, H), torch.float32)
    weight = make((V, H), torch.float32, scale=0.3, seed=1)
    bias = make((V,), torch.float32, seed=2)
    labels = make_labels((N,), V)
    t = temperature_of("tensor", (N,))
    lp, ent = fused(hidden, weight, labels, bias=bias, temperature=t, chunk_size=16)
    # The unfused logits from the library the head's matmuls use (oneDNN or
    # torch's BLAS add in different orders), so that only the softmax passes differ.
    onednn = cpu_matmul.uses_onednn(hidden.dtype, hidden.device)
    logits = cpu_matmul.mm(hidden, weight.T, bias=bias, onednn=onednn)
    lp_u, ent_u = log_probs_and_entropy_from_logits(logits, labels, temperature=t)
    # The two add the softmax sums in other orders (tiles vs rows). Each result
    # is a difference of fp32 terms as large as the row's largest scaled logit
    # (log-sum-exp, z_label / T, Σ p·z / T): a few units of their last place,
    # 8·u·max|z / T| per row, on top of the sums' own 2e-6.
    scale = (logits / t[:, None]).abs().amax(-1)
    bound = 2e-6 + 8 * 2.0**-24 * scale
    assert ((lp - lp_u).abs() <= bound).all()
    assert ((ent - ent_u).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_the_error_of_the_half_matmul(dtype):
    # The bar: bf16/fp16 inputs are as accurate as computing the logits with the
    # half-precision matmul and then an fp32 softmax (rlmath's unfused path).
    N, H, V = 48, 64, 2000
    hidden = make((N, H), dtype, seed=3)
    weight = make((V, H), dtype, scale=0.5, seed=4)
    bias = make((V,), dtype, seed=5)
    labels = make_labels((N,), V, ignore=[7])
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, bias)
    lp, ent = fused(hidden, weight, labels, bias=bias, chunk_size=8, vocab_chunk_size=300)
    assert lp.dtype == ent.dtype == torch.float32
    valid = labels != -100
    lp_u, ent_u = log_probs_and_entropy_from_logits(
        hidden @ weight.T + bias, torch.where(valid, labels, 0)
    )
    err_u_lp = (lp_u.double() - ref_lp)[valid].abs().max()
    err_u_ent = (ent_u.double() - ref_ent)[valid].abs().max()
    assert err_u_lp > 1e-4  # the half-precision logits do cost accuracy
    assert (lp.double() - ref_lp).abs().max() <= 1.5 * err_u_lp
    assert (ent.double() - ref_ent).abs().max() <= 1.5 * err_u_ent
    # The same half-precision logits up to rounding (one rounding here, two for
    # the unfused `mm + bias`): within two ulps of the largest logit.
    ulp = torch.finfo(dtype).eps * float(logits64(hidden, weight, bias).abs().max())
    torch.testing.assert_close(lp[valid], lp_u[valid], atol=2 * ulp, rtol=0)


def test_chunk_boundaries_do_not_change_results():
    N, H, V = 13, 6, 41
    hidden = make((N, H))
    weight = make((V, H), seed=1)
    bias = make((V,), seed=2)
    labels = make_labels((N,), V, ignore=[4])
    t = temperature_of("tensor", (N,))
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, bias, t)
    for rows in (1, 2, 5, N - 1, N, N + 7):
        for tile in (1, 3, 8, V - 1, V, V + 5):
            lp, ent = fused(
                hidden, weight, labels, bias=bias, temperature=t, chunk_size=rows,
                vocab_chunk_size=tile,
            )  # fmt: skip
            torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)


def test_chunk_boundaries_fp32():
    N, H, V = 37, 32, 1500
    hidden = make((N, H), torch.float32)
    weight = make((V, H), torch.float32, seed=1)
    labels = make_labels((N,), V)
    ref_lp, ref_ent = ref_fused(hidden, weight, labels)
    for rows, tile in [(1, 1500), (8, 256), (36, 1499), (37, 7), (64, 2048)]:
        lp, ent = fused(hidden, weight, labels, chunk_size=rows, vocab_chunk_size=tile)
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_above_100k(dtype):
    V, H = 151936, 8
    hidden = make((3, H), dtype, scale=2.0)
    weight = make((V, H), dtype, seed=1)
    labels = torch.tensor([0, V - 1, 100_001])
    lp, ent = fused(hidden, weight, labels, chunk_size=2)
    ref_lp, ref_ent = ref_fused(hidden, weight, labels)
    if dtype == torch.float32:
        torch.testing.assert_close(lp.double(), ref_lp, **tol(dtype))
        torch.testing.assert_close(ent.double(), ref_ent, **tol(dtype))
    else:  # against fp64 math on the bf16 logits of the same matmul
        z = (hidden @ weight.T).double()
        ref_lp, ref_ent = ref_from_logits(z, labels)
        torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    assert (ent <= math.log(V)).all()


@given(
    n=st.integers(1, 9),
    h=st.integers(1, 12),
    v=st.integers(1, 300),
    scale=st.sampled_from([0.1, 1.0, 10.0, 100.0]),
    rows=st.integers(1, 10),
    tile=st.integers(1, 320),
    seed=st.integers(0, 2**16),
    temp=st.floats(0.05, 20.0),
)
def test_invariants(n, h, v, scale, rows, tile, seed, temp):
    hidden = make((n, h), torch.float32, scale=scale, seed=seed)
    weight = make((v, h), torch.float32, seed=seed + 1)
    bias = make((v,), torch.float32, scale=scale, seed=seed + 2)
    labels = make_labels((n,), v, seed=seed + 3)
    lp, ent = fused(
        hidden, weight, labels, bias=bias, temperature=temp, chunk_size=rows,
        vocab_chunk_size=tile,
    )  # fmt: skip
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp <= 0).all()
    assert (ent >= 0).all() and (ent <= math.log(v) + 1e-5).all()
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, bias, temp)
    # fp32 logits of magnitude ~scale·sqrt(h)/temp: error relative to that size
    size = float(logits64(hidden, weight, bias).abs().max()) / temp + 1.0
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-6 * size, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-6 * size, rtol=1e-6)


def test_return_entropy_false():
    hidden = make((5, 4), torch.float32)
    weight = make((9, 4), torch.float32, seed=1)
    labels = make_labels((5,), 9)
    lp, ent = fused(hidden, weight, labels, return_entropy=False, chunk_size=2)
    assert ent is None
    torch.testing.assert_close(lp, fused(hidden, weight, labels)[0])


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (2, 3, 5), (4, 1, 2)])
@pytest.mark.parametrize("V", [1, 2, 33])
def test_odd_shapes(shape, V):
    H = 3
    hidden = make((*shape, H))
    weight = make((V, H), seed=1)
    labels = make_labels(shape, V)
    lp, ent = fused(hidden, weight, labels, chunk_size=2, vocab_chunk_size=4)
    assert lp.shape == ent.shape == shape
    ref_lp, ref_ent = ref_fused(hidden, weight, labels)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=1e-12)
    if V == 1:
        assert lp.eq(0).all() and ent.eq(0).all()


def test_empty_batch():
    hidden = torch.randn(0, 5, requires_grad=True)
    weight = torch.randn(11, 5, requires_grad=True)
    lp, ent = fused(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 5) and weight.grad.eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_empty_hidden_size_gives_the_softmax_of_the_bias(dtype):
    # H = 0: every logit is its bias (0 without one), whatever the hidden rows.
    hidden = torch.zeros(2, 3, 0, dtype=dtype, requires_grad=True)
    weight = torch.zeros(7, 0, dtype=dtype, requires_grad=True)
    bias = make((7,), dtype, seed=4, requires_grad=True)
    labels = torch.tensor([[0, 6, 2], [5, -100, 1]])
    for b in (None, bias):
        lp, ent = fused(hidden, weight, labels, bias=b)
        z = torch.zeros(2, 3, 7, dtype=torch.float64) + (0.0 if b is None else b.double())
        ref_lp, ref_ent = ref_from_logits(z, labels)
        # A softmax of 7 rounded logits: a few units in the last place of the
        # largest term (the log-sum-exp, up to |b| + log 7).
        u = torch.finfo(dtype).eps / 2
        bound = 16 * u * (1 + z.abs().max())
        assert ((lp.double() - ref_lp).abs() <= bound).all()
        assert ((ent.double() - ref_ent).abs() <= bound).all()
        (lp.sum() + ent.sum()).backward()
        assert hidden.grad.shape == (2, 3, 0) and weight.grad.shape == (7, 0)
    assert bias.grad is not None and bias.grad.isfinite().all()


def test_ignore_index_values():
    hidden = make((6, 4))
    weight = make((10, 4), seed=1)
    # Every position ignored: all zeros.
    none_valid = torch.full((6,), -100)
    lp, ent = fused(hidden, weight, none_valid)
    assert lp.eq(0).all() and ent.eq(0).all()
    # A custom ignore_index inside the vocabulary (as torch's cross_entropy allows).
    labels = torch.tensor([3, 7, 3, 0, 9, 3])
    lp, ent = fused(hidden, weight, labels, ignore_index=3)
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, ignore_index=3)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    assert lp[[0, 2, 5]].eq(0).all() and lp[[1, 3, 4]].lt(0).all()
    # Other negative labels are not special without validate (they are checked with it).
    with pytest.raises(ValueError, match="labels"):
        fused(hidden, weight, torch.tensor([0, 1, 2, -1, 4, 5]), validate=True)


def test_nan_and_inf_on_ignored_rows_stay_there():
    hidden = make((5, 4))
    weight = make((10, 4), seed=1)
    labels = make_labels((5,), 10, ignore=[1, 3])
    bad = hidden.clone()
    bad[1] = float("nan")
    bad[3] = float("inf")
    lp, ent = fused(bad, weight, labels, chunk_size=2)
    ref_lp, ref_ent = ref_fused(hidden, weight, labels)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)


def test_nan_on_a_valid_row_propagates_to_that_row_only():
    hidden = make((5, 4))
    hidden[2, 1] = float("nan")
    weight = make((10, 4), seed=1)
    labels = make_labels((5,), 10)
    lp, ent = fused(hidden, weight, labels, chunk_size=2, vocab_chunk_size=3)
    assert lp[2].isnan() and ent[2].isnan()
    others = torch.tensor([0, 1, 3, 4])
    assert torch.isfinite(lp[others]).all() and torch.isfinite(ent[others]).all()


def test_masked_vocabulary_through_a_neg_inf_bias():
    # A padded vocabulary masked with -inf bias; one vocabulary tile is entirely -inf.
    N, H, V = 6, 5, 40
    hidden = make((N, H), torch.float32)
    weight = make((V, H), torch.float32, seed=1)
    bias = make((V,), torch.float32, seed=2)
    bias[30:] = float("-inf")
    labels = make_labels((N,), 30)
    lp, ent = fused(hidden, weight, labels, bias=bias, chunk_size=4, vocab_chunk_size=10)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, bias)
    torch.testing.assert_close(lp.double(), ref_lp, **tol(torch.float32))
    torch.testing.assert_close(ent.double(), ref_ent, **tol(torch.float32))
    # A label on a masked entry has log-prob -inf, not NaN.
    lp_masked, _ = fused(hidden, weight, torch.full((N,), 35), bias=bias, vocab_chunk_size=10)
    assert lp_masked.eq(float("-inf")).all()


def test_per_sequence_temperature_and_non_contiguous_inputs():
    B, T, H, V = 2, 6, 8, 50
    base = make((T, B, H + 3))
    hidden = base.transpose(0, 1)[..., 1 : H + 1]  # (B, T, H), neither contiguous nor mergeable
    embedding = make((H, V), seed=1)
    weight = embedding.T  # (V, H) with strides (1, V)
    labels = make_labels((B, T), V)
    t = torch.tensor([[0.5], [2.0]], dtype=torch.float64)  # one per sequence
    lp, ent = fused(hidden, weight, labels, temperature=t, chunk_size=5, vocab_chunk_size=7)
    ref_lp, ref_ent = ref_fused(hidden, weight, labels, temperature=t)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
