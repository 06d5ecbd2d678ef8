"""VAPO's positive-example NLL: hand-worked values, fp64 reference, masking, data parallelism."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import compute_positive_example_nll_loss

from .helpers import MODES, agg_extra, policy_batch, ref_agg
from .test_dp_invariance import B, T, _simulate


def test_worked_example():
    # Two correct responses of 2 and 1 valid tokens (log-probs −1, −2 and −3) and a wrong
    # one (−4, −5): eq. 10 is (1 + 2 + 3)/3 = 2; each positive token's gradient −1/3.
    log_prob = torch.tensor([[-1.0, -2.0], [-3.0, 9.0], [-4.0, -5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    positive = torch.tensor([True, True, False])
    leaf = log_prob.clone().requires_grad_()
    loss, m = compute_positive_example_nll_loss(leaf, mask, positive)
    loss.backward()
    assert loss.item() == pytest.approx(2.0)
    third = -1 / 3
    torch.testing.assert_close(
        leaf.grad, torch.tensor([[third, third], [third, 0], [0, 0]], dtype=torch.float64)
    )
    assert m["positive_nll"].item() == pytest.approx(2.0)
    assert m["positive_token_frac"].item() == pytest.approx(3 / 5)
    # No correct response: 0, with a zero gradient.
    none, _ = compute_positive_example_nll_loss(leaf, mask, torch.zeros(3, dtype=torch.bool))
    assert none.item() == 0.0


def _reference(log_prob, mask, positive, mode):
    """−log π on the valid tokens of positive rows, aggregated over those tokens only."""
    sel = mask & positive[:, None]
    loss = {(i, t): -log_prob[i, t] for i in range(sel.shape[0]) for t in range(sel.shape[1])}
    return ref_agg(loss, sel, mode, sel.shape[1])


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(mode):
    _, log_prob, _, mask = policy_batch(7, 6, 3)
    positive = torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.int64)
    leaf = log_prob.clone().requires_grad_()
    extra = agg_extra(mask & positive.bool()[:, None])
    loss, _ = compute_positive_example_nll_loss(leaf, mask, positive, loss_agg_mode=mode, **extra)
    loss.backward()
    ref_leaf = log_prob.clone().requires_grad_()
    want = _reference(ref_leaf, mask, positive.bool(), mode)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-12, atol=1e-12)
    # A per-token ``positive`` equal to the per-row flags gives the same loss.
    per_token = positive[:, None].expand(-1, 6)
    same, _ = compute_positive_example_nll_loss(log_prob, mask, per_token, loss_agg_mode=mode,
                                                **extra)  # fmt: skip
    torch.testing.assert_close(same, want.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_exact_under_data_parallelism(mode):
    _, log_prob, _, mask = policy_batch(B, T, 9, empty_rows=(1, 7))
    positive = (torch.arange(B) % 3 != 0)[:, None].expand(B, T)  # per token: sliced like the rest
    # The global counts are those of the positive tokens.
    tensors = {"lp": log_prob, "mask": mask & positive, "m0": mask, "pos": positive}

    def loss_fn(t, agg):
        loss, _ = compute_positive_example_nll_loss(
            t["lp"], t["m0"], t["pos"], loss_agg_mode=mode, **agg
        )
        return loss

    _simulate(loss_fn, tensors, "lp", 9)


@given(
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 1000),
)
def test_masked_values_never_leak(garbage, mode, seed):
    _, log_prob, _, mask = policy_batch(4, 5, seed)
    positive = torch.tensor([True, False, True, True])
    # Junk on masked tokens and on every token of the negative row.
    junk = mask & positive[:, None]
    dirty = torch.where(junk, log_prob, garbage)
    out = []
    for x in (log_prob, dirty):
        leaf = x.clone().requires_grad_()
        loss, m = compute_positive_example_nll_loss(leaf, mask, positive, loss_agg_mode=mode,
                                                    **agg_extra(mask & positive[:, None]))  # fmt: skip
        loss.backward()
        out.append((loss, leaf.grad, m))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    for k in out[0][2]:
        assert torch.equal(out[0][2][k], out[1][2][k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_against_fp64_of_the_same_inputs(dtype):
    _, log_prob, _, mask = policy_batch(6, 16, 5, dtype=dtype)
    positive = torch.tensor([1, 1, 0, 1, 0, 1])
    leaf = log_prob.clone().requires_grad_()
    loss, _ = compute_positive_example_nll_loss(leaf, mask, positive)
    loss.backward()
    want = _reference(log_prob.double(), mask, positive.bool(), "token-mean")
    assert loss.dtype == torch.float32
    # fp32 accumulation of ≤ 96 terms of size ≤ 3: far below 1e-6 relative.
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)


def test_empty_batch_and_bad_input():
    for shape in ((0, 4), (3, 0)):
        x = torch.zeros(shape, requires_grad=True)
        loss, m = compute_positive_example_nll_loss(
            x, torch.ones(shape, dtype=torch.bool), torch.ones(shape[0], dtype=torch.bool)
        )
        loss.backward()
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in m.values())
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="positive"):
        compute_positive_example_nll_loss(x, mask, torch.ones(3))
    with pytest.raises(TypeError, match="positive"):
        compute_positive_example_nll_loss(x, mask, [True, False])
    with pytest.raises(TypeError, match="log_prob"):
        compute_positive_example_nll_loss(x.long(), mask, torch.ones(2))
    with pytest.raises(ValueError, match="response_mask"):
        compute_positive_example_nll_loss(x, torch.ones(3, 2), torch.ones(2))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        compute_positive_example_nll_loss(x, mask, torch.ones(2), loss_agg_mode="mean")
    with pytest.raises(ValueError, match="global_num_tokens"):
        compute_positive_example_nll_loss(x, mask, torch.ones(2), dp_size=2)
