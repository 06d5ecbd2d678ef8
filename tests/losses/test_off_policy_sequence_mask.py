"""Off-policy sequence masking (DeepSeek-V3.2 eq. 9): hand-worked, fp64 loop, masking, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import off_policy_sequence_mask

from ..host_sync import forbid_host_reads
from .helpers import policy_batch


def test_worked_example():
    # δ = mean over valid tokens of (log π_old − log π_θ); threshold 0.5.
    # Row 0: A < 0, δ = (0.4 + 0.8)/2 = 0.6 > 0.5: dropped.
    # Row 1: A < 0, δ = 0.4: kept.   Row 2: A > 0, δ = 0.9: kept (only A < 0 is dropped).
    # Row 3: δ = 1.0 with advantages (−1, 0): the A < 0 token dropped, A = 0 kept.
    # Row 4: δ exactly 0.5 with A < 0: kept (the rule is δ > threshold).
    new = torch.full((5, 2), -1.0, dtype=torch.float64)
    old = new + torch.tensor(
        [[0.4, 0.8], [0.4, 0.4], [0.9, 0.9], [1.0, 1.0], [0.25, 0.75]], dtype=torch.float64
    )
    adv = torch.tensor([[-1, -1], [-1, -1], [1, 1], [-1, 0], [-2, -2]], dtype=torch.float64)
    mask = torch.ones(5, 2, dtype=torch.bool)
    out = off_policy_sequence_mask(old, new, adv, mask, threshold=0.5)
    assert out.keep.tolist() == [
        [False, False], [True, True], [True, True], [False, True], [True, True]
    ]  # fmt: skip
    torch.testing.assert_close(out.sequence_kl, torch.tensor([0.6, 0.4, 0.9, 1.0, 0.5]).double())
    assert out.metrics["opsm_masked_frac"].item() == pytest.approx(3 / 10)
    assert out.metrics["opsm_seq_masked_frac"].item() == pytest.approx(2 / 5)
    assert out.metrics["opsm_sequence_kl_mean"].item() == pytest.approx(3.4 / 5)
    # One advantage per sequence, (B, 1), as TRL passes it.
    per_seq = off_policy_sequence_mask(old, new, adv[:, :1], mask, threshold=0.5)
    assert per_seq.keep[3].tolist() == [False, False]


def _reference(old, new, adv, mask, threshold):
    keep = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[i, t]]
        kl = sum(float(old[i, t] - new[i, t]) for t in cols) / len(cols) if cols else 0.0
        for t in cols:
            keep[i, t] = not (float(adv[i, t]) < 0 and kl > threshold)
    return keep


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_loop_reference(seed):
    old, new, adv, mask = policy_batch(9, 8, seed, scale=0.8)
    for threshold in (0.0, 0.1, 0.3):
        got = off_policy_sequence_mask(old, new, adv, mask, threshold=threshold).keep
        assert torch.equal(got, _reference(old, new, adv, mask, threshold))


@given(
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    seed=st.integers(0, 1000),
)
def test_masked_values_never_leak(garbage, seed):
    old, new, adv, mask = policy_batch(4, 5, seed, scale=0.8)
    a = off_policy_sequence_mask(old, new, adv, mask, threshold=0.2)
    dirty = [torch.where(mask, x, garbage) for x in (old, new, adv)]
    b = off_policy_sequence_mask(*dirty, mask, threshold=0.2)
    assert torch.equal(a.keep, b.keep) and torch.equal(a.sequence_kl, b.sequence_kl)
    for k in a.metrics:
        assert torch.equal(a.metrics[k], b.metrics[k])


def test_low_precision_and_rows_are_independent():
    old, new, adv, mask = policy_batch(8, 16, 5, dtype=torch.bfloat16, scale=0.8)
    low = off_policy_sequence_mask(old, new, adv, mask, threshold=0.3)
    wide = off_policy_sequence_mask(old.double(), new.double(), adv.double(), mask, threshold=0.3)
    assert low.sequence_kl.dtype == torch.float32
    # fp32 sums of ≤ 16 bf16-exact terms of size ≤ 4: within 16·2^-24·4 of fp64.
    torch.testing.assert_close(low.sequence_kl.double(), wide.sequence_kl, rtol=0, atol=4e-6)
    assert torch.equal(low.keep, wide.keep)
    # Each sequence is judged on its own: any split of the rows gives the same rows.
    part = off_policy_sequence_mask(old[3:], new[3:], adv[3:], mask[3:], threshold=0.3)
    assert torch.equal(part.keep, low.keep[3:])


def test_empty_batch_no_sync_and_bad_input():
    for shape in ((0, 4), (3, 0)):
        z = torch.zeros(shape)
        out = off_policy_sequence_mask(z, z, z, torch.ones(shape, dtype=torch.bool), threshold=0.1)
        assert out.keep.shape == shape and all(v.item() == 0 for v in out.metrics.values())
    old, new, adv, mask = policy_batch(4, 6, 1, dtype=torch.float32)
    with forbid_host_reads():
        off_policy_sequence_mask(old, new, adv, mask, threshold=0.5)
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="threshold"):
        off_policy_sequence_mask(x, x, x, m, threshold=-0.1)
    with pytest.raises(ValueError, match="advantages"):
        off_policy_sequence_mask(x, x, torch.zeros(2, 2), m, threshold=0.1)
    with pytest.raises(ValueError, match="old_log_prob"):
        off_policy_sequence_mask(torch.zeros(2, 4), x, x, m, threshold=0.1)
    with pytest.raises(TypeError, match="log_prob"):
        off_policy_sequence_mask(x, x.long(), x, m, threshold=0.1)
    with pytest.raises(ValueError, match="response_mask"):
        off_policy_sequence_mask(x, x, x, torch.ones(3, 3), threshold=0.1)
