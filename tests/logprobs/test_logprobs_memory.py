"""Memory contract: no (N, V)-sized fp32 temporary in forward or backward, only the gradient."""

from __future__ import annotations

import pytest
import torch

from rlmath import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    log_probs_from_logits_response,
    log_probs_from_logits_response_rmpad,
)
from tests.memory_tracker import MemoryTracker

N, V, CHUNK = 512, 1000, 8
FUNCTIONS = {
    "log_probs": lambda x, lab: log_probs_from_logits(x, lab, chunk_size=CHUNK),
    "log_probs_k": lambda x, lab: log_probs_from_logits(
        x, torch.stack([lab, lab.flip(0)], -1), chunk_size=CHUNK
    ),
    "log_probs_temp": lambda x, lab: log_probs_from_logits(
        x, lab, chunk_size=CHUNK, temperature=torch.full((N,), 0.7)
    ),
    "entropy": lambda x, lab: entropy_from_logits(x, chunk_size=CHUNK, temperature=0.9),
    "log_probs_and_entropy": lambda x, lab: log_probs_and_entropy_from_logits(
        x, lab, chunk_size=CHUNK
    ),
}

# Under a sampler's kept set each chunk also holds its threshold search's buffers (the
# scaled logits, their exp, the bucket of each logit in int64, the kept-set mask and a
# few masks of the same shape): a bounded number of chunk buffers, never (N, V).
TRUNCATING = {
    "log_probs_top_k_top_p": lambda x, lab: log_probs_from_logits(
        x, lab, chunk_size=CHUNK, top_k=50, top_p=torch.full((N,), 0.9), temperature=0.7
    ),
    "log_probs_and_entropy_min_p_hf": lambda x, lab: log_probs_and_entropy_from_logits(
        x, lab, chunk_size=CHUNK, min_p=0.05, top_p=0.8, sampler="hf", kept_stats=True
    )[:2],
    "log_probs_replayed_kept_ids": lambda x, lab: log_probs_from_logits(
        x, lab, chunk_size=CHUNK, kept=torch.arange(40).expand(N, 40)
    ),
}
TRUNCATING_CHUNK_BUFFERS = 16


def run_tracked(fn, x, *args):
    with MemoryTracker() as mem:
        mem.phase = "forward"
        out = fn(x, *args)
        outs = out if isinstance(out, tuple) else (out,)
        mem.phase = "backward"
        sum(o.sum() for o in outs).backward()
    return mem


def assert_bounded(mem, logits_list, *, chunk_rows=CHUNK, forward_peak=None):
    n_v = logits_list[0].numel()
    fp32_size = 4 * n_v
    # Forward: nothing bigger than a few chunk buffers, no (N, V) anything.
    assert mem.largest(phase="forward") <= 8 * chunk_rows * V
    assert mem.peak_by_phase["forward"] <= (forward_peak or 0.10 * fp32_size)
    # Backward: the only full-size allocations are the gradients, in the inputs' dtypes.
    big = mem.allocations_at_least(n_v, phase="backward")
    assert sorted((a.shape, a.dtype) for a in big) == sorted(
        (tuple(x.shape), x.dtype) for x in logits_list
    ), big
    grad_bytes = sum(x.numel() * x.element_size() for x in logits_list)
    assert mem.peak_by_phase["backward"] <= grad_bytes + 0.10 * fp32_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_no_full_size_temporaries(name, dtype):
    x = torch.randn(N, V).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,))
    mem = run_tracked(FUNCTIONS[name], x, labels)
    assert_bounded(mem, [x])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TRUNCATING))
