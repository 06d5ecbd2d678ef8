"""The tree scan behind GAE and discounted returns, against a backward loop."""

from __future__ import annotations

import pytest
import torch

from rlmath import reverse_discounted_cumsum


def loop(x: torch.Tensor, c: float) -> torch.Tensor:
    """y[t] = x[t] + c·y[t+1], written as the textbook backward loop."""
    y = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in reversed(range(x.shape[-1])):
        running = x[..., t] + c * running
        y[..., t] = running
    return y


@pytest.mark.parametrize("length", [1, 2, 3, 17, 31, 32, 33, 64, 65, 257, 1000])
@pytest.mark.parametrize("c", [0.0, 1e-30, 0.5, 0.95, 1.0])
def test_matches_loop_fp64(length, c):
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(3, length, generator=gen, dtype=torch.float64)
    expected = loop(x, c)
    got = reverse_discounted_cumsum(x, c)
    assert got.dtype == torch.float64
    scale = expected.abs().max().clamp(min=1)
    assert (got - expected).abs().max() <= 1e-12 * scale


def test_leading_dims_and_no_input_change():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 45, generator=gen, dtype=torch.float64)
    before = x.clone()
    got = reverse_discounted_cumsum(x, 0.9)
    assert torch.equal(x, before)
    torch.testing.assert_close(got, loop(x, 0.9), rtol=0, atol=1e-12)


def test_exact_structure_at_the_ends():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0] * 20], dtype=torch.float64)
    # c = 0: the input itself, bit for bit; c = 1: plain suffix sums of integers, exact.
    assert torch.equal(reverse_discounted_cumsum(x, 0.0), x)
    assert torch.equal(reverse_discounted_cumsum(x, 1.0), x.flip(-1).cumsum(-1).flip(-1))


@pytest.mark.parametrize("c", [1.0, 0.95])
def test_fp32_long_sequence(c):
    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(2, 16384, generator=gen, dtype=torch.float64)
    expected = reverse_discounted_cumsum(x64, c)
    got = reverse_discounted_cumsum(x64.float(), c)
    assert got.dtype == torch.float32
    err = (got.double() - expected).abs().max() / expected.abs().max()
    assert err <= 1e-5


def test_small_discount_has_no_denormal_blowup():
    # Powers of c underflow long before the end; the result must stay finite and exact.
    x = torch.ones(1, 300, dtype=torch.float32)
    got = reverse_discounted_cumsum(x, 0.1)
    assert torch.isfinite(got).all()
    terms = torch.arange(300, 0, -1, dtype=torch.float64)  # tokens from t to the end
    expected = (1 - 0.1**terms) / 0.9
    torch.testing.assert_close(got[0].double(), expected, rtol=1e-6, atol=0)


def test_bf16_is_computed_in_fp32():
    x = torch.randn(2, 50).bfloat16()
    got = reverse_discounted_cumsum(x, 0.9)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop(x.double(), 0.9), rtol=1e-6, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="discount"):
        reverse_discounted_cumsum(torch.ones(3), 1.5)
    with pytest.raises(ValueError, match="discount"):
        reverse_discounted_cumsum(torch.ones(3), -0.1)
    with pytest.raises(TypeError, match="values"):
        reverse_discounted_cumsum([1.0, 2.0], 0.5)
    with pytest.raises(TypeError, match="values"):
        reverse_discounted_cumsum(torch.ones(3, dtype=torch.long), 0.5)
    with pytest.raises(ValueError, match="values"):
        reverse_discounted_cumsum(torch.tensor(1.0), 0.5)
