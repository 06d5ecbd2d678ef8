"""Response log-probs: dense next-token alignment, packed (rmpad) within-sequence shift."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

from rlmath import (
    log_probs_from_logits_all_rmpad,
    log_probs_from_logits_response,
    log_probs_from_logits_response_rmpad,
)
from tests.logprobs.reference import log_softmax64, ref_response_dense

V = 37


def padded_batch(prompt_lens, resp_lens, P, R, *, layout="left", seed=0, dtype=torch.float32):
    """ids/mask/dense logits of a verl-style batch: prompts of P columns, responses of R columns.

    layout "left": prompts left-padded, responses right-padded (verl's rollout layout).
    layout "right": prompts right-padded too, so each row has a hole between prompt and response.
    layout "holes": arbitrary interior padding inside the response as well.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    S = P + R
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (lp, lr) in enumerate(zip(prompt_lens, resp_lens)):
        if layout == "left":
            mask[b, P - lp : P] = True
        else:
            mask[b, :lp] = True
        mask[b, P : P + lr] = True
    if layout == "holes":
        mask &= torch.rand(B, S, generator=g) > 0.3
    ids = torch.randint(0, V, (B, S), generator=g)
    ids[~mask] = 0  # pad id
    logits = (torch.randn(B, S, V, generator=g, dtype=torch.float64) * 2).to(dtype)
    return ids, mask, logits


def ref_packed(ids, mask, logits, R):
    """Plain loop: each valid response token scored by the previous valid token of its row."""
    B, S = ids.shape
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        for j in range(R):
            s = S - R + j
            if not mask[b, s]:
                continue
            prev = [c for c in range(s) if mask[b, c]]
            if prev:
                out[b, j] = log_softmax64(logits[b, prev[-1]])[ids[b, s]]
    return out


def test_dense_response_matches_loop():
    ids, _, logits = padded_batch([3, 1, 4], [2, 4, 1], P=4, R=4)
    for R in (1, 3, 4, 7):
        out = log_probs_from_logits_response(ids, logits, R, chunk_size=2)
        assert out.shape == (3, R) and out.dtype == torch.float32
        torch.testing.assert_close(
            out.double(), ref_response_dense(ids, logits, R), atol=2e-6, rtol=1e-7
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmpad_equals_dense_for_left_padded_prompts(dtype):
    prompt_lens, resp_lens = [5, 1, 3, 2, 6], [4, 1, 6, 0, 1]
    P, R = 6, 6
    ids, mask, logits = padded_batch(prompt_lens, resp_lens, P, R, dtype=dtype)
    dense = log_probs_from_logits_response(ids, logits, R, chunk_size=3)
    packed = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R, chunk_size=3)
    valid = mask[:, -R:] & mask[:, -R - 1 : -1]
    # Token for token, bitwise: each row is reduced the same way in both layouts.
    torch.testing.assert_close(packed[valid], dense[valid], rtol=0, atol=0)
    assert packed[~mask[:, -R:]].eq(0).all()
    torch.testing.assert_close(
        packed.double(), ref_packed(ids, mask, logits, R), atol=2e-6, rtol=1e-7
    )


@pytest.mark.parametrize("layout", ["right", "holes"])
def test_rmpad_follows_the_packed_sequence_with_interior_padding(layout):
    ids, mask, logits = padded_batch([2, 4, 1, 3], [3, 1, 5, 5], P=4, R=5, layout=layout, seed=3)
    R = 5
    packed = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R, chunk_size=2)
    torch.testing.assert_close(
        packed.double(), ref_packed(ids, mask, logits, R), atol=2e-6, rtol=1e-7
    )


def test_no_leak_across_sequence_boundaries():
    # Right-aligned responses that fill the last column: the last logit row of a sequence
    # predicts nothing inside the response slice; the first response token of the next
    # sequence is scored by that sequence's own last prompt token.
    P, R = 3, 2
    ids, mask, logits = padded_batch([3, 3], [2, 2], P, R, seed=5)
    out = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R)
    torch.testing.assert_close(out.double(), ref_packed(ids, mask, logits, R), atol=2e-6, rtol=1e-7)
    # A sequence whose first valid token is a response token has nothing to predict it.
    ids, mask, logits = padded_batch([0, 2], [3, 3], P=2, R=3, seed=6)
    out = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], 3)
    assert out[0, 0] == 0 and out[0, 1] != 0


def test_length_one_responses():
    ids, mask, logits = padded_batch([2, 3, 1], [1, 1, 1], P=3, R=1, seed=2)
    dense = log_probs_from_logits_response(ids, logits, 1)
    packed = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], 1)
    torch.testing.assert_close(packed, dense, rtol=0, atol=0)


@given(
    lens=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=5),
    left=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rmpad_matches_loop_property(lens, left, seed):
    P, R = 5, 4
    ids, mask, logits = padded_batch(
        [a for a, _ in lens],
        [b for _, b in lens],
        P,
        R,
        layout="left" if left else "right",
        seed=seed,
    )
    packed = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R, chunk_size=3)
    torch.testing.assert_close(
        packed.double(), ref_packed(ids, mask, logits, R), atol=2e-6, rtol=1e-7
    )
    if left:
        dense = log_probs_from_logits_response(ids, logits, R)
        valid = mask[:, -R:] & mask[:, -R - 1 : -1]
        torch.testing.assert_close(packed[valid], dense[valid], rtol=0, atol=0)


