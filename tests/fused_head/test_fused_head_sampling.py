"""The fused head under a sampler's kept set equals the logits path on the head's logits.

The logits path (``log_probs_and_entropy_from_logits`` with ``top_k`` /
``top_p`` / ``min_p``) is itself checked against per-row fp64 references of
each engine's rule (``tests/logprobs/test_sampling.py``); here the head's
logits ``softcap·tanh(scale·(h W^T + b) / softcap)`` are formed explicitly and
the two paths compared: in fp64 to 1e-12 (the same kept sets, the same
formulas), gradients included, and gradcheck on the fused path.
"""

from __future__ import annotations

import pytest
import torch

import rlmath
from rlmath.engine import head_truncation
from rlmath.fused_head import FusedLMHeadLogProbs, log_probs_and_entropy_from_hidden

SAMPLERS = ["vllm", "sglang", "hf"]
B, T, H, V = 3, 7, 16, 90


def _problem(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 2] = -100
    return h.to(dtype), w.to(dtype), b.to(dtype), labels


def _logits(h, w, b, scale=1.0, cap=None, real=V):
    z = (h @ w[:real].T + b[:real]).to(torch.promote_types(h.dtype, torch.float32)) * scale
    return cap * torch.tanh(z / cap) if cap else z


PER_ROW = {
    "top_k": torch.tensor([[3], [20], [1]]),
    "top_p": torch.tensor([[0.5], [0.9], [1.0]], dtype=torch.float64),
    "min_p": torch.tensor([[0.0], [0.05], [0.2]], dtype=torch.float64),
}
CASES = {
    "top_p": dict(top_p=0.8),
    "top_k": dict(top_k=5),
    "min_p": dict(min_p=0.1),
    "all": dict(top_k=12, top_p=0.7, min_p=0.02),
    "per_row": dict(PER_ROW),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_equals_the_logits_path_in_fp64(case, sampler):
    h, w, b, labels = _problem()
    kw = dict(CASES[case], sampler=sampler)
    temp = torch.tensor([[0.7], [1.0], [1.3]], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    got = log_probs_and_entropy_from_hidden(
        leaves[0], leaves[1], labels, bias=leaves[2], temperature=temp, logit_scale=1.3,
        softcap=4.0, kept_stats=True, **kw,
    )  # fmt: skip
    ref_leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    want = rlmath.log_probs_and_entropy_from_logits(
        _logits(*ref_leaves, scale=1.3, cap=4.0), labels, temperature=temp, kept_stats=True,
        **kw,
    )  # fmt: skip
    assert torch.equal(got.kept_count, want.kept_count)
    assert torch.equal(got.outside, want.outside)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=0, atol=1e-12)
    c = torch.linspace(-1, 1, B * T, dtype=torch.float64).view(B, T)
    (got.log_probs * c + got.entropy * c.flip(0)).sum().backward()
    (want.log_probs * c + want.entropy * c.flip(0)).sum().backward()
    for a, r in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=1e-11)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_gradcheck(sampler):
    # A small head (V = 24) so that every weight is perturbed in reasonable time.
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 3, 8, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(24, 8, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(24, generator=g, dtype=torch.float64).requires_grad_()
    lab = torch.randint(0, 24, (2, 3), generator=g)

    def f(h, w, b):
        return log_probs_and_entropy_from_hidden(
            h, w, lab, bias=b, top_k=9, top_p=0.8, min_p=0.01, sampler=sampler,
            temperature=0.9, softcap=3.0,
        )  # fmt: skip

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_blocks_of_rows_change_nothing(monkeypatch):
    h, w, b, labels = _problem()
    kw = dict(top_k=10, top_p=0.85, temperature=0.8)
    whole = log_probs_and_entropy_from_hidden(h, w, labels, bias=b, kept_stats=True, **kw)
    monkeypatch.setattr(head_truncation, "BLOCK_ENTRIES", 2 * V)  # two rows per block
    leaf = h.clone().requires_grad_()
    blocks = log_probs_and_entropy_from_hidden(leaf, w, labels, bias=b, kept_stats=True, **kw)
    for x, y in zip(whole, blocks, strict=True):
        torch.testing.assert_close(
            x, y.detach() if y.dtype.is_floating_point else y, rtol=0, atol=1e-12
        )
    blocks.log_probs.sum().backward()
    ref = h.clone().requires_grad_()
    log_probs_and_entropy_from_hidden(ref, w, labels, bias=b, **kw)[0].sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_half_and_single_precision_against_fp64_of_the_same_logits(dtype):
    # The logits are rounded to the inputs' dtype (as h @ W.T is); from there the
    # reduction is in fp32: within 2^4 u32 (|value| + log V) of fp64 on those logits.
    h, w, b, labels = _problem(dtype)
    kw = dict(top_k=20, top_p=0.9)
    lp, ent = log_probs_and_entropy_from_hidden(h, w, labels, bias=b, **kw)
    assert lp.dtype == ent.dtype == torch.float32
    z = torch.nn.functional.linear(h, w, b).double()  # the head's logits, rounded as it rounds them
    want_lp, want_ent = rlmath.log_probs_and_entropy_from_logits(z, labels, **kw)
    bound = 2**4 * 2.0**-24 * (want_lp.abs() + torch.log(torch.tensor(float(V))))
    assert torch.all((lp.double() - want_lp).abs() <= bound)
    assert torch.all(
        (ent.double() - want_ent).abs() <= 2**4 * 2.0**-24 * 2 * torch.log(torch.tensor(float(V)))
    )


def test_padded_vocabulary_and_k_labels():
    h, w, b, labels = _problem()
    first = labels.clamp_min(0) % 80  # token ids of the 80-token vocabulary
    k_labels = torch.stack([first, (first + 1) % 80], -1)
    got = log_probs_and_entropy_from_hidden(h, w, k_labels, bias=b, vocab_size=80, top_p=0.9)
    want = rlmath.log_probs_and_entropy_from_logits(_logits(h, w, b, real=80), k_labels, top_p=0.9)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)


