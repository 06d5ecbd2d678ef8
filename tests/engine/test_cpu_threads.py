"""CPU passes on worker threads and per-call thread counts: same results, no leaked settings.

The vocabulary passes share their chunks out over ``torch.get_num_threads()``
workers, each running its chunk on one intra-op thread; the advantage
estimators run small inputs on one thread (``rlmath._threads``). Neither may
change a result (bitwise, for any thread count and when called from several
Python threads at once) or leave a thread count changed behind.
"""

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import rlmath as R
from rlmath._threads import (
    SERIAL_ELEMENTS,
    _mkl_function,
    _mkl_local,
    _openmp,
    limit_threads,
    threads_for,
)
from rlmath.engine.workers import for_each_block, for_each_chunk
from tests.memory_tracker import MemoryTracker


def _logits(n=2500, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64).float() * 3
    x[7, :] = float("-inf")  # a dead row
    x[8, 5:] = float("-inf")  # a padded vocabulary
    labels = torch.randint(0, v, (n,), generator=g)
    labels[8] = 2
    temp = torch.rand(n, generator=g) + 0.5
    upstream = torch.randn(2, n, generator=g)
    return x, labels, temp, upstream


def assert_bitwise_equal(a, b):
    # NaN where the math gives NaN (the all -inf row), in the same places.
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _values_and_grads(x, labels, temp, upstream, chunk=64):
    leaf = x.detach().requires_grad_()
    logp, ent = R.log_probs_and_entropy_from_logits(
        leaf, labels, temperature=temp, chunk_size=chunk
    )
    torch.autograd.backward([logp, ent], [upstream[0], upstream[1]])
    return logp.detach(), ent.detach(), leaf.grad


@pytest.mark.parametrize("chunk", [64, None])
def test_log_probs_are_bitwise_equal_for_1_2_and_4_threads(threads, chunk, workers_used):
    inputs = _logits()
    results = []
    for n in (1, 2, 4):
        threads(n)
        results.append(_values_and_grads(*inputs, chunk=chunk))
    assert max(workers_used) == 4 and min(workers_used) == 1
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_bitwise_equal(a, b)


def test_calls_from_several_python_threads_match_serial_calls(threads):
    threads(2)
    inputs = [_logits(n=700, seed=s) for s in range(6)]
    serial = [_values_and_grads(*i) for i in inputs]
    with ThreadPoolExecutor(max_workers=3) as pool:
        concurrent = list(pool.map(lambda i: _values_and_grads(*i), inputs))
    for s, c in zip(serial, concurrent, strict=True):
        for a, b in zip(s, c, strict=True):
            assert_bitwise_equal(a, b)
    assert torch.get_num_threads() == 2


def test_gae_is_bitwise_equal_for_1_2_and_4_threads(threads):
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(2, 64, 4096, generator=g)
    mask = torch.rand(64, 4096, generator=g) > 0.1
    out = []
    for n in (1, 2, 4):
        threads(n)
        out.append(R.compute_gae_advantage_return(r, v, mask, gamma=0.99, lam=0.95))
    for adv, ret in out[1:]:
        assert torch.equal(adv, out[0][0]) and torch.equal(ret, out[0][1])


@pytest.mark.parametrize("name", ["grpo", "rloo", "grpo_passk", "opo", "gdpo"])
def test_outcome_estimators_are_bitwise_equal_for_1_2_and_4_threads(threads, name):
    # 2048 x 2100 = 4.3 M elements: above SERIAL_ELEMENTS, so the call uses torch's threads.
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(2048, 2100, generator=g)
    mask = torch.rand(2048, 2100, generator=g) > 0.3
    index = torch.randperm(2048, generator=g) // 8
    assert rewards.numel() >= SERIAL_ELEMENTS
    fn = R.get_advantage_estimator(name)
    out = []
    for n in (1, 2, 4):
        threads(n)
        out.append(fn(rewards, mask, index))
    for adv, ret in out[1:]:
        assert torch.equal(adv, out[0][0]) and torch.equal(ret, out[0][1])


