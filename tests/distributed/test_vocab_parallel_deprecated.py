"""The earlier ``rlmath.distributed.vocab_parallel_*`` spelling: one warning each, the same results."""

from __future__ import annotations

import warnings

import pytest
import torch

import rlmath
from rlmath import VocabParallel
from rlmath.distributed import vocab_parallel as old


@pytest.fixture(autouse=True)
def fresh_warnings():
    old._warned.clear()
    yield
    old._warned.clear()


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, -100, 6])
    return x, labels


def _calls(x, labels):
    h = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = torch.randn(7, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    b = torch.randn(7, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 4), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 4, dtype=torch.bool)
    packed = torch.randn(8, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    vp = VocabParallel(start=0)
    return [
        (
            lambda: old.vocab_parallel_log_probs_from_logits(x, labels, vocab_start_index=0),
            lambda: rlmath.log_probs_from_logits(x, labels, vocab_parallel=vp),
        ),
        (
            lambda: old.vocab_parallel_entropy(x, temperature=0.7),
            lambda: rlmath.entropy_from_logits(x, temperature=0.7, vocab_parallel=vp),
        ),
        (
            lambda: old.vocab_parallel_log_probs_and_entropy(x, labels, vocab_size=6),
            lambda: rlmath.log_probs_and_entropy_from_logits(
                x, labels, vocab_size=6, vocab_parallel=vp
            ),
        ),
        (
            lambda: old.vocab_parallel_kl_from_logits(x, x.flip(0)),
            lambda: rlmath.kl_from_logits(x, x.flip(0), vocab_parallel=vp),
        ),
        (
            lambda: old.vocab_parallel_sum_pi_squared(x),
            lambda: rlmath.sum_pi_squared_from_logits(x, vocab_parallel=vp),
        ),
        (
            lambda: old.vocab_parallel_log_probs_from_logits_response_rmpad(ids, mask, packed, 2),
            lambda: rlmath.log_probs_from_logits_response_rmpad(
                ids, mask, packed, 2, vocab_parallel=vp
            ),
        ),
        (
            lambda: old.vocab_parallel_log_probs_and_entropy_from_hidden(
                h, w, labels, bias_shard=b, reduce_grad_hidden=False
            ),
            lambda: rlmath.log_probs_and_entropy_from_hidden(
                h, w, labels, bias=b, vocab_parallel=VocabParallel(reduce_grad_hidden=False)
            ),
        ),
    ]


def test_each_old_function_warns_once_and_equals_the_new_call():
    x, labels = _data()
    for deprecated, new in _calls(x, labels):
        with pytest.warns(
            FutureWarning, match="is deprecated.*vocab_parallel=rlmath.VocabParallel"
        ):
            got = deprecated()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second call is silent
            again = deprecated()
        want = new()
        for a, b, c in zip(
            *(t if isinstance(t, tuple) else (t,) for t in (got, again, want)), strict=True
        ):
            torch.testing.assert_close(a, c, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(b, c, rtol=0, atol=0, equal_nan=True)
