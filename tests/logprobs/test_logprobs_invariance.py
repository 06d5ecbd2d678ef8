"""Batch invariance (bitwise) and property tests over random shapes, chunk sizes and masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
)
from tests.logprobs.reference import ref_entropy, ref_log_probs


def _values_and_grads(logits, labels, ref_logits):
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_from_logits(x, labels)
    lp_only = log_probs_from_logits(x, labels)
    ent_only = entropy_from_logits(x)
    kl = kl_from_logits(x, ref_logits)
    (lp.sum() + ent.sum() + kl.sum()).backward()
    x2 = logits.clone().requires_grad_()
    log_probs_from_logits(x2, labels).sum().backward()  # the log-prob-only backward path
    return [lp, ent, lp_only, ent_only, kl, x.grad, x2.grad]


@pytest.mark.parametrize("V", [1000, 40000])  # 40000 > ATen's grain: one row may split
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariance_bitwise(V, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, V, generator=g) * 3).to(dtype)
    ref_logits = (torch.randn(8, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (8,), generator=g)
    full = _values_and_grads(logits, labels, ref_logits)
    for i in range(8):
        single = _values_and_grads(logits[i : i + 1], labels[i : i + 1], ref_logits[i : i + 1])
        for a, b in zip(full, single):
            torch.testing.assert_close(a[i : i + 1], b, rtol=0, atol=0)
    # and as part of a batch of 3 starting at an odd row
    part = _values_and_grads(logits[3:6], labels[3:6], ref_logits[3:6])
    for a, b in zip(full, part):
        torch.testing.assert_close(a[3:6], b, rtol=0, atol=0)


@given(
    n=st.integers(1, 12),
    v=st.integers(1, 70),
    chunk=st.one_of(st.none(), st.integers(1, 15)),
    masked=st.floats(0.0, 0.9),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference_with_masked_vocabulary(n, v, chunk, masked, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 4
    drop = torch.rand(n, v, generator=g) < masked
    drop[:, 0] = False  # keep every row a distribution
    logits[drop] = float("-inf")
    labels = torch.randint(0, v, (n,), generator=g)
    labels[drop.gather(1, labels[:, None]).squeeze(1)] = 0
    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_from_logits(x, labels, chunk_size=chunk)
    torch.testing.assert_close(lp.double(), ref_log_probs(logits, labels), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_entropy(logits), atol=2e-6, rtol=1e-6)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all() and x.grad[drop].eq(0).all()
    # Chunking never changes a bit.
    lp1, ent1 = log_probs_and_entropy_from_logits(logits, labels, chunk_size=1)
    torch.testing.assert_close(lp, lp1, rtol=0, atol=0)
    torch.testing.assert_close(ent, ent1, rtol=0, atol=0)


@given(
    n=st.integers(1, 10),
    v=st.integers(2, 50),
    chunk=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_property_kl_nonnegative_and_chunk_invariant(n, v, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    ref_logits = logits + torch.randn(n, v, generator=g) * torch.rand(1, generator=g)
    kl = kl_from_logits(logits, ref_logits, chunk_size=chunk)
    assert (kl >= 0).all()
    torch.testing.assert_close(kl, kl_from_logits(logits, ref_logits, chunk_size=1), rtol=0, atol=0)