def test_outcome_estimators_from_several_python_threads_match_serial_calls(threads):
    threads(2)
    g = torch.Generator().manual_seed(3)
    calls = []
    for k, name in enumerate(["grpo", "rloo", "grpo_passk", "opo"] * 2):
        rows = 512 * (k + 1)  # the larger calls use torch's threads, the smaller one thread
        rewards = torch.randn(rows, 1100, generator=g)
        mask = torch.rand(rows, 1100, generator=g) > 0.3
        index = torch.randperm(rows, generator=g) // 8
        if k % 2:
            index = index * 1000 + 7  # spread wider than the batch: the sort path
        calls.append((R.get_advantage_estimator(name), rewards, mask, index))
    serial = [fn(r, m, i) for fn, r, m, i in calls]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(lambda c: c[0](*c[1:]), calls))
    for s, c in zip(serial, concurrent, strict=True):
        for a, b in zip(s, c, strict=True):
            assert torch.equal(a, b)
    assert torch.get_num_threads() == 2


def test_a_call_leaves_the_thread_count_as_it_was(threads):
    threads(2)
    x, labels, temp, upstream = _logits(n=600)
    _values_and_grads(x, labels, temp, upstream)
    R.compute_gae_advantage_return(x[:, :50], x[:, 50:100], x[:, :50] > 0, gamma=1.0, lam=1.0)
    R.compute_grpo_outcome_advantage(x[:8, :4], torch.ones(8, 4), torch.arange(8) // 4)
    R.reverse_discounted_cumsum(x[:, :300], 0.9)
    assert torch.get_num_threads() == 2


needs_openmp = pytest.mark.skipif(
    _openmp() is None, reason="torch does not run its CPU ops on OpenMP here"
)


@needs_openmp
def test_limit_threads_acts_on_the_calling_thread_only(threads):
    threads(2)
    inside, other = [], []
    entered, checked = threading.Event(), threading.Event()

    def elsewhere():
        entered.wait(5)
        other.append(torch.get_num_threads())
        checked.set()

    t = threading.Thread(target=elsewhere)
    t.start()
    with limit_threads(1):
        inside.append(torch.get_num_threads())
        entered.set()
        checked.wait(5)
    t.join()
    assert inside == [1] and other == [2]
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), limit_threads(1):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def _mkl_max_threads():
    """MKL's thread count for the calling thread (its per-thread value when set)."""
    fn = _mkl_function("MKL_Get_Max_Threads")
    assert fn is not None, "MKL_Set_Num_Threads_Local was found, MKL_Get_Max_Threads not"
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn()


needs_mkl_local = pytest.mark.skipif(
    _openmp() is None or _mkl_local() is None,
    reason="torch's matmuls do not run in an MKL with per-thread counts here",
)


@needs_mkl_local
def test_limit_threads_also_limits_mkl_after_set_num_threads(threads):
    # torch.set_num_threads gives every thread MKL's per-thread count, which
    # MKL then reads instead of OpenMP's: the limit must set both.
    threads(2)
    assert _mkl_max_threads() == 2
    inside, other = [], []
    entered, checked = threading.Event(), threading.Event()

    def elsewhere():
        torch.get_num_threads()  # this thread's first torch call sets its counts
        entered.wait(5)
        other.append(_mkl_max_threads())
        checked.set()

    t = threading.Thread(target=elsewhere)
    t.start()
    with limit_threads(1):
        inside.append(_mkl_max_threads())
        entered.set()
        checked.wait(5)
    t.join()
    assert inside == [1] and other == [2]
    assert _mkl_max_threads() == 2
    with pytest.raises(RuntimeError), limit_threads(1):
        raise RuntimeError("inside")
    assert _mkl_max_threads() == 2


