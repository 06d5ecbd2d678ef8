"""Masked statistics against fp64 references written from the definitions."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import masked_mean, masked_sum, masked_var, masked_whiten

# ---------------------------------------------------------------- references


def ref_stats(values, mask):
    """Weighted n, sum, mean, unbiased/biased var over nonzero mask entries, in Python floats."""
    pairs = [
        (float(v), float(w))
        for v, w in zip(values.flatten().tolist(), mask.flatten().tolist())
        if w != 0
    ]
    n = sum(w for _, w in pairs)
    s = sum(v * w for v, w in pairs)
    mean = s / n if n > 0 else 0.0
    sq = sum(w * (v - mean) ** 2 for v, w in pairs)
    biased = sq / n if n > 0 else 0.0
    unbiased = sq / (n - 1) if n > 1 else 0.0
    return n, s, mean, unbiased, biased


def rand_case(shape, p=0.6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(shape, generator=g) < p
    return values.to(dtype), mask


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("seed", range(3))
def test_matches_fp64_reference(shape, seed):
    values, mask = rand_case(shape, seed=seed)
    n, s, mean, unbiased, biased = ref_stats(values, mask)
    assert masked_sum(values, mask).item() == pytest.approx(s, abs=1e-12)
    assert masked_mean(values, mask).item() == pytest.approx(mean, abs=1e-12)
    assert masked_var(values, mask).item() == pytest.approx(unbiased, abs=1e-12)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(biased, abs=1e-12)


def test_axis_reductions_match_per_row_reference():
    values, mask = rand_case((5, 9), seed=4)
    mask[2] = False
    mask[3] = False
    mask[3, 4] = True  # a single valid element: unbiased variance defined as 0
    for axis in (1, -1):
        means = masked_mean(values, mask, axis=axis)
        variances = masked_var(values, mask, axis=axis)
        sums = masked_sum(values, mask, axis=axis)
        for i in range(5):
            n, s, mean, unbiased, _ = ref_stats(values[i], mask[i])
            assert sums[i].item() == pytest.approx(s, abs=1e-12)
            assert means[i].item() == pytest.approx(mean, abs=1e-12)
            assert variances[i].item() == pytest.approx(unbiased, abs=1e-12)
    col_means = masked_mean(values, mask, axis=0)
    for j in range(9):
        assert col_means[j].item() == pytest.approx(ref_stats(values[:, j], mask[:, j])[2])


def test_tuple_axis_equals_flattened():
    values, mask = rand_case((3, 4, 5), seed=5)
    got = masked_var(values, mask, axis=(1, 2))
    for i in range(3):
        assert got[i].item() == pytest.approx(ref_stats(values[i], mask[i])[3], abs=1e-12)


def test_var_equals_torch_var_on_selected():
    values, mask = rand_case((6, 11), seed=7)
    torch.testing.assert_close(masked_var(values, mask), torch.var(values[mask]))
    torch.testing.assert_close(
        masked_var(values, mask, unbiased=False), torch.var(values[mask], unbiased=False)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_against_fp64_reference(dtype):
    values, mask = rand_case((16, 64), seed=3)
    low = values.to(dtype)
    exact = low.double()  # the reference sees the same rounded inputs
    _, _, mean, unbiased, _ = ref_stats(exact, mask)
    assert masked_mean(low, mask).dtype == torch.float32
    assert masked_mean(low, mask).item() == pytest.approx(mean, rel=1e-5, abs=1e-6)
    assert masked_var(low, mask).item() == pytest.approx(unbiased, rel=1e-5)
    whitened = masked_whiten(low, mask)
    assert whitened.dtype == torch.float32
    ref = torch.where(mask, (exact - mean) / math.sqrt(unbiased + 1e-8), 0)
    torch.testing.assert_close(whitened.double(), ref, rtol=1e-5, atol=1e-5)


def test_fp16_sum_does_not_overflow():
    # 4096 × 60000 overflows fp16 (max 65504); accumulation is in fp32.
    values = torch.full((4096,), 60000.0, dtype=torch.float16)
    mask = torch.ones(4096, dtype=torch.bool)
    assert masked_sum(values, mask).item() == 60000.0 * 4096
    assert masked_mean(values, mask).item() == 60000.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_empty_mask_gives_zero_in_every_dtype(dtype):
    values = torch.randn(3, 4).to(dtype)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    for out in (
        masked_sum(values, mask),
        masked_mean(values, mask),
        masked_var(values, mask),
        masked_var(values, mask, unbiased=False),
        masked_whiten(values, mask),
        masked_mean(values, mask, axis=1),
    ):
        assert not torch.isnan(out).any()
        assert (out == 0).all()


def test_single_element_unbiased_var_is_zero():
    values = torch.tensor([3.0, float("nan")])
    mask = torch.tensor([True, False])
    assert masked_var(values, mask).item() == 0.0
    assert masked_mean(values, mask).item() == 3.0
    assert masked_whiten(values, mask).tolist() == [0.0, 0.0]


def test_float_mask_acts_as_weights():
    values = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    weights = torch.tensor([0.5, 2.0, 0.0], dtype=torch.float64)
    assert masked_sum(values, weights).item() == pytest.approx(0.5 + 4.0)
    assert masked_mean(values, weights).item() == pytest.approx(4.5 / 2.5)
    # frequency weights: weight 2 means "this value twice"
    repeated = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    w_int = torch.tensor([1, 2, 0])
    torch.testing.assert_close(masked_var(values, w_int), torch.var(repeated))


def test_whiten_mean_zero_var_one_and_shift_mean_false():
    values, mask = rand_case((8, 10), seed=11)
    w = masked_whiten(values, mask)
    assert w[mask].mean().item() == pytest.approx(0.0, abs=1e-12)
    assert w[mask].var().item() == pytest.approx(1.0, abs=1e-6)
    assert (w[~mask] == 0).all()
    mean = values[mask].mean()
    kept = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(kept[mask], w[mask] + mean)
    assert (kept[~mask] == 0).all()


def test_nan_on_valid_position_propagates():
    values = torch.tensor([1.0, float("nan"), 3.0])
    mask = torch.tensor([True, True, False])
    assert torch.isnan(masked_mean(values, mask))
    assert torch.isnan(masked_var(values, mask))
    assert torch.isnan(masked_sum(values, mask))


def test_inputs_not_modified():
    values, mask = rand_case((4, 6), seed=2)
    values[~mask] = float("nan")
    v0, m0 = values.clone(), mask.clone()
    for fn in (masked_sum, masked_mean, masked_var, masked_whiten):
        fn(values, mask)
    assert torch.equal(m0, mask)
    assert torch.equal(v0.nan_to_num(7.0), values.nan_to_num(7.0))


# ---------------------------------------------------------------- properties


junk = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 100.0])


@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    fill=junk,
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16]),
)
def test_masked_values_never_change_outputs_or_gradients(rows, cols, seed, fill, dtype):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(rows, cols, generator=g).to(dtype)
    mask = torch.rand(rows, cols, generator=g) < 0.5
    dirty = torch.where(mask, clean, torch.tensor(fill, dtype=dtype))
    for fn in (
        masked_sum,
        masked_mean,
        masked_var,
        masked_whiten,
        lambda v, m: masked_mean(v, m, axis=1),
        lambda v, m: masked_var(v, m, axis=0),
    ):
        outs, grads = [], []
        for x in (clean, dirty):
            x = x.clone().requires_grad_(dtype != torch.float16)
            out = fn(x, mask)
            outs.append(out.detach())
            if x.requires_grad:
                (out * torch.arange(1, out.numel() + 1).reshape(out.shape)).sum().backward()
                grads.append(x.grad)
        torch.testing.assert_close(outs[0], outs[1], equal_nan=False, rtol=0, atol=0)
        if grads:
            assert torch.isfinite(grads[1]).all()
            torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


U64 = torch.finfo(torch.float64).eps / 2  # unit roundoff of fp64


def variance_rtol(x: torch.Tensor) -> float:
    """How far two fp64 variance algorithms (rlmath's two-pass, torch's) may be apart, relatively.

    For n values with condition number κ = sqrt(1 + mean²/var) (Chan, Golub & LeVeque
    1983), the two-pass algorithm is within (n + 3)·u + (n·u·κ)² of the exact variance
    and the updating (Welford) algorithm torch uses within about n·u·κ; the sum of both,
    doubled, bounds the difference with room for the last roundings.
    """
    n = x.numel()
    kappa = (1 + float(x.mean()) ** 2 / float(x.var())) ** 0.5
    return 2 * ((n + 3) * U64 + n * U64 * kappa + (n * U64 * kappa) ** 2)


@given(n=st.integers(2, 40), seed=st.integers(0, 2**31 - 1))
def test_var_matches_torch_var_property(n, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g, dtype=torch.float64) * 10
    mask = torch.rand(n, generator=g) < 0.7
    mask[0] = True
    if mask.sum() < 2:
        assert masked_var(values, mask) == 0  # n <= 1: defined as 0
        return
    x = values[mask]
    var = torch.var(x)
    rtol = variance_rtol(x)
    torch.testing.assert_close(masked_var(values, mask), var, rtol=rtol, atol=0)
    w = masked_whiten(values, mask)[mask]
    # w = (x − mean)·s with s = 1/sqrt(var + 1e-8). Its mean is 0 up to the rounding of
    # the mean and of the sum of the w (n terms of size ≤ max|x|·s each): 4·n·u·max|x|·s.
    scale = float(x.abs().max()) / float(var + 1e-8) ** 0.5
    assert abs(float(w.mean())) <= 4 * x.numel() * U64 * scale
    # Its variance is exactly var/(var + eps), not 1 (eps = 1e-8 matters when var is
    # small): within the variance's own error, plus (n + 3)·u for torch.var of w
    # (whose mean is 0, κ = 1) and a few u for the product and the square root.
    want = var / (var + 1e-8)
    w_rtol = rtol + 2 * (x.numel() + 3) * U64 + 8 * U64
    torch.testing.assert_close(w.var(), want, rtol=w_rtol, atol=0)


def test_gradients_match_fp64_reference():
    values, mask = rand_case((3, 5), seed=8)
    x = values.clone().requires_grad_()
    masked_var(x, mask).backward()
    n = mask.sum()
    mean = values[mask].mean()
    expected = torch.where(mask, 2 * (values - mean) / (n - 1), 0)
    torch.testing.assert_close(x.grad, expected)
    assert torch.autograd.gradcheck(
        lambda v: masked_whiten(v, mask), (values.clone().requires_grad_(),)
    )


# ---------------------------------------------------------------- bad input


def test_bad_input_errors_name_the_argument():
    v = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"mask must have the shape of values \(3, 4\)"):
        masked_mean(v, torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="values must be a torch.Tensor"):
        masked_mean([1.0, 2.0], torch.ones(2))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        masked_var(v, [[1] * 4] * 3)
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(v, torch.ones(3, 4), eps=0.0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("fn", [masked_sum, masked_mean, masked_var, masked_whiten])
def test_complex_values_are_rejected(fn, dtype):
    """Complex values used to lose their imaginary part with only a warning."""
    v = torch.randn(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=rf"values must be a real .* got dtype {dtype}"):
        fn(v, torch.ones(3, 4, dtype=torch.bool))