def test_the_module_and_no_grad():
    h, w, b, labels = _problem()
    head = torch.nn.Linear(H, V, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    module = FusedLMHeadLogProbs(head)
    with torch.no_grad():
        lp, ent = module(h, labels, top_p=0.8, min_p=0.05, sampler="sglang")
    want = log_probs_and_entropy_from_hidden(
        h, w, labels, bias=b, top_p=0.8, min_p=0.05, sampler="sglang"
    )
    assert torch.equal(lp, want[0]) and torch.equal(ent, want[1])


def test_bad_input_and_unsupported_paths():
    h, w, b, labels = _problem(torch.float32)
    with pytest.raises(ValueError, match="top_p"):
        log_probs_and_entropy_from_hidden(h, w, labels, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        log_probs_and_entropy_from_hidden(h, w, labels, top_k=0)
    # Over shards: tests/distributed/test_vocab_parallel_sampling.py; a world of one is
    # the plain call.
    one = log_probs_and_entropy_from_hidden(h, w, labels, top_p=0.5)
    vp = log_probs_and_entropy_from_hidden(
        h, w, labels, top_p=0.5, vocab_parallel=rlmath.VocabParallel()
    )
    assert torch.equal(one[0], vp[0]) and torch.equal(one[1], vp[1])


def test_no_tensor_larger_than_a_block_of_logits(monkeypatch):
    from tests.memory_tracker import MemoryTracker

    n, hid, vocab = 64, 16, 2048
    g = torch.Generator().manual_seed(4)
    h = torch.randn(n, hid, generator=g).requires_grad_()
    w = torch.randn(vocab, hid, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    monkeypatch.setattr(head_truncation, "BLOCK_ENTRIES", 8 * vocab)  # 8 rows per block
    with MemoryTracker() as mem:
        lp, ent = log_probs_and_entropy_from_hidden(h, w, labels, top_p=0.9, top_k=100)
        (lp.sum() + ent.sum()).backward()
    block = 8 * vocab * 8  # one block of logits, in fp64 at most
    big = [a for a in mem.allocations if a.nbytes > max(block, vocab * hid * 4)]
    assert not big, big[:3]
    with MemoryTracker() as plain:
        rlmath.log_probs_from_logits(h @ w.T, labels, top_p=0.9, top_k=100).sum().backward()
    assert any(a.nbytes >= n * vocab * 4 for a in plain.allocations)  # it sees logits


@pytest.mark.parametrize("use", ["log_probs", "entropy", "no_entropy_returned"])
def test_gradients_of_one_output_and_of_some_inputs(use):
    h, w, b, labels = _problem()
    kw = dict(top_k=12, top_p=0.8, temperature=0.9)
    h1, b1 = h.clone().requires_grad_(), b.clone().requires_grad_()  # w: no gradient wanted
    lp, ent = log_probs_and_entropy_from_hidden(
        h1, w, labels, bias=b1, return_entropy=use != "no_entropy_returned", **kw
    )
    (ent if use == "entropy" else lp).sum().backward()
    h2, b2 = h.clone().requires_grad_(), b.clone().requires_grad_()
    ref = rlmath.log_probs_and_entropy_from_logits(h2 @ w.T + b2, labels, **kw)
    (ref[1] if use == "entropy" else ref[0]).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(b1.grad, b2.grad, rtol=0, atol=1e-11)
    if use == "no_entropy_returned":
        assert ent is None
