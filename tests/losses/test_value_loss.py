"""compute_value_loss against the clipped value loss written per token in fp64."""

from __future__ import annotations

import pytest
import torch

from rlmath import compute_value_loss

from .helpers import MODES, agg_extra, ragged_mask, ref_agg


def _ref(vp, ret, val, mask, c, mode):
    per, clipped = {}, []
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            l1 = (vp[i, t] - ret[i, t]) ** 2
            if c is None:
                per[(i, t)] = l1
                continue
            v_clip = torch.clamp(vp[i, t], val[i, t] - c, val[i, t] + c)
            l2 = (v_clip - ret[i, t]) ** 2
            per[(i, t)] = torch.maximum(l1, l2)
            clipped.append(float(l2 > l1))
    frac = sum(clipped) / len(clipped) if clipped else 0.0
    return 0.5 * ref_agg(per, mask, mode, mask.shape[1]), frac


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("c", [0.2, None, 0.0])
def test_matches_reference(mode, c):
    gen = torch.Generator().manual_seed(2)
    mask = ragged_mask(5, 6, gen)
    vp, ret, val = (torch.randn(5, 6, generator=gen, dtype=torch.float64) for _ in range(3))
    a = vp.clone().requires_grad_()
    loss, frac = compute_value_loss(
        a, ret, val, mask, cliprange_value=c, loss_agg_mode=mode, **agg_extra(mask)
    )
    frac = frac["vf_clipfrac"]
    loss.backward()
    b = vp.clone().requires_grad_()
    want, want_frac = _ref(b, ret, val, mask, c, mode)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert frac.item() == pytest.approx(want_frac) and frac.dim() == 0


def test_clip_regions_by_hand():
    # returns 1, old values 0, c = 0.2
    vp = torch.tensor([[0.5, 0.1, -0.5]], dtype=torch.float64, requires_grad=True)
    ret = torch.ones(1, 3, dtype=torch.float64)
    val = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, frac = compute_value_loss(
        vp, ret, val, mask, cliprange_value=0.2, loss_agg_mode="token-sum"
    )
    frac = frac["vf_clipfrac"]
    loss.backward()
    # 0.5: clipped to 0.2, (0.2-1)^2 = 0.64 > 0.25 -> clipped term, no gradient
    # 0.1: inside the band, 0.81, gradient (0.1 - 1)
    # -0.5: clipped to -0.2 -> 1.44 < 2.25: unclipped term, gradient (-0.5 - 1)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25))
    torch.testing.assert_close(vp.grad, torch.tensor([[0.0, -0.9, -1.5]], dtype=torch.float64))
    assert frac.item() == pytest.approx(1 / 3)


def test_low_precision_and_dtypes():
    gen = torch.Generator().manual_seed(3)
    mask = ragged_mask(4, 32, gen)
    vp, ret, val = (torch.randn(4, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    loss, frac = compute_value_loss(vp, ret, val, mask, cliprange_value=0.5)
    frac = frac["vf_clipfrac"]
    want, _ = compute_value_loss(vp.double(), ret.double(), val.double(), mask, cliprange_value=0.5)
    assert loss.dtype == torch.float32 and frac.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)


def test_bad_input():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(x, x, x, m, cliprange_value=-0.1)
    with pytest.raises(ValueError, match="returns"):
        compute_value_loss(x, torch.zeros(3, 2), x, m, cliprange_value=0.1)
    with pytest.raises(ValueError, match="values"):
        compute_value_loss(x, x, torch.zeros(2), m, cliprange_value=0.1)
    with pytest.raises(ValueError, match="response_mask"):
        compute_value_loss(x, x, x, torch.ones(2, 2), cliprange_value=0.1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_value_loss(x, x, x, m, cliprange_value=0.1, loss_agg_mode="mean")
    with pytest.raises(TypeError, match="vpreds"):
        compute_value_loss(x.long(), x, x, m, cliprange_value=0.1)
