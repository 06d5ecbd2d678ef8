"""Memory contract: the (N, V) logits never exist, in forward or backward (deterministic tracker)."""

from __future__ import annotations

import pytest
import torch

from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import log_probs_and_entropy_from_logits
from tests.memory_tracker import MemoryTracker

# Every test runs with the head's fp32 CPU matmuls in torch's BLAS and in oneDNN.
pytestmark = pytest.mark.usefixtures("matmul_library")

N, H, V = 256, 16, 2000
ROWS, TILE = 32, 384  # a vocabulary tile on the 128-column grid


def run_tracked(fn, leaves):
    with MemoryTracker() as mem:
        mem.phase = "forward"
        outs = [o for o in fn(*leaves) if o is not None]
        mem.phase = "backward"
        sum(o.sum() for o in outs).backward()
    return mem


def inputs(dtype, with_bias=True):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.2).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    return hidden, weight, bias, labels


def assert_no_logits_sized_tensors(mem, leaves):
    """Nothing of (N, V) entries; peaks within 10% of the fp32 logits beyond the allowed tensors."""
    logits_fp32 = 4 * N * V
    smallest_logits = 2 * N * V  # (N, V) in a 16-bit dtype
    allowed = {(tuple(x.shape), x.dtype) for x in leaves}  # the gradients
    weight = leaves[1]
    half = weight.dtype in (torch.bfloat16, torch.float16)
    if half:  # one fp32 accumulator of the weight's shape
        allowed.add((tuple(weight.shape), torch.float32))
    big = [a for a in mem.allocations if a.nbytes >= smallest_logits]
    assert big == [], big
    assert mem.largest(phase="forward") <= 4 * ROWS * TILE * 4
    # The statistics of the fixed tree: at most (m, s, t) per row and 128-column tile
    # (0.15 % of the logits at V = 32000; 1.6 % at this V = 2000).
    stats = 3 * 4 * N * -(-V // 128)
    assert mem.peak_by_phase["forward"] <= 0.10 * logits_fp32 + stats
    grads = sum(x.numel() * x.element_size() for x in leaves)
    acc = weight.numel() * 4 if half else 0
    # The backward peak counts the gradients and the accumulator (and the
    # forward's outputs, a few bytes per row): beyond them, 10% of the logits.
    assert mem.peak_by_phase["backward"] <= grads + acc + 0.10 * logits_fp32
    for a in mem.allocations_at_least(max(x.numel() * x.element_size() for x in leaves) // 2):
        assert (a.shape, a.dtype) in allowed or a.nbytes <= 4 * ROWS * TILE * 4, a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
def test_no_logits_sized_temporaries(dtype, entropy):
    hidden, weight, bias, labels = inputs(dtype)
    t = torch.rand(N) + 0.5
    mem = run_tracked(
        lambda h, w, b: log_probs_and_entropy_from_hidden(
            h, w, labels, bias=b, temperature=t, return_entropy=entropy, chunk_size=ROWS,
            vocab_chunk_size=TILE,
        ),
        (hidden, weight, bias),
    )  # fmt: skip
    assert_no_logits_sized_tensors(mem, [hidden, weight, bias])


def test_automatic_tiles_are_bounded():
    n, h, v = 512, 8, 8192
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    mem = run_tracked(
        lambda x, w: log_probs_and_entropy_from_hidden(x, w, labels), (hidden, weight)
    )
    logits_fp32 = 4 * n * v
    assert mem.largest() < logits_fp32 // 16
    assert mem.peak_by_phase["forward"] <= 0.10 * logits_fp32
    grads = 4 * (n * h + v * h)
    assert mem.peak_by_phase["backward"] <= grads + 0.10 * logits_fp32


def test_tracker_catches_the_unfused_path():
    # The checks above can fail: the unfused path holds (N, V) logits and their gradient.
    hidden, weight, bias, labels = inputs(torch.float32)
    safe = labels.clamp_min(0)
    mem = run_tracked(
        lambda h, w, b: log_probs_and_entropy_from_logits(h @ w.T + b, safe),
        (hidden, weight, bias),
    )
    assert mem.allocations_at_least(4 * N * V, phase="forward")
    assert mem.allocations_at_least(4 * N * V, phase="backward")
    with pytest.raises(AssertionError):
        assert_no_logits_sized_tensors(mem, [hidden, weight, bias])
