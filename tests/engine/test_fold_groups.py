"""Runs of chunks whose rows add their tiles up together: cut as documented, and invisible."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlmath as R
from rlmath.engine import policy
from rlmath.engine.policy import FOLD_BYTES, MIN_FOLD_GROUPS, fold_groups


@given(
    rows=st.integers(1, 3000),
    chunk=st.integers(1, 300),
    tiles=st.integers(1, 2000),
    sums=st.sampled_from([1, 2]),
)
def test_runs_cover_the_chunks_in_order_within_the_bounds(rows, chunk, tiles, sums):
    ranges = [(a, min(a + chunk, rows)) for a in range(0, rows, chunk)]
    groups = fold_groups(ranges, tiles, sums)
    assert [r for g in groups for r in g] == ranges
    cap = min(max(1, FOLD_BYTES // (4 * tiles * sums)), max(1, rows // MIN_FOLD_GROUPS))
    for g in groups:
        held = g[-1][1] - g[0][0]
        assert held <= cap or len(g) == 1  # a chunk larger than the cap is a run of its own
    # Fewer runs would have been possible only by breaking the cap.
    for g, nxt in itertools.pairwise(groups):
        assert nxt[0][1] - g[0][0] > cap
    assert fold_groups([], tiles, sums) == []


@pytest.mark.parametrize("fold_bytes", [1, 4 * 250 * 2 * 40, 1 << 30])
def test_results_do_not_depend_on_the_runs(monkeypatch, fold_bytes):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 32000, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, 32000, (300,), generator=g)

    def run():
        lp, h = R.log_probs_and_entropy_from_logits(x, labels, chunk_size=7)
        (grad,) = torch.autograd.grad(lp.sum() + h.sum(), x)
        return lp, h, grad, R.sum_pi_squared_from_logits(x.detach(), chunk_size=7)

    want = run()
    seen = []
    real = policy.fold_groups
    monkeypatch.setattr(policy, "FOLD_BYTES", fold_bytes)

    def spy(*a):
        seen.append(real(*a))
        return seen[-1]

    import rlmath.engine.torch_backend.logits_forward as lf
    import rlmath.engine.torch_backend.sum_pi_squared as sp

    monkeypatch.setattr(lf, "fold_groups", spy)
    monkeypatch.setattr(sp, "fold_groups", spy)
    got = run()
    assert seen and all(len(gr) > 1 for gr in seen)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
