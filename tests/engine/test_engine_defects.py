"""Ignored rows, saved temperatures, host reads and module arguments: each once silently wrong."""

from __future__ import annotations

import math

import pytest
import torch

import rlmath as R
from rlmath.fused_head import FusedLMHeadLogProbs
from tests.host_sync import forbid_host_reads

IGNORE = -100


def _problem(n=7, v=13, h=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, v, generator=g, dtype=dtype) * 2
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    bias = torch.randn(v, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 4]] = IGNORE
    temp = torch.rand(n, generator=g, dtype=dtype) + 0.5
    return x, hidden, weight, bias, labels, temp


def _reference(logits, labels, temp):
    """fp64 log-probs and entropy of the live rows, 0 on ignored rows (autograd through the math)."""
    live = labels != IGNORE
    z = logits / torch.where(live, temp, 1.0).unsqueeze(-1)
    ls = torch.log_softmax(z, -1)
    lp = ls.gather(-1, torch.where(live, labels, 0)[:, None]).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    return torch.where(live, lp, 0), torch.where(live, ent, 0)


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -1.0])
def test_ignored_rows_temperature_never_reaches_the_logits_gradient(bad):
    x, _, _, _, labels, temp = _problem()
    temp[[1, 4]] = bad  # only the ignored rows
    x[1] = float("nan")  # and their logits
    leaf = x.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(
        leaf, labels, temperature=temp, ignore_index=IGNORE
    )
    (lp.sum() + 0.3 * ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    assert (leaf.grad[[1, 4]] == 0).all() and (lp[[1, 4]] == 0).all() and (ent[[1, 4]] == 0).all()
    ref_leaf = torch.where(torch.isnan(x), 0, x).requires_grad_()
    rlp, rent = _reference(ref_leaf, labels, torch.where(labels != IGNORE, temp, 1.0))
    (rlp.sum() + 0.3 * rent.sum()).backward()
    torch.testing.assert_close(lp, rlp)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad)


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_ignored_rows_temperature_never_reaches_the_fused_head_gradients(bad):
    _, hidden, weight, bias, labels, temp = _problem()
    temp[[1, 4]] = bad
    hidden[4] = float("nan")
    h = hidden.clone().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_hidden(
        h, w, labels, bias=b, temperature=temp, chunk_size=3, vocab_chunk_size=5
    )
    (lp.sum() - ent.sum()).backward()
    for grad in (h.grad, w.grad, b.grad):
        assert grad is not None and torch.isfinite(grad).all()
    assert (h.grad[[1, 4]] == 0).all()
    h2 = torch.where(torch.isnan(hidden), 0, hidden).requires_grad_()
    w2, b2 = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rlp, rent = _reference(h2 @ w2.T + b2, labels, torch.where(labels != IGNORE, temp, 1.0))
    (rlp.sum() - rent.sum()).backward()
    for got, want in ((h.grad, h2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got, want)


def _modify_between_forward_and_backward(call):
    temp = torch.full((7,), 0.8, dtype=torch.float64)
    out = call(temp)
    loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)) if o is not None)
    temp.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("fn", ["log_probs", "entropy", "kl", "fused_head"])
def test_a_temperature_modified_in_place_before_backward_raises(fn):
    x, hidden, weight, _, labels, _ = _problem()
    labels = labels.clamp_min(0)
    calls = {
        "log_probs": lambda t: R.log_probs_from_logits(x.requires_grad_(), labels, temperature=t),
        "entropy": lambda t: R.entropy_from_logits(x.requires_grad_(), temperature=t),
        "kl": lambda t: R.kl_from_logits(x.requires_grad_(), x.detach() + 1, temperature=t),
        "fused_head": lambda t: R.log_probs_and_entropy_from_hidden(
            hidden.requires_grad_(), weight, labels, temperature=t
        ),
    }
    _modify_between_forward_and_backward(calls[fn])


def test_torch_raises_the_same_way_for_its_own_division():
    # The behaviour the engine matches: x / T saves T for backward.
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    _modify_between_forward_and_backward(lambda t: x / t[:, None])


def test_packed_response_functions_read_nothing_on_the_host():
    g = torch.Generator().manual_seed(2)
    B, S, V, R_len = 3, 8, 17, 4
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding
    mask[2, 3] = 0  # a hole
    nnz = int(mask.sum())
    packed = torch.randn(nnz, V, generator=g, dtype=torch.float64, requires_grad=True)
    idx = mask.view(-1).nonzero().squeeze(1)
    ids_p = ids.view(-1)[idx]
    temp = torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5
    with forbid_host_reads():
        a = R.log_probs_from_logits_response_rmpad(ids, mask, packed, R_len, temperature=temp)
        b = R.log_probs_from_logits_all_rmpad(ids_p, packed, idx, B, S, R_len, temperature=temp)
    dense = torch.zeros(B, S, V, dtype=torch.float64)
    dense[mask.bool()] = packed.detach()
    want = R.log_probs_from_logits_response(ids, dense, R_len, temperature=temp)
    # Positions with a valid token right before them agree with the dense path.
    ok = mask[:, -R_len:].bool() & mask[:, -R_len - 1 : -1].bool()
    torch.testing.assert_close(a[ok], want[ok])
    assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0.0, -1.0])
def test_fused_module_rejects_a_bad_temperature_at_construction(bad):
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        FusedLMHeadLogProbs(torch.nn.Linear(3, 5), temperature=bad)


def test_fused_module_rejects_bad_arguments_at_construction():
    head = torch.nn.Linear(3, 5)
    with pytest.raises(TypeError, match="temperature"):
        FusedLMHeadLogProbs(head, temperature="warm")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ignore_index"):
        FusedLMHeadLogProbs(head, ignore_index=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLMHeadLogProbs(head, chunk_size=0)
    with pytest.raises(ValueError, match="unknown backend"):
        FusedLMHeadLogProbs(head, backend="fast")
