"""A label that is neither a token id nor ``ignore_index`` gives NaN on every path, never a finite value.

Paths: logits (dense, K labels, the response functions), the fused head (the
function and the module), the vocabulary-parallel functions (a world of one and
two gloo ranks, labels past ``vocab_size`` included), every backend that
accepts the input. Where the loss uses such a log-prob (a nonzero upstream
gradient) its row's gradient is NaN; a use masked out with an exactly zero
upstream gradient contributes nothing. ``validate=True`` raises a
``ValueError`` naming ``labels`` instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlmath import (
    VocabParallel,
    log_probs_and_entropy_from_hidden,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    log_probs_from_logits_response,
)
from rlmath import log_probs_and_entropy_from_hidden as head
from rlmath.distributed import run_distributed
from rlmath.engine import available_backends
from rlmath.fused_head import FusedLMHeadLogProbs

V = 11
#: Labels at V = 11 that are not token ids; -100 is one only without ignore_index.
OUTSIDE = [11, 100, 500, -1, -5]


def _logits(rows: int = 5, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(0), dtype=dtype)


def _labels(bad: int) -> torch.Tensor:
    # Row 1 holds the bad label; the others are token ids or ignored (-100).
    return torch.tensor([3, bad, 0, -100, 10])


def _check(lp: torch.Tensor, grad_used: torch.Tensor, grad_masked: torch.Tensor) -> None:
    assert torch.isnan(lp[1]).all()
    assert torch.isfinite(lp[[0, 2, 4]]).all() and (lp[3] == 0).all()
    assert torch.isnan(grad_used[1]).all()
    assert torch.isfinite(grad_used[[0, 2, 3, 4]]).all()
    assert torch.isfinite(grad_masked).all()


def _backends() -> list[str]:
    return available_backends(_logits())


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("bad", OUTSIDE)
@pytest.mark.parametrize("entropy", [False, True])
def test_logits_path(bad, entropy, backend):
    x = _logits().requires_grad_()
    labels = _labels(bad)

    def call():
        if entropy:
            lp, _ = log_probs_and_entropy_from_logits(x, labels, ignore_index=-100, backend=backend)
            return lp
        return log_probs_from_logits(x, labels, ignore_index=-100, backend=backend)

    lp = call()
    (grad_used,) = torch.autograd.grad(lp.sum(), x)
    masked = torch.where(torch.isnan(lp), 0, call())
    (grad_masked,) = torch.autograd.grad(masked.sum(), x)
    _check(lp, grad_used, grad_masked)
    # The rows with token ids equal a call without the bad row.
    good = [0, 2, 4]
    ref = log_probs_from_logits(x.detach()[good], labels[good], backend=backend)
    torch.testing.assert_close(lp.detach()[good], ref, rtol=0, atol=0)


def test_minus_100_without_ignore_index_is_nan():
    x = _logits()
    lp = log_probs_from_logits(x, torch.tensor([3, -100, 0, 1, 2]), ignore_index=None)
    assert torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2, 3, 4]]).all()


def test_k_labels_and_the_response_function():
    x = _logits()
    lp = log_probs_from_logits(x, torch.tensor([[3, 11], [0, 1], [-2, 4], [5, 6], [7, 8]]))
    assert torch.isnan(lp[0, 1]) and torch.isnan(lp[2, 0])
    assert (
        torch.isfinite(lp[0, 0]) and torch.isfinite(lp[1:2]).all() and torch.isfinite(lp[3:]).all()
    )
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 11, 7]])
    logits = torch.randn(2, 4, V, generator=torch.Generator().manual_seed(1))
    resp = log_probs_from_logits_response(ids, logits, 2)
    assert torch.isnan(resp[1, 0]) and torch.isfinite(resp[0]).all() and torch.isfinite(resp[1, 1])


@pytest.mark.parametrize("vocab_size", [None, 9])
@pytest.mark.parametrize("bad", [*OUTSIDE, -100])
def test_fused_head(bad, vocab_size):
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(5, 4, generator=gen, requires_grad=True)
    w = torch.randn(V, 4, generator=gen, requires_grad=True)
    labels = torch.tensor([3, bad, 0, 1, 2])
    # -100 is ignored by default; without ignore_index it is not a token id.
    ignore = None if bad == -100 else -100
    lp, ent = log_probs_and_entropy_from_hidden(
        h, w, labels, ignore_index=ignore, vocab_size=vocab_size
    )
    assert torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2, 3, 4]]).all()
    assert torch.isfinite(ent).all()
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    assert torch.isnan(gh[1]).all() and torch.isfinite(gh[[0, 2, 3, 4]]).all()
    assert torch.isnan(gw).any()
    lp2, _ = log_probs_and_entropy_from_hidden(
        h, w, labels, ignore_index=ignore, vocab_size=vocab_size
    )
    gh, gw = torch.autograd.grad(torch.where(torch.isnan(lp2), 0, lp2).sum(), (h, w))
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_labels_past_vocab_size_are_not_token_ids():
    # Rows of a padded head past vocab_size are out of the softmax: label 9 or 10 is NaN.
    gen = torch.Generator().manual_seed(3)
    h, w = torch.randn(3, 4, generator=gen), torch.randn(V, 4, generator=gen)
    lp, _ = log_probs_and_entropy_from_hidden(h, w, torch.tensor([8, 9, 10]), vocab_size=9)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1:]).all()


def test_validate_raises_naming_labels_on_every_path():
    x = _logits()
    labels = _labels(11)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 11\).*found 11"):
        log_probs_from_logits(x, labels, ignore_index=-100, validate=True)
    with pytest.raises(ValueError, match="labels must lie in"):
        log_probs_and_entropy_from_logits(
            x, torch.tensor([3, -100, 0, 1, 2]), ignore_index=None, validate=True
        )
    gen = torch.Generator().manual_seed(4)
    h, w = torch.randn(5, 4, generator=gen), torch.randn(V, 4, generator=gen)
    with pytest.raises(ValueError, match="labels must lie in"):
        log_probs_and_entropy_from_hidden(h, w, labels, validate=True)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 9\)"):
        log_probs_and_entropy_from_hidden(h, w, torch.tensor([8, 9, 0, 1, 2]), vocab_size=9,
                                          validate=True)  # fmt: skip
    head = torch.nn.Linear(4, V, bias=False)
    module = FusedLMHeadLogProbs(head, validate=True)
    with pytest.raises(ValueError, match="labels must lie in"):
        module(h, labels)
    lp, _ = FusedLMHeadLogProbs(head)(h, labels)
    assert torch.isnan(lp[1])
    with pytest.raises(TypeError, match="validate must be a bool"):
        FusedLMHeadLogProbs(head, validate=1)


def test_vocab_parallel_world_of_one():
    x = _logits().requires_grad_()
    lp = log_probs_from_logits(x, _labels(11), vocab_parallel=VocabParallel())
    (g,) = torch.autograd.grad(lp.sum(), x)
    assert torch.isnan(lp[1]) and torch.isnan(g[1]).all() and lp[3] == 0
    assert torch.isfinite(lp[[0, 2, 4]]).all() and torch.isfinite(g[[0, 2, 3, 4]]).all()


def _tp_worker(_: None) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
    width = 12 // world
    shard = full[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    # vocab_size 10: columns 10 and 11 are padding, so labels 10 and 11 are not tokens.
    labels = torch.tensor([3, 10, -100, 11])
    tp = VocabParallel(group=dist.group.WORLD)
    lp = log_probs_from_logits(shard, labels, vocab_size=10, vocab_parallel=tp)
    (g,) = torch.autograd.grad(lp.sum(), shard)
    lp_k = log_probs_from_logits(
        shard.detach(), torch.tensor([[3, 12], [-7, 2], [0, 1], [4, 5]]), vocab_size=10,
        vocab_parallel=tp,
    )  # fmt: skip
    h = torch.randn(4, 3, generator=torch.Generator().manual_seed(6))
    weight = torch.randn(12, 3, generator=torch.Generator().manual_seed(7))
    lp_h, _ = head(
        h, weight[rank * width : (rank + 1) * width], torch.tensor([3, 10, -100, 40]),
        vocab_size=10, vocab_parallel=tp,
    )  # fmt: skip
    # Padding columns (global id >= vocab_size) always get a zero gradient.
    real = max(0, min(width, 10 - rank * width))
    return {"lp": lp.detach(), "grad": g[:, :real], "lp_k": lp_k, "lp_h": lp_h.detach()}


@pytest.mark.integration
@pytest.mark.parametrize("world", [2])
def test_vocab_parallel_ranks(world):
    for out in run_distributed(_tp_worker, world, None):
        lp, g = out["lp"], out["grad"]
        assert torch.isfinite(lp[0]) and lp[2] == 0 and torch.isnan(lp[[1, 3]]).all()
        assert torch.isnan(g[[1, 3]]).all() and torch.isfinite(g[[0, 2]]).all()
        assert torch.isnan(out["lp_k"][0, 1]) and torch.isnan(out["lp_k"][1, 0])
        assert torch.isfinite(out["lp_k"][0, 0]) and torch.isfinite(out["lp_k"][2:]).all()
        lp_h = out["lp_h"]
        assert torch.isfinite(lp_h[0]) and lp_h[2] == 0 and torch.isnan(lp_h[[1, 3]]).all()
