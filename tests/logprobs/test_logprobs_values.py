"""Values of log_probs / entropy / KL against fp64 references, edge cases and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import rlmath as R
from rlmath import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
)
from tests.logprobs.reference import ref_entropy, ref_kl, ref_log_probs

LOW_PRECISION = [torch.float32, torch.bfloat16, torch.float16]
ALL_DTYPES = [torch.float64, *LOW_PRECISION]


def tol(dtype: torch.dtype) -> dict:
    """fp64 compute is exact to rounding; everything else computes in fp32 (bar: 2e-6)."""
    if dtype == torch.float64:
        return {"atol": 1e-12, "rtol": 1e-12}
    return {"atol": 2e-6, "rtol": 1e-7}


def make_logits(shape, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def make_temperature(kind, batch_shape):
    if kind == "one":
        return 1.0
    if kind == "float":
        return 0.7
    g = torch.Generator().manual_seed(7)
    return torch.rand(batch_shape, generator=g, dtype=torch.float64) + 0.5


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("temp_kind", ["one", "float", "tensor"])
@pytest.mark.parametrize("k", [None, 3])
def test_log_probs_and_entropy_match_fp64_reference(dtype, temp_kind, k):
    B, T, V = 3, 5, 1000
    logits = make_logits((B, T, V), dtype)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, V, (B, T) if k is None else (B, T, k), generator=g)
    temperature = make_temperature(temp_kind, (B, T))
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32

    lp = log_probs_from_logits(logits, labels, temperature=temperature, chunk_size=4)
    ent = entropy_from_logits(logits, temperature=temperature, chunk_size=4)
    lp2, ent2 = log_probs_and_entropy_from_logits(logits, labels, temperature=temperature)
    assert lp.dtype == ent.dtype == lp2.dtype == ent2.dtype == out_dtype
    assert lp.shape == labels.shape and ent.shape == (B, T)

    ref_lp = ref_log_probs(logits, labels, temperature)
    ref_h = ref_entropy(logits, temperature)
    torch.testing.assert_close(lp.double(), ref_lp, **tol(dtype))
    torch.testing.assert_close(lp2.double(), ref_lp, **tol(dtype))
    torch.testing.assert_close(ent.double(), ref_h, **tol(dtype))
    torch.testing.assert_close(ent2.double(), ref_h, **tol(dtype))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("temp_kind", ["one", "float", "tensor"])
def test_kl_matches_fp64_reference(dtype, temp_kind):
    N, V = 9, 777
    logits = make_logits((N, V), dtype, seed=2)
    ref_logits = (logits.double() + make_logits((N, V), torch.float64, scale=0.5, seed=3)).to(dtype)
    temperature = make_temperature(temp_kind, (N,))
    kl = kl_from_logits(logits, ref_logits, temperature=temperature, chunk_size=4)
    assert kl.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(kl.double(), ref_kl(logits, ref_logits, temperature), **tol(dtype))


def test_bf16_is_exact_where_naive_bf16_is_not():
    # The bar: bf16 logits, error against fp64 of the same bf16 values <= 1e-5.
    logits = make_logits((16, 32000), torch.bfloat16, scale=4.0)
    labels = torch.randint(0, 32000, (16,), generator=torch.Generator().manual_seed(0))
    ref = ref_log_probs(logits, labels)
    ours = log_probs_from_logits(logits, labels)
    assert (ours.double() - ref).abs().max() <= 1e-5
    naive = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    assert (naive.double() - ref).abs().max() > 1e-3  # what the chunked fp32 path avoids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocabulary(dtype):
    V = 151936
    logits = make_logits((3, V), dtype, scale=4.0)
    labels = torch.tensor([0, V - 1, 12345])
    lp, ent = log_probs_and_entropy_from_logits(logits, labels, chunk_size=2)
    torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), **tol(dtype))
    torch.testing.assert_close(ent.double(), ref_entropy(logits), **tol(dtype))
    ref_logits = (logits.double() * 0.9).to(dtype)
    torch.testing.assert_close(
        kl_from_logits(logits, ref_logits, chunk_size=2).double(),
        ref_kl(logits, ref_logits),
        **tol(dtype),
    )


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_neg_inf_columns_give_finite_values(dtype):
    N, V = 6, 300
    logits = make_logits((N, V), dtype)
    logits[:, 250:] = float("-inf")  # padded vocabulary
    logits[2, :100] = float("-inf")
    labels = torch.randint(0, 100, (N,))
    labels[2] = 150
    lp, ent = log_probs_and_entropy_from_logits(logits, labels, chunk_size=4)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), **tol(dtype))
    torch.testing.assert_close(ent.double(), ref_entropy(logits), **tol(dtype))
    # A label on a -inf column has log-prob -inf (not NaN).
    assert log_probs_from_logits(logits, torch.full((N,), V - 1)).eq(float("-inf")).all()
    # KL between distributions sharing the masked columns is finite.
    ref_logits = logits.clone()
    ref_logits[:, :250] = make_logits((N, 250), dtype, seed=5)
    ref_logits[2, :100] = float("-inf")
    kl = kl_from_logits(logits, ref_logits, chunk_size=4)
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(kl.double(), ref_kl(logits, ref_logits), **tol(dtype))


def test_one_hot_row_has_zero_entropy_and_kl_to_masked_reference_is_inf():
    logits = torch.full((2, 10), float("-inf"))
    logits[:, 3] = 5.0
    assert entropy_from_logits(logits).eq(0).all()
    assert log_probs_from_logits(logits, torch.tensor([3, 3])).eq(0).all()
    ref = torch.zeros(2, 10)
    ref[:, 3] = float("-inf")
    assert kl_from_logits(logits, ref).eq(float("inf")).all()


def test_uniform_entropy_is_log_v():
    for V in (1, 2, 1000, 40000):
        ent = entropy_from_logits(torch.full((3, V), -7.25))
        torch.testing.assert_close(ent.double(), torch.full((3,), math.log(V), dtype=torch.float64))


def test_rows_all_negative():
    logits = -make_logits((5, 4000), torch.float32).abs() * 50 - 1000.0
    labels = torch.randint(0, 4000, (5,))
    lp, ent = log_probs_and_entropy_from_logits(logits, labels, chunk_size=2)
    torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), atol=2e-6, rtol=2e-7)
    torch.testing.assert_close(ent.double(), ref_entropy(logits), atol=2e-6, rtol=2e-7)


def test_fp16_extremes():
    V = 500
    logits = torch.zeros(4, V, dtype=torch.float16)
    logits[0, :] = -65504.0
    logits[0, 7] = 65504.0
    logits[1, :] = 65504.0
    logits[2, ::2] = -65504.0
    logits[3] = make_logits((V,), torch.float16)
    logits[3, 0] = 65504.0
    labels = torch.tensor([7, 3, 0, 1])
    lp, ent = log_probs_and_entropy_from_logits(logits, labels, chunk_size=3)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), atol=2e-6, rtol=2e-7)
    torch.testing.assert_close(ent.double(), ref_entropy(logits), atol=2e-6, rtol=2e-7)
    assert lp[0] == 0 and lp[3] < -65000 and ent[0] == 0
    ref_logits = logits.flip(-1)
    kl = kl_from_logits(logits, ref_logits)
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(kl.double(), ref_kl(logits, ref_logits), atol=1e-6, rtol=2e-7)


@pytest.mark.parametrize(
    ("shape", "k"),
    [((7,), None), ((1, 1), None), ((2, 3, 5, 11), None), ((4, 9), 1), ((2, 3, 9), 4), ((5, 3), 0)],
)
def test_odd_shapes(shape, k):
    logits = make_logits(shape, torch.float32)
    V = shape[-1]
    lab_shape = shape[:-1] if k is None else (*shape[:-1], k)
    labels = torch.randint(0, V, lab_shape)
    lp = log_probs_from_logits(logits, labels, chunk_size=2)
    assert lp.shape == lab_shape
    torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), **tol(torch.float32))
    ent = entropy_from_logits(logits, chunk_size=2)
    assert ent.shape == shape[:-1]
    torch.testing.assert_close(ent.double(), ref_entropy(logits), **tol(torch.float32))


def test_empty_batch():
    logits = torch.randn(0, 50, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long)
    lp, ent = log_probs_and_entropy_from_logits(logits, labels)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None and logits.grad.shape == (0, 50)
    assert kl_from_logits(logits, logits.detach()).shape == (0,)


def test_non_contiguous_inputs():
    base = make_logits((3, 12, 2 * 301), torch.float32)
    cases = [
        base[:, 1:-1, :301],  # leading dims not mergeable
        base[..., ::2],  # strided vocabulary
        base[:, :, :301].transpose(0, 1),  # permuted batch dims
        make_logits((301, 10), torch.float32).t(),  # vocabulary is the slow axis
    ]
    for logits in cases:
        labels_full = torch.randint(0, 301, (*logits.shape[:-1], 2))
        labels = labels_full[..., 0]  # non-contiguous labels
        lp, ent = log_probs_and_entropy_from_logits(logits, labels, chunk_size=3)
        torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), **tol(torch.float32))
        torch.testing.assert_close(ent.double(), ref_entropy(logits), **tol(torch.float32))
        ref_logits = logits.contiguous() * 0.5
        torch.testing.assert_close(
            kl_from_logits(logits, ref_logits, chunk_size=5).double(),
            ref_kl(logits, ref_logits),
            **tol(torch.float32),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_boundaries_do_not_change_results(dtype):
    logits = make_logits((13, 257), dtype)
    labels = torch.randint(0, 257, (13,))
    ref_logits = make_logits((13, 257), dtype, seed=9)
    results = []
    for chunk in (1, 2, 4, 5, 12, 13, 100, None):
        lp, ent = log_probs_and_entropy_from_logits(logits, labels, chunk_size=chunk)
        kl = kl_from_logits(logits, ref_logits, chunk_size=chunk)
        results.append((lp, ent, kl))
    for lp, ent, kl in results[1:]:
        torch.testing.assert_close(lp, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(ent, results[0][1], rtol=0, atol=0)
        torch.testing.assert_close(kl, results[0][2], rtol=0, atol=0)
    torch.testing.assert_close(results[0][0].double(), ref_log_probs(logits, labels), **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temp_kind", ["float", "tensor"])
def test_temperature_equals_prescaled_logits(dtype, temp_kind):
    # The result equals the call on logits / T (division in fp32): bitwise, values and grads.
    logits = make_logits((6, 400), dtype)
    labels = torch.randint(0, 400, (6,))
    temperature = make_temperature(temp_kind, (6,))
    t32 = (
        temperature.float().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    )
    x1 = logits.clone().requires_grad_(True)
    x2 = (logits.float() / t32).requires_grad_(True)
    lp1, h1 = log_probs_and_entropy_from_logits(x1, labels, temperature=temperature)
    lp2, h2 = log_probs_and_entropy_from_logits(x2, labels)
    torch.testing.assert_close(lp1, lp2, rtol=0, atol=0)
    torch.testing.assert_close(h1, h2, rtol=0, atol=0)
    ref2 = x2.detach() * 0.5
    torch.testing.assert_close(
        kl_from_logits(logits, (ref2 * t32).to(dtype), temperature=temperature),
        kl_from_logits(x2.detach(), ((ref2 * t32).to(dtype).float() / t32)),
        rtol=0,
        atol=0,
    )
    (lp1.sum() + h1.sum()).backward()
    (lp2.sum() + h2.sum()).backward()
    # d/dlogits = d/dz / T
    torch.testing.assert_close(x1.grad.float(), (x2.grad / t32).to(dtype).float())


def test_temperature_broadcasts_per_sequence():
    logits = make_logits((2, 5, 64), torch.float32)
    labels = torch.randint(0, 64, (2, 5))
    temp = torch.tensor([[0.5], [2.0]])
    lp = log_probs_from_logits(logits, labels, temperature=temp)
    torch.testing.assert_close(
        lp.double(), ref_log_probs(logits, labels, temp.expand(2, 5)), **tol(torch.float32)
    )


def test_inputs_are_not_modified():
    logits = make_logits((5, 70), torch.bfloat16).requires_grad_(True)
    ref_logits = make_logits((5, 70), torch.float32, seed=4).requires_grad_(True)
    labels = torch.randint(0, 70, (5,))
    temp = torch.rand(5) + 0.5
    before = [t.detach().clone() for t in (logits, ref_logits, labels, temp)]
    lp, ent = log_probs_and_entropy_from_logits(logits, labels, temperature=temp, chunk_size=2)
    kl = kl_from_logits(logits, ref_logits, temperature=temp, chunk_size=2)
    (lp.sum() + ent.sum() + kl.sum()).backward()
    for b, t in zip(before, (logits, ref_logits, labels, temp)):
        torch.testing.assert_close(t.detach(), b, rtol=0, atol=0)


def test_kl_of_identical_inputs_is_zero_and_kl_is_nonnegative():
    logits = make_logits((20, 333), torch.float32)
    assert kl_from_logits(logits, logits.clone()).eq(0).all()
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        other = logits + 1e-4 * torch.randn(logits.shape, generator=g)
        assert (kl_from_logits(logits, other) >= 0).all()


def test_nan_logits_stay_visible():
    logits = make_logits((3, 50), torch.float32)
    logits[1, 7] = float("nan")
    lp, ent = log_probs_and_entropy_from_logits(logits, torch.zeros(3, dtype=torch.long))
    assert lp[1].isnan() and ent[1].isnan()
    assert torch.isfinite(lp[[0, 2]]).all() and torch.isfinite(ent[[0, 2]]).all()
    ref = make_logits((3, 50), torch.float32, seed=1)
    assert kl_from_logits(logits, ref)[1].isnan()
    assert kl_from_logits(ref, logits)[1].isnan()


def test_verl_spelling_lives_in_compat():
    from rlmath.compat.verl import logprobs_from_logits

    logits = make_logits((4, 30), torch.float32)
    labels = torch.randint(0, 30, (4,))
    expected = log_probs_from_logits(logits, labels)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected, rtol=0, atol=0)
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels, False), expected, rtol=0, atol=0
    )


def test_validate_label_range():
    logits = torch.randn(2, 3, 10)
    for bad in (10, -1):
        labels = torch.zeros(2, 3, dtype=torch.long)
        labels[1, 2] = bad
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*" + str(bad)):
            log_probs_from_logits(logits, labels, validate=True)
        with pytest.raises(ValueError, match="labels"):
            log_probs_and_entropy_from_logits(logits, labels, validate=True)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=torch.tensor([1.0, 0.0]).view(2, 1), validate=True)


def test_bad_input_errors():
    logits = torch.randn(4, 10)
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(TypeError, match="logits"):
        log_probs_from_logits(logits.tolist(), labels)
    with pytest.raises(TypeError, match="logits"):
        log_probs_from_logits(torch.zeros(4, 10, dtype=torch.long), labels)
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.zeros(4, 0))
    with pytest.raises(ValueError, match="logits"):
        entropy_from_logits(torch.tensor(1.0))
    with pytest.raises(TypeError, match="labels"):
        log_probs_from_logits(logits, labels.float())
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(logits, torch.zeros(4, 2, 1, dtype=torch.long))
    for bad_t in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            log_probs_from_logits(logits, labels, temperature=bad_t)
    with pytest.raises(TypeError, match="temperature"):
        log_probs_from_logits(logits, labels, temperature=True)
    with pytest.raises(TypeError, match="temperature"):
        log_probs_from_logits(logits, labels, temperature="1")
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(logits, labels, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=2.0)
    with pytest.raises(ValueError, match="ref_logits"):
        kl_from_logits(logits, torch.randn(4, 11))
    with pytest.raises(TypeError, match="ref_logits"):
        kl_from_logits(logits, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_half_precision_values_are_those_of_the_upcast_logits(dtype, temperature):
    # Every pass upcasts a half-precision chunk exactly before any arithmetic,
    # so its results are bitwise those of the fp32 copy of the same logits.
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 1000, generator=g) * 4).to(dtype)
    r = (torch.randn(9, 1000, generator=g) * 4).to(dtype)
    x[2, 5:40] = float("-inf")
    labels = torch.randint(0, 1000, (9,), generator=g)
    kw = {"temperature": temperature, "chunk_size": 4}
    for fn in (
        lambda z, q: R.log_probs_and_entropy_from_logits(z, labels, **kw),
        lambda z, q: R.kl_from_logits(z, q, **kw),
        lambda z, q: R.sum_pi_squared_from_logits(z, **kw),
    ):
        half, full = fn(x, r), fn(x.float(), r.float())
        for a, b in zip(
            half if isinstance(half, tuple) else (half,),
            full if isinstance(full, tuple) else (full,),
        ):
            assert torch.equal(a, b)
