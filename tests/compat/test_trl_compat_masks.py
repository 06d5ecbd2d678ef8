"""rlmath.compat.trl's get_off_policy_mask, get_high_entropy_mask and get_soft_overlong_punishment
against fp64 loops written from TRL's definitions (the peers tests run TRL itself)."""

from __future__ import annotations

import pytest
import torch

from rlmath.compat import trl as ct


def test_get_off_policy_mask_shape_dtype_and_rule():
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(5, 4, generator=gen, dtype=torch.float64)
    sampling = lp + torch.randn(5, 4, generator=gen, dtype=torch.float64) * 0.5
    mask = (torch.rand(5, 4, generator=gen) < 0.8).long()
    mask[:, 0] = 1
    adv = torch.randn(5, 1, generator=gen, dtype=torch.float64)
    out = ct.get_off_policy_mask(adv, lp, sampling, mask, 0.1)
    assert out.shape == (5, 1) and out.dtype == mask.dtype
    for i in range(5):
        cols = [j for j in range(4) if mask[i, j]]
        kl = sum(float(sampling[i, j] - lp[i, j]) for j in cols) / len(cols)
        assert out[i, 0].item() == int(adv[i, 0] >= 0 or kl <= 0.1)


def test_get_high_entropy_mask_is_the_quantile_rule():
    gen = torch.Generator().manual_seed(1)
    entropies = torch.rand(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) < 0.7
    for level in (0.0, 0.3, 0.8, 1.0):
        want = mask & (entropies >= torch.quantile(entropies[mask], level))
        assert torch.equal(ct.get_high_entropy_mask(entropies, mask, level), want)
    with pytest.raises(ValueError, match="threshold"):
        ct.get_high_entropy_mask(entropies, mask, 1.5)


def test_get_soft_overlong_punishment_docstring_example():
    fn = ct.get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    # TRL's documented example: 90 tokens, between 80 and 100, gives −0.5.
    assert fn([[1] * 90, [1] * 80, [1] * 100, [1] * 120]) == [-0.5, 0.0, -1.0, -1.0]
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        ct.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=0)