def test_rmpad_gradients_equal_dense_gradients():
    P, R = 4, 3
    ids, mask, logits = padded_batch([4, 2, 3], [3, 2, 1], P, R, seed=9)
    valid = mask[:, -R:] & mask[:, -R - 1 : -1]
    weights = torch.randn(3, R, generator=torch.Generator().manual_seed(1))
    dense_x = logits.clone().requires_grad_()
    dense = log_probs_from_logits_response(ids, dense_x, R)
    (torch.where(valid, dense, 0) * weights).sum().backward()
    packed_x = logits[mask].clone().requires_grad_()
    packed = log_probs_from_logits_response_rmpad(ids, mask, packed_x, R)
    (packed * weights).sum().backward()
    torch.testing.assert_close(packed_x.grad, dense_x.grad[mask], rtol=0, atol=0)
    # Rows that predict no response token get exactly zero gradient.
    assert dense_x.grad[~mask].eq(0).all()


def test_gradcheck_response_functions():
    P, R = 3, 3
    ids, mask, logits = padded_batch([3, 1], [2, 3], P, R, dtype=torch.float64, seed=4)
    x = logits.clone().requires_grad_()
    assert gradcheck(lambda x: log_probs_from_logits_response(ids, x, R, chunk_size=2), (x,))
    xp = logits[mask].clone().requires_grad_()
    temp = torch.tensor([[0.7], [1.3]], dtype=torch.float64)
    assert gradcheck(
        lambda x: log_probs_from_logits_response_rmpad(
            ids, mask, x, R, temperature=temp, chunk_size=2
        ),
        (xp,),
    )


def test_all_rmpad_with_unpad_input_indices():
    from rlmath.padding import unpad_input

    P, R = 5, 4
    ids, mask, logits = padded_batch([5, 2, 3], [4, 1, 3], P, R, seed=8)
    ids_rmpad, indices, *_ = unpad_input(ids.unsqueeze(-1), mask)
    logits_rmpad, *_ = unpad_input(logits, mask)
    expected = log_probs_from_logits_response_rmpad(ids, mask, logits_rmpad, R)
    out = log_probs_from_logits_all_rmpad(
        ids_rmpad.transpose(0, 1), logits_rmpad, indices, 3, P + R, R
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # A (nnz,) id vector and a (1, nnz, V) logits tensor are accepted too.
    out = log_probs_from_logits_all_rmpad(
        ids_rmpad.squeeze(-1), logits_rmpad.unsqueeze(0), indices, 3, P + R, R
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_temperature_in_response_functions():
    P, R = 3, 3
    ids, mask, logits = padded_batch([3, 2], [3, 2], P, R, seed=10)
    temp = torch.tensor([[0.5], [2.0]])
    dense = log_probs_from_logits_response(ids, logits, R, temperature=temp)
    scaled = log_probs_from_logits_response(ids, logits / temp.unsqueeze(-1), R)
    torch.testing.assert_close(dense, scaled, rtol=0, atol=0)
    packed = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R, temperature=temp)
    valid = mask[:, -R:] & mask[:, -R - 1 : -1]
    torch.testing.assert_close(packed[valid], dense[valid], rtol=0, atol=0)
    packed_f = log_probs_from_logits_response_rmpad(ids, mask, logits[mask], R, temperature=0.5)
    dense_f = log_probs_from_logits_response(ids, logits, R, temperature=0.5)
    torch.testing.assert_close(packed_f[valid], dense_f[valid], rtol=0, atol=0)


def test_response_bad_input():
    ids, mask, logits = padded_batch([2, 2], [2, 2], 2, 2)
    for bad in (0, 4, -1):
        with pytest.raises(ValueError, match="response_length"):
            log_probs_from_logits_response(ids, logits, bad)
    with pytest.raises(TypeError, match="response_length"):
        log_probs_from_logits_response(ids, logits, 2.0)
    with pytest.raises(ValueError, match="response_length"):
        log_probs_from_logits_response_rmpad(ids, mask, logits[mask], 5)
    with pytest.raises(ValueError, match="logits"):
        log_probs_from_logits_response(ids, logits[:, :-1], 2)
    with pytest.raises(TypeError, match="input_ids"):
        log_probs_from_logits_response(ids.float(), logits, 2)
    for rows in (logits[mask][:-1], torch.cat([logits[mask], logits[mask][:1]])):
        with pytest.raises(ValueError, match="logits_rmpad"):
            log_probs_from_logits_response_rmpad(ids, mask, rows, 2, validate=True)
        # Without validate (no host read) a mismatch poisons every result.
        assert log_probs_from_logits_response_rmpad(ids, mask, rows, 2).isnan().all()
    with pytest.raises(ValueError, match="attention_mask"):
        log_probs_from_logits_response_rmpad(ids, mask[:, :-1], logits[mask], 2)
    with pytest.raises(ValueError, match="indices"):
        log_probs_from_logits_all_rmpad(ids[mask], logits[mask], torch.arange(3), 2, 4, 2)
    with pytest.raises(ValueError, match="batch_size"):
        log_probs_from_logits_all_rmpad(
            ids[mask], logits[mask], mask.view(-1).nonzero().squeeze(1), 0, 4, 2
        )


def test_rmpad_temperature_errors_name_input_ids():
    ids, mask, logits = padded_batch([2, 2], [2, 2], 2, 2)
    with pytest.raises(ValueError, match=r"input_ids\.shape = \(2, 4\)"):
        log_probs_from_logits_response_rmpad(ids, mask, logits[mask], 2, temperature=torch.ones(3))