def test_kept_set_log_probs_hold_a_bounded_number_of_chunk_buffers(name, dtype):
    x = torch.randn(N, V).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,))
    mem = run_tracked(TRUNCATING[name], x, labels)
    assert_bounded(mem, [x], forward_peak=TRUNCATING_CHUNK_BUFFERS * 4 * CHUNK * V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ref_grad", [False, True])
def test_kl_has_no_full_size_temporaries(dtype, ref_grad):
    x = torch.randn(N, V).to(dtype).requires_grad_()
    r = torch.randn(N, V).to(dtype).requires_grad_(ref_grad)
    mem = run_tracked(lambda x: kl_from_logits(x, r, chunk_size=CHUNK), x)
    assert_bounded(mem, [x, r] if ref_grad else [x])


def test_response_functions_have_no_full_size_temporaries():
    B, S, R = 8, 70, 64
    x = torch.randn(B, S, V, requires_grad=True)
    ids = torch.randint(0, V, (B, S))
    mem = run_tracked(lambda x: log_probs_from_logits_response(ids, x, R, chunk_size=CHUNK), x)
    assert_bounded(mem, [x])
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[:, :3] = False
    packed = torch.randn(int(mask.sum()), V, requires_grad=True)
    mem = run_tracked(
        lambda x: log_probs_from_logits_response_rmpad(ids, mask, x, R, chunk_size=CHUNK), packed
    )
    assert_bounded(mem, [packed])


def test_automatic_chunk_size_is_bounded():
    n, v = 512, 32000
    x = torch.randn(n, v, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    mem = run_tracked(lambda x: log_probs_and_entropy_from_logits(x, labels), x)
    fp32_size = 4 * n * v
    assert mem.peak_by_phase["forward"] <= 0.10 * fp32_size
    assert mem.peak_by_phase["backward"] <= fp32_size + 0.10 * fp32_size
    assert [a.shape for a in mem.allocations_at_least(n * v)] == [(n, v)]


def test_tracker_catches_the_naive_implementation():
    # The test above can fail: log_softmax + gather creates (N, V) fp32 temporaries.
    x = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (N,))

    def naive(x, labels):
        return torch.log_softmax(x.float(), -1).gather(-1, labels[:, None]).squeeze(-1)

    mem = run_tracked(naive, x, labels)
    assert mem.allocations_at_least(4 * N * V, dtype=torch.float32, phase="forward")
    assert mem.allocations_at_least(4 * N * V, dtype=torch.float32, phase="backward")
    with pytest.raises(AssertionError):
        assert_bounded(mem, [x])


@pytest.mark.parametrize("name", ["log_probs_and_entropy", "fused_head"])
def test_tracker_sees_the_buffers_inside_rlmath_operators(monkeypatch, name):
    # Each pass is one torch.ops.rlmath operator; the tracker must count what
    # runs inside it. One chunk (or block) holding every row makes the pass's
    # own scratch (N, V)-sized, which the bounds above must then reject.
    if name == "fused_head":
        import rlmath.engine.torch_backend.head_blocks as blocks
        from rlmath.fused_head import log_probs_and_entropy_from_hidden

        # On a CPU a chunk is cut into pieces of rows, each piece × tile a block:
        # one piece of every row.
        monkeypatch.setattr(blocks, "matmul_piece", lambda length, device=None: length)

        h = torch.randn(N, 16, requires_grad=True)
        w = torch.randn(V, 16)

        def f(x):
            return log_probs_and_entropy_from_hidden(x, w, labels, chunk_size=N, vocab_chunk_size=V)

        leaf = h
    else:
        leaf = torch.randn(N, V, requires_grad=True)

        def f(x):
            return log_probs_and_entropy_from_logits(x, labels, chunk_size=N)

    labels = torch.randint(0, V, (N,))
    mem = run_tracked(f, leaf)
    assert mem.allocations_at_least(4 * N * V, dtype=torch.float32, phase="forward")
    assert mem.allocations_at_least(4 * N * V, dtype=torch.float32, phase="backward")
    if name != "fused_head":
        with pytest.raises(AssertionError):
            assert_bounded(mem, [leaf], chunk_rows=CHUNK)


def test_python_body_is_only_found_for_rlmath_operators():
    from rlmath._operators import python_body

    body = python_body(torch.ops.rlmath.logits_forward.default)
    assert callable(body) and body.__module__ == "rlmath.engine.ops"
    assert python_body(torch.ops.aten.add.Tensor) is None
    assert python_body(torch.add) is None and python_body(None) is None
