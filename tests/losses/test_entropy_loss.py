"""compute_entropy_loss against −Σ p log p per token in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from rlmath import compute_entropy_loss

from .helpers import MODES, agg_extra, ragged_mask, ref_agg


def _ref_entropy(logits_row, temperature=1.0):
    z = [float(v) / temperature for v in logits_row]
    m = max(z)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in z]
    s = sum(e)
    return -sum((x / s) * math.log(x / s) for x in e if x > 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference(mode, temperature):
    gen = torch.Generator().manual_seed(4)
    mask = ragged_mask(4, 5, gen)
    logits = torch.randn(4, 5, 7, generator=gen, dtype=torch.float64) * 2
    got = compute_entropy_loss(
        logits, mask, loss_agg_mode=mode, temperature=temperature, **agg_extra(mask)
    )[0]
    per = {
        (i, t): torch.tensor(_ref_entropy(logits[i, t], temperature), dtype=torch.float64)
        for i in range(4)
        for t in range(5)
        if mask[i, t]
    }
    want = ref_agg(per, mask, mode, 5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_gradient_is_minus_p_times_centred_logits():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 1, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    compute_entropy_loss(logits, mask)[0].backward()
    p = torch.softmax(logits.detach(), -1)
    z = logits.detach()
    want = -p * (z - (p * z).sum(-1, keepdim=True))
    torch.testing.assert_close(logits.grad, want, rtol=1e-10, atol=1e-12)


def test_minus_inf_logits_give_no_nan():
    logits = torch.tensor(
        [[[0.0, -math.inf, 1.0, -math.inf]]], dtype=torch.float64, requires_grad=True
    )
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss = compute_entropy_loss(logits, mask)[0]
    loss.backward()
    assert loss.item() == pytest.approx(_ref_entropy(logits[0, 0].detach()))
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 0, [1, 3]] == 0).all()


def test_bf16_logits():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 50, generator=gen).to(torch.bfloat16)
    mask = torch.ones(2, 3, dtype=torch.bool)
    got = compute_entropy_loss(logits, mask)[0]
    want = compute_entropy_loss(logits.double(), mask)[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_bad_input():
    logits = torch.zeros(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="temperature"):
        compute_entropy_loss(logits, mask, temperature=0.0)
    with pytest.raises(ValueError, match="response_mask"):
        compute_entropy_loss(logits, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="logits"):
        compute_entropy_loss(torch.zeros(4), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_entropy_loss(logits, mask, loss_agg_mode="mean")
