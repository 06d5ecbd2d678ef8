"""The response functions under a sampler's kept set: the same rows as the plain face."""

from __future__ import annotations

import pytest
import torch

from rlmath import (
    log_probs_from_logits,
    log_probs_from_logits_all_rmpad,
    log_probs_from_logits_response,
    log_probs_from_logits_response_rmpad,
)
from rlmath.padding import unpad_input
from tests.logprobs.test_logprobs_response import padded_batch

P, R = 5, 4


def _params(B: int, S: int):
    g = torch.Generator().manual_seed(11)
    return dict(
        top_k=torch.randint(1, 9, (B, S), generator=g),
        top_p=torch.rand(B, 1, generator=g, dtype=torch.float64) * 0.8 + 0.1,
        min_p=0.05,
        temperature=torch.rand(B, S, generator=g, dtype=torch.float64) + 0.5,
    )


@pytest.mark.parametrize("sampler", ["vllm", "sglang", "hf"])
def test_dense_response_is_the_plain_face_on_the_predicting_rows(sampler):
    ids, mask, logits = padded_batch([5, 2, 3], [4, 1, 3], P, R, seed=3, dtype=torch.float64)
    B, S = ids.shape
    kw = _params(B, S)
    leaf = logits.clone().requires_grad_()
    got = log_probs_from_logits_response(
        ids, leaf, R, sampler=sampler, kept_stats=True, chunk_size=2, **kw
    )
    rows = slice(S - R - 1, S - 1)
    ref_leaf = logits.clone().requires_grad_()
    want = log_probs_from_logits(
        ref_leaf[:, rows], ids[:, -R:], sampler=sampler, kept_stats=True,
        top_k=kw["top_k"][:, rows], top_p=kw["top_p"], min_p=kw["min_p"],
        temperature=kw["temperature"][:, rows],
    )  # fmt: skip
    assert got.entropy is None
    assert torch.equal(got.log_probs, want.log_probs)
    assert torch.equal(got.outside, want.outside)
    assert torch.equal(got.kept_count, want.kept_count)
    got.log_probs.sum().backward()
    want.log_probs.sum().backward()
    assert torch.equal(leaf.grad, ref_leaf.grad)


@pytest.mark.parametrize("sampler", ["vllm", "sglang", "hf"])
def test_packed_response_equals_dense_at_valid_tokens(sampler):
    ids, mask, logits = padded_batch([5, 2, 3], [4, 1, 3], P, R, seed=4, dtype=torch.float64)
    B, S = ids.shape
    kw = _params(B, S)
    dense = log_probs_from_logits_response(ids, logits, R, sampler=sampler, kept_stats=True, **kw)
    packed = log_probs_from_logits_response_rmpad(
        ids, mask, logits[mask], R, sampler=sampler, kept_stats=True, **kw
    )
    valid = mask[:, -R:] & mask[:, -R - 1 : -1]
    for a, b in zip(packed[:1] + packed[2:], dense[:1] + dense[2:], strict=True):
        assert torch.equal(a[valid], b[valid])
    ids_rmpad, indices, *_ = unpad_input(ids.unsqueeze(-1), mask)
    logits_rmpad, *_ = unpad_input(logits, mask)
    flat = log_probs_from_logits_all_rmpad(
        ids_rmpad.squeeze(-1), logits_rmpad, indices, B, S, R, sampler=sampler,
        kept_stats=True, **kw,
    )  # fmt: skip
    for a, b in zip(flat[:1] + flat[2:], packed[:1] + packed[2:], strict=True):
        assert torch.equal(a, b)


def test_response_replay_equals_recompute():
    ids, mask, logits = padded_batch([5, 2, 3], [4, 1, 3], P, R, seed=5, dtype=torch.float64)
    B, S, V = logits.shape
    kw = dict(top_p=0.7, top_k=6)
    every = torch.arange(V).expand(B, R, V)
    # The kept set of each response token: every token as a label, outside negated.
    rows = slice(S - R - 1, S - 1)
    kept = ~log_probs_from_logits(logits[:, rows], every, kept_stats=True, **kw).outside
    want = log_probs_from_logits_response(ids, logits, R, **kw)
    assert torch.equal(log_probs_from_logits_response(ids, logits, R, kept=kept), want)
    packed = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R, kept=kept)
    valid = mask[:, -R:] & mask[:, -R - 1 : -1]
    assert torch.equal(packed[valid], want[valid])
    with pytest.raises(ValueError, match="kept"):
        log_probs_from_logits_response(ids, logits, R, kept=kept[:, :-1])
    with pytest.raises(ValueError, match="top_k"):
        log_probs_from_logits_response(ids, logits, R, top_k=torch.ones(B, R, dtype=torch.long))


def test_response_functions_ask_for_ids_when_a_shard_cannot_place_a_mask():
    import rlmath

    ids, mask, logits = padded_batch([5, 2], [4, 1], P, R, seed=6)
    for fn, args in (
        (log_probs_from_logits_response, (ids, logits, R)),
        (log_probs_from_logits_response_rmpad, (ids, mask, logits[mask], R)),
    ):
        with pytest.raises(ValueError, match="token ids"):
            kept = torch.ones(ids.shape[0], R, logits.shape[-1], dtype=torch.bool)
            fn(*args, kept=kept, vocab_parallel=rlmath.VocabParallel(start=0))