@needs_mkl_local
def test_chunk_workers_run_their_matmuls_on_one_thread(threads):
    threads(2)
    seen = []
    lock = threading.Lock()

    def work(a, b, ws):
        with lock:
            seen.append((torch.get_num_threads(), _mkl_max_threads()))

    for_each_chunk([(i, i + 1) for i in range(16)], work, dict, 2)
    assert seen == [(1, 1)] * 16
    assert _mkl_max_threads() == 2


def test_limit_threads_never_raises_the_count(threads):
    threads(1)
    with limit_threads(4):
        assert torch.get_num_threads() == 1


def test_threads_for_small_and_large_calls(threads):
    threads(2)
    cpu = torch.device("cpu")
    assert threads_for(64 * 4096, cpu) == 1
    assert threads_for(1 << 24, cpu) == 2


def test_for_each_chunk_runs_every_range_once_and_raises_a_workers_error():
    ranges = [(i, i + 1) for i in range(200)]
    seen = []
    lock = threading.Lock()

    def work(a, b, ws):
        with lock:
            seen.append(a)

    for_each_chunk(ranges, work, dict, 3)
    assert sorted(seen) == list(range(200))

    def failing(a, b, ws):
        if a == 57:
            raise ValueError("chunk 57")

    with pytest.raises(ValueError, match="chunk 57"):
        for_each_chunk(ranges, failing, dict, 3)


