"""FusedLMHeadLogProbs: a view of an existing nn.Linear head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlmath.fused_head import FusedLMHeadLogProbs, log_probs_and_entropy_from_hidden
from tests.fused_head.reference import make, make_labels, ref_fused


def test_matches_the_function_and_trains_the_head():
    torch.manual_seed(0)
    head = nn.Linear(8, 30)
    fused = FusedLMHeadLogProbs(head, temperature=0.8, chunk_size=3)
    hidden = make((2, 5, 8), torch.float32, requires_grad=True)
    labels = make_labels((2, 5), 30, ignore=[(1, 4)])
    lp, ent = fused(hidden, labels)
    lp_f, ent_f = log_probs_and_entropy_from_hidden(
        hidden, head.weight, labels, bias=head.bias, temperature=0.8
    )
    torch.testing.assert_close(lp, lp_f)
    torch.testing.assert_close(ent, ent_f)
    ref_lp, ref_ent = ref_fused(hidden.detach(), head.weight.detach(), labels, head.bias, 0.8)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    (lp.sum() - ent.sum()).backward()
    assert head.weight.grad is not None and head.bias.grad is not None
    assert hidden.grad is not None and hidden.grad[1, 4].eq(0).all()
    lp_t, ent_t = fused(hidden, labels, temperature=torch.tensor([[1.0], [2.0]]))
    lp_1, _ = fused(hidden, labels, return_entropy=False, temperature=1.0)
    assert not torch.equal(lp_t, lp) and torch.equal(lp_t[0], lp_1[0])


def test_holds_a_reference_not_a_copy():
    head = nn.Linear(4, 9, bias=False)
    fused = FusedLMHeadLogProbs(head)
    assert fused.head is head
    # Not a submodule: no duplicated parameters or state when attached to the model.
    assert list(fused.parameters()) == [] and fused.state_dict() == {}
    model = nn.Module()
    model.lm_head = head
    model.logprobs = fused
    assert list(model.state_dict()) == ["lm_head.weight"]
    # Reads the weight at call time: an update of the head is seen.
    hidden, labels = make((3, 4), torch.float32), make_labels((3,), 9)
    before = fused(hidden, labels)[0]
    with torch.no_grad():
        head.weight.mul_(2)
    assert not torch.equal(fused(hidden, labels)[0], before)
    assert "Linear(4, 9, bias=False)" in repr(fused)


def test_tied_embedding():
    emb = nn.Embedding(12, 6)
    head = nn.Linear(6, 12, bias=False)
    head.weight = emb.weight
    fused = FusedLMHeadLogProbs(head)
    ids = torch.tensor([[1, 2, 3]])
    hidden = emb(ids)
    lp, _ = fused(hidden, torch.tensor([[2, 3, 4]]))
    lp.sum().backward()
    assert emb.weight.grad is not None


def test_bad_arguments():
    with pytest.raises(TypeError, match="head must be an nn.Linear"):
        FusedLMHeadLogProbs(nn.Embedding(3, 4))
    with pytest.raises(ValueError, match="temperature"):
        FusedLMHeadLogProbs(nn.Linear(2, 3), temperature=0.0)
    with pytest.raises(TypeError, match="temperature"):
        FusedLMHeadLogProbs(nn.Linear(2, 3), temperature="1")
