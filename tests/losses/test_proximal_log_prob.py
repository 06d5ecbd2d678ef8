"""AReaL's log-linear proximal log-probs: the version rule by hand, masking, errors."""

from __future__ import annotations

import pytest
import torch

from rlmath import loglinear_proximal_log_prob

from ..host_sync import forbid_host_reads


def test_worked_example():
    # Current version v_θ = 5, so v_prox = 4. Behaviour log-prob −2, current −1.
    #   v_behave = 3: α = (4 − 3)/(5 − 3) = 0.5 → −2 + 0.5·(−1 + 2) = −1.5
    #   v_behave = 1: α = 3/4                  → −2 + 0.75 = −1.25
    #   v_behave = 4: α = 0 (the proximal policy generated it) → −2
    #   v_behave = 5 (current) or −1 (prompt): α = 0 → −2
    behave = torch.full((1, 5), -2.0, dtype=torch.float64)
    current = torch.full((1, 5), -1.0, dtype=torch.float64, requires_grad=True)
    versions = torch.tensor([[3, 1, 4, 5, -1]])
    out = loglinear_proximal_log_prob(behave, current, versions, 5)
    assert out.tolist() == [[-1.5, -1.25, -2.0, -2.0, -2.0]]
    assert not out.requires_grad
    # The version may be a 0-d tensor on the device (no host read).
    with forbid_host_reads():
        same = loglinear_proximal_log_prob(behave, current, versions, torch.tensor(5))
    assert torch.equal(same, out)


def _reference(behave, current, versions, v_theta):
    out = behave.clone()
    for idx in range(behave.numel()):
        i, j = divmod(idx, behave.shape[1])
        v = int(versions[i, j])
        if v >= 0 and v_theta - v > 0:
            alpha = min(max((v_theta - 1 - v) / (v_theta - v), 0.0), 1.0)
            out[i, j] = behave[i, j] + alpha * (current[i, j] - behave[i, j])
    return out


def test_matches_reference_and_masks():
    gen = torch.Generator().manual_seed(0)
    behave = -torch.rand(6, 8, generator=gen, dtype=torch.float64) * 3
    current = behave + torch.randn(6, 8, generator=gen, dtype=torch.float64) * 0.3
    versions = torch.randint(-1, 9, (6, 8), generator=gen)
    torch.testing.assert_close(
        loglinear_proximal_log_prob(behave, current, versions, 9),
        _reference(behave, current, versions, 9),
        rtol=1e-15,
        atol=0,
    )
    mask = torch.rand(6, 8, generator=gen) < 0.7
    dirty = torch.where(mask, current, torch.nan)
    out = loglinear_proximal_log_prob(behave, dirty, versions, 9, response_mask=mask)
    torch.testing.assert_close(out, torch.where(mask, _reference(behave, current, versions, 9), 0))
    low = loglinear_proximal_log_prob(behave.bfloat16(), current.bfloat16(), versions, 9)
    assert low.dtype == torch.float32


def test_bad_input():
    x = torch.zeros(2, 3)
    v = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match="versions"):
        loglinear_proximal_log_prob(x, x, v.float(), 1)
    with pytest.raises(ValueError, match="versions"):
        loglinear_proximal_log_prob(x, x, v[:, :2], 1)
    with pytest.raises(TypeError, match="current_version"):
        loglinear_proximal_log_prob(x, x, v, 1.5)
    with pytest.raises(ValueError, match="current_version"):
        loglinear_proximal_log_prob(x, x, v, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="behave_log_prob"):
        loglinear_proximal_log_prob(torch.zeros(2, 2), x, v, 1)