def test_a_dispatch_mode_keeps_the_chunks_on_the_calling_thread():
    # A TorchDispatchMode (here the memory tracker) lives on one thread: the ops
    # it must see cannot move to workers.
    ids = set()

    def work(a, b, ws):
        ids.add(threading.get_ident())
        torch.ones(4)

    with MemoryTracker() as mem:
        for_each_chunk([(i, i + 1) for i in range(50)], work, dict, 4)
    assert ids == {threading.get_ident()}
    assert len(mem.allocations) == 50


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize(("along_rows", "along_columns"), [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_for_each_block_runs_every_block_once_after_the_blocks_before_it(
    workers, along_rows, along_columns
):
    rows, columns = 7, 5
    done = set()
    lock = threading.Lock()
    rng = torch.Generator().manual_seed(workers)
    pauses = (torch.rand(rows, columns, generator=rng) * 2e-3).tolist()

    def work(i, j, ws):
        with lock:
            assert (i, j) not in done
            if along_rows and j > 0:
                assert (i, j - 1) in done
            if along_columns and i > 0:
                assert (i - 1, j) in done
        threading.Event().wait(pauses[i][j])  # vary the interleaving
        with lock:
            done.add((i, j))

    for_each_block(
        rows, columns, work, dict, workers, along_rows=along_rows, along_columns=along_columns
    )
    assert done == {(i, j) for i in range(rows) for j in range(columns)}


def test_for_each_block_sums_in_the_same_order_whatever_the_workers():
    # Row sums added block by block, column sums too: the orders make them
    # bitwise those of a plain loop for any number of workers.
    x = torch.randn(12, 9, 64, generator=torch.Generator().manual_seed(0))

    def sums(workers):
        by_row, by_col = torch.zeros(12, 64), torch.zeros(9, 64)

        def work(i, j, ws):
            by_row[i] += x[i, j]
            by_col[j] += x[i, j]

        for_each_block(12, 9, work, dict, workers, along_rows=True, along_columns=True)
        return by_row, by_col

    want = sums(1)
    for workers in (2, 3, 4):
        for a, b in zip(sums(workers), want, strict=True):
            assert_bitwise_equal(a, b)


def test_for_each_block_works_on_while_one_block_is_held_up():
    # Block (0, 0) waits until every block of the other rows is done: with a
    # barrier between blocks (or one block at a time) this could never finish.
    rows, columns = 4, 6
    others_done = threading.Event()
    count, lock = [0], threading.Lock()

    def work(i, j, ws):
        if (i, j) == (0, 0):
            assert others_done.wait(timeout=60), "the other workers stopped"
            return
        with lock:
            count[0] += 1 if i > 0 else 0
            if count[0] == (rows - 1) * columns:
                others_done.set()

    for_each_block(rows, columns, work, dict, 2, along_rows=True, along_columns=False)
    assert others_done.is_set()


def test_for_each_block_raises_a_workers_error_and_runs_on_one_thread_each(threads):
    threads(2)
    seen = set()
    lock = threading.Lock()

    def work(i, j, ws):
        with lock:
            seen.add((torch.get_num_threads(), _mkl_max_threads()))
        if (i, j) == (3, 2):
            raise ValueError("block (3, 2)")

    with pytest.raises(ValueError, match=r"block \(3, 2\)"):
        for_each_block(6, 4, work, dict, 2, along_rows=True, along_columns=True)
    assert seen == {(1, 1)}
    assert torch.get_num_threads() == 2


def test_for_each_block_keeps_a_dispatch_mode_on_the_calling_thread():
    ids = set()

    def work(i, j, ws):
        ids.add(threading.get_ident())
        torch.ones(4)

    with MemoryTracker() as mem:
        for_each_block(5, 4, work, dict, 4, along_rows=True, along_columns=False)
    assert ids == {threading.get_ident()}
    assert len(mem.allocations) == 20


@pytest.mark.parametrize(
    ("softcap", "dtype"), [(None, "float32"), (30.0, "float32"), (None, "bfloat16")]
)
def test_fused_head_is_bitwise_equal_for_1_2_and_4_threads(
    threads, softcap, dtype, workers_used, matmul_library
):
    from rlmath.fused_head import log_probs_and_entropy_from_hidden

    g = torch.Generator().manual_seed(2)
    # 2100 rows in one chunk are cut into 5 pieces of 420 rows, each with each
    # of four tiles of 256 entries (the last 232) a block, one worker task; the
    # blocks add into grad_hidden in tile order and into grad_weight in row
    # order whatever thread runs them. bf16 sums grad_hidden in fp32 over all
    # rows and copies each weight tile to fp32 once per worker and tile.
    dt = getattr(torch, dtype)
    h = torch.randn(2100, 32, generator=g).to(dt)
    w = (torch.randn(1000, 32, generator=g) * 0.3).to(dt)
    labels = torch.randint(0, 1000, (2100,), generator=g)
    labels[3] = -100
    up = torch.randn(2, 2100, generator=g)
    results = []
    for n in (1, 2, 4):
        threads(n)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = log_probs_and_entropy_from_hidden(
            hh, ww, labels, softcap=softcap, chunk_size=2100, vocab_chunk_size=256
        )
        torch.autograd.backward([logp, ent], [up[0], up[1]])
        results.append((logp.detach(), ent.detach(), hh.grad, ww.grad))
    assert max(workers_used) == 4 and min(workers_used) == 1
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert_bitwise_equal(a, b)


def test_fused_heads_from_several_python_threads_match_serial_calls(threads, matmul_library):
    from rlmath.fused_head import log_probs_and_entropy_from_hidden

    threads(2)
    g = torch.Generator().manual_seed(4)
    calls = []
    for k in range(6):
        n = 300 + 250 * k  # one to several pieces of rows, several tiles each
        h = torch.randn(n, 48, generator=g)
        w = torch.randn(900, 48, generator=g) * 0.3
        labels = torch.randint(0, 900, (n,), generator=g)
        calls.append((h, w, labels, torch.randn(2, n, generator=g)))

    def run(call):
        h, w, labels, up = call
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = log_probs_and_entropy_from_hidden(
            hh, ww, labels, chunk_size=700, vocab_chunk_size=256
        )
        torch.autograd.backward([logp, ent], [up[0], up[1]])
        return logp.detach(), ent.detach(), hh.grad, ww.grad

    serial = [run(c) for c in calls]
    with ThreadPoolExecutor(max_workers=3) as pool:
        concurrent = list(pool.map(run, calls))
    for s, c in zip(serial, concurrent, strict=True):
        for a, b in zip(s, c, strict=True):
            assert_bitwise_equal(a, b)
    assert torch.get_num_threads() == 2
