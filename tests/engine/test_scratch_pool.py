"""CPU scratch buffers are kept per thread between passes, and never seen from outside.

A pass takes its scratch from :mod:`rlmath.engine.torch_backend.buffers`'s
per-thread pool and hands it back at its end. What must hold: a second call
reuses the first call's memory (no fresh pages); no result, saved tensor or
gradient of one call shares memory with a later call's scratch; a buffer that
something still refers to is never handed on; inference-mode tensors are not
kept (a later call outside inference mode writes into its scratch); a dispatch
mode sees every allocation; the memory kept is bounded.
"""

import gc
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rlmath as R
from rlmath.engine.torch_backend import buffers
from rlmath.engine.torch_backend.buffers import HELD_BYTES, Workspace

CPU = torch.device("cpu")


def _kept() -> list[int]:
    return sorted(b.data_ptr() for b in buffers._pool.free)


def _logits(seed: int, n: int = 8, v: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3, torch.randint(0, v, (n,), generator=g)


def test_a_second_call_reuses_the_first_calls_scratch():
    x, labels = _logits(0)
    _clear()
    R.log_probs_and_entropy_from_logits(x, labels)
    first = _kept()
    assert first, "the pass kept no scratch buffer"
    R.log_probs_and_entropy_from_logits(x, labels)
    assert _kept() == first


def test_results_saved_tensors_and_gradients_do_not_share_memory_with_later_calls():
    x1, labels1 = _logits(1)
    x2, labels2 = _logits(2)
    ref_lp, ref_h = (t.detach() for t in R.log_probs_and_entropy_from_logits(x1, labels1))
    a = x1.clone().requires_grad_()
    lp, h = R.log_probs_and_entropy_from_logits(a, labels1)
    (lp.sum() + h.sum()).backward()
    ref_grad = a.grad.clone()

    b = x1.clone().requires_grad_()
    lp, h = R.log_probs_and_entropy_from_logits(b, labels1)
    # Later calls of every pass on other values, between the forward and the backward.
    for _ in range(3):
        c = x2.clone().requires_grad_()
        lp2, h2 = R.log_probs_and_entropy_from_logits(c, labels2)
        (lp2.sum() + h2.sum()).backward()
        R.kl_from_logits(x2, x1)
    assert torch.equal(lp, ref_lp) and torch.equal(h.detach(), ref_h)
    (lp.sum() + h.sum()).backward()
    assert torch.equal(b.grad, ref_grad)


def test_a_buffer_with_a_live_view_is_not_handed_on():
    _clear()
    ws = Workspace(4, 256, torch.float32, CPU)
    view = ws.get("y", 2)
    other = ws.get("e", 4)
    other_ptr = other.data_ptr()
    del other
    ws.release()
    assert view.data_ptr() not in _kept()
    assert _kept() == [other_ptr]
    view.fill_(1.0)  # still the caller's own memory
    assert buffers._take(4 * 256, torch.float32, CPU).data_ptr() == other_ptr


def test_inference_mode_buffers_are_not_kept_and_calls_mix_modes():
    x, labels = _logits(3)
    want = R.log_probs_from_logits(x, labels)
    _clear()
    with torch.inference_mode():
        got = R.log_probs_from_logits(x, labels)
    assert _kept() == []
    assert torch.equal(got, want)
    R.log_probs_from_logits(x, labels)  # kept: a normal tensor
    with torch.inference_mode():
        assert torch.equal(R.log_probs_from_logits(x, labels), want)
    assert _kept(), "a normal buffer used in inference mode must be handed on"
    assert torch.equal(R.log_probs_from_logits(x, labels), want)


class _CountEmpty(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.empties = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
            self.empties += 1
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_every_allocation():
    x, labels = _logits(4)
    R.log_probs_from_logits(x, labels)
    kept = _kept()
    counts = []
    for _ in range(2):
        with _CountEmpty() as mode:
            R.log_probs_from_logits(x, labels)
        counts.append(mode.empties)
    assert counts[0] == counts[1] > 0
    assert _kept() == kept  # the mode's calls neither took nor gave


def _clear():
    while buffers._pool.free:
        buffers._take(buffers._pool.free[0].numel(), buffers._pool.free[0].dtype, CPU)


def test_the_memory_kept_is_bounded_over_all_threads():
    _clear()
    base = buffers.held_bytes()
    third = (HELD_BYTES - base) // 4 // 3 + 1
    buffers._give([torch.empty(third) for _ in range(5)])
    assert len(buffers._pool.free) == 2
    assert buffers.held_bytes() == base + 2 * third * 4 <= HELD_BYTES

    def other_thread():
        buffers._give([torch.empty(third) for _ in range(2)])
        return len(buffers._pool.free), buffers.held_bytes()

    with ThreadPoolExecutor(1) as ex:
        kept_there, held = ex.submit(other_thread).result()
    assert kept_there == 0 and held == base + 2 * third * 4  # no room left for that thread
    _clear()
    assert buffers.held_bytes() == base


def test_a_threads_buffers_are_uncounted_when_it_ends():
    base = buffers.held_bytes()
    t = threading.Thread(target=lambda: buffers._give([torch.empty(1000)]))
    t.start()
    t.join()
    del t
    gc.collect()
    assert buffers.held_bytes() == base


def test_no_buffer_of_a_fitting_size_is_taken_from_another_dtype_or_far_larger():
    _clear()
    big = torch.empty(1 << 20)
    buffers._give([big])
    assert buffers._take(1000, torch.float32, CPU).numel() == 1000
    assert buffers._take(1 << 20, torch.float64, CPU).dtype == torch.float64
    assert buffers._take(1 << 19, torch.float32, CPU).data_ptr() == big.data_ptr()


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_repeated_small_calls_touch_no_new_pages():
    # glibc told to give freed memory back at once (as it does on its own once
    # enough of the top of the heap is free): scratch freed after each call
    # would come back as new pages, each a page fault on first touch.
    script = textwrap.dedent(
        """
        import ctypes, resource
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        assert libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024) == 1
        assert libc.mallopt(M_TRIM_THRESHOLD, 0) == 1
        import torch, rlmath
        torch.set_num_threads(1)
        x = torch.randn(8, 32000)
        labels = torch.randint(0, 32000, (8,))
        for _ in range(5):
            rlmath.log_probs_and_entropy_from_logits(x, labels)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(50):
            rlmath.log_probs_and_entropy_from_logits(x, labels)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    faults_per_call = float(out.stdout.strip().splitlines()[-1])
    # One (8, 32000) fp32 scratch buffer is 1000 KiB, 250 pages; a call uses two.
    assert faults_per_call < 25, faults_per_call


def test_release_kept_frees_every_threads_scratch():
    x, labels = _logits(5)
    R.log_probs_from_logits(x, labels)
    with ThreadPoolExecutor(1) as ex:
        ex.submit(R.log_probs_from_logits, x, labels).result()
        assert buffers.held_bytes() > 0
        buffers.release_kept()
        assert buffers.held_bytes() == 0 and _kept() == []
