"""The CPU worker pool is invisible: the caller's thread-local state holds in the workers, or
the work stays on the caller; where the pool cannot limit its threads it is off.

Every pass here is sized to run on two workers or more (``workers_used``):
``(512, 256)`` logits in chunks of 16 rows are 32 chunks, the fused head's
``(600, 32) × (512, 32)`` with 300-row chunks and 128-entry tiles a grid of
2 × 4 blocks. Each comparison is with the same call on one thread, bitwise:
every chunk and block runs the same ops whichever thread runs it.
"""

import ctypes
import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

import rlmath as R
from rlmath import _threads
from rlmath._operators import python_body
from rlmath.engine import workers as pool
from rlmath.engine.workers import for_each_chunk
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from tests.engine.pool_helpers import on_a_pool_thread_too

CHUNK = 16


def _inputs(seed=0, n=512, v=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64).float() * 3
    ref = x + 0.5 * torch.randn(n, v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    up = torch.randn(2, n, generator=g)
    return x, ref, labels, up


def _head_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(600, 32, generator=g)
    w = torch.randn(512, 32, generator=g) * 0.3
    labels = torch.randint(0, 512, (600,), generator=g)
    return h, w, labels, torch.randn(2, 600, generator=g)


def _logprobs(x, labels):
    return R.log_probs_and_entropy_from_logits(x, labels, chunk_size=CHUNK)


def _kl(x, ref):
    return (R.kl_from_logits(x, ref, chunk_size=CHUNK),)


def _head(h, w, labels):
    return log_probs_and_entropy_from_hidden(h, w, labels, chunk_size=300, vocab_chunk_size=128)


def _fwd_bwd(x, labels, up):
    leaf = x.detach().requires_grad_()
    logp, ent = _logprobs(leaf, labels)
    torch.autograd.backward([logp, ent], [up[0], up[1]])
    return logp.detach(), ent.detach(), leaf.grad


def _head_fwd_bwd(h, w, labels, up):
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    logp, ent = _head(hh, ww, labels)
    torch.autograd.backward([logp, ent], [up[0], up[1]])
    return logp.detach(), ent.detach(), hh.grad, ww.grad


def _equal(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def _one_and_two(threads, fn):
    threads(1)
    one = fn()
    threads(2)
    two = fn()
    return one, two


# ---------------------------------------------------------------- inference mode


@pytest.mark.parametrize("op", ["log_probs_and_entropy", "kl", "fused_head"])
def test_inference_mode_on_two_workers_equals_one_thread(threads, workers_used, op):
    # Tensors made under inference mode (the outputs the workers write into,
    # and here the inputs too) may be written only under it: each worker enters it.
    x, ref, labels, _ = _inputs()
    h, w, hlabels, _ = _head_inputs()
    call = {
        "log_probs_and_entropy": lambda: _logprobs(x, labels),
        "kl": lambda: _kl(x, ref),
        "fused_head": lambda: _head(h, w, hlabels),
    }[op]
    threads(1)
    want = call()

    def under_inference():
        with torch.inference_mode():
            out = call()
            assert all(t.is_inference() for t in out)
            return out

    one, two = _one_and_two(threads, under_inference)
    _equal(one, want)
    _equal(two, want)
    assert max(workers_used) >= 2


def test_inference_tensors_as_inputs_on_two_workers(threads, workers_used):
    x, _, labels, _ = _inputs()
    with torch.inference_mode():
        xi, li = x.clone(), labels.clone()
    assert xi.is_inference()
    threads(1)
    want = _logprobs(x, labels)
    threads(2)
    with torch.inference_mode():
        _equal(_logprobs(xi, li), want)
    assert max(workers_used) >= 2


# ---------------------------------------------------------------- grad mode and autocast


def _record(ranges, workers, probe):
    """``probe()`` on whichever thread runs each range, by range start; some on a pool thread."""
    seen, ids, lock = {}, set(), threading.Lock()

    def work(a, b, ws):
        value = probe()
        with lock:
            seen[a] = value
            ids.add(threading.get_ident())

    for_each_chunk(ranges, on_a_pool_thread_too(work), dict, workers)
    assert ids - {threading.get_ident()}
    return seen


RANGES = [(i, i + 1) for i in range(64)]


@pytest.mark.parametrize("enabled", [True, False])
def test_workers_run_under_the_callers_grad_mode(threads, enabled):
    threads(2)
    with torch.set_grad_enabled(enabled):
        seen = _record(RANGES, 2, torch.is_grad_enabled)
    assert set(seen.values()) == {enabled}


def test_workers_run_under_the_callers_cpu_autocast(threads):
    # A matmul under CPU autocast runs in bf16 on the calling thread: on a worker too.
    threads(2)
    a = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def product():
        return torch.mm(a, a)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        on_caller = product()
        seen = _record(RANGES, 2, product)
    assert on_caller.dtype == torch.bfloat16
    for out in seen.values():
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, on_caller)
    assert not torch.is_autocast_enabled("cpu")
    after = _record(RANGES, 2, product)
    assert {out.dtype for out in after.values()} == {torch.float32}


def test_fused_head_under_autocast_equals_one_thread(threads, workers_used):
    h, w, labels, up = _head_inputs()

    def call():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _head_fwd_bwd(h, w, labels, up)

    one, two = _one_and_two(threads, call)
    _equal(one, two)
    assert max(workers_used) >= 2


# ---------------------------------------------------------------- process-wide settings


def test_deterministic_algorithms_hold_in_the_workers(threads, workers_used):
    # torch's flag is process-wide: the workers read it as the caller does.
    x, _, labels, up = _inputs()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        threads(2)
        seen = _record(RANGES, 2, torch.are_deterministic_algorithms_enabled)
        one, two = _one_and_two(threads, lambda: _fwd_bwd(x, labels, up))
    finally:
        torch.use_deterministic_algorithms(before)
    assert set(seen.values()) == {True}
    _equal(one, two)
    assert max(workers_used) >= 2


def test_default_dtype_and_anomaly_detection_hold_in_the_workers(threads, workers_used):
    x, _, labels, up = _inputs()
    threads(1)
    want = _fwd_bwd(x, labels, up)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autograd.set_detect_anomaly(True):
            threads(2)
            seen = _record(
                RANGES, 2, lambda: (torch.get_default_dtype(), torch.is_anomaly_enabled())
            )
            got = _fwd_bwd(x, labels, up)
    finally:
        torch.set_default_dtype(dtype)
    assert set(seen.values()) == {(torch.float64, True)}
    _equal(got, want)
    assert max(workers_used) >= 2


# ---------------------------------------------------------------- denormal numbers


def test_flushing_denormals_holds_in_the_workers(threads, workers_used):
    # torch.set_flush_denormal is a setting of the calling thread's CPU
    # registers. Probabilities near e^-95 are subnormal in fp32: flushed, their
    # gradient entries are 0 on every thread, as on one thread.
    g = torch.Generator().manual_seed(3)
    x = torch.full((512, 64), -95.0) + torch.rand(512, 64, generator=g)
    x[:, 0] = 0.0
    labels = torch.zeros(512, dtype=torch.long)
    up = torch.randn(2, 512, generator=g)
    threads(2)
    pool._shared_pool().submit(lambda: None).result()  # pool threads started before the setting
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormal numbers")
    try:
        one, two = _one_and_two(threads, lambda: _fwd_bwd(x, labels, up))
    finally:
        torch.set_flush_denormal(False)
    tiny = torch.finfo(torch.float32).smallest_normal
    assert not ((one[2] != 0) & (one[2].abs() < tiny)).any()
    _equal(one, two)
    assert max(workers_used) >= 2
    # And without the setting the same gradient has subnormal entries.
    unflushed = _fwd_bwd(x, labels, up)[2]
    assert ((unflushed != 0) & (unflushed.abs() < tiny)).any()


# ---------------------------------------------------------------- modes stay on the caller


class _OpsSeen(TorchFunctionMode):
    """Counts the torch functions it sees, running rlmath's operators' bodies with itself on."""

    def __init__(self):
        super().__init__()
        self.count, self.threads = 0, set()
        self.lock = threading.Lock()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self.lock:
            self.count += 1
            self.threads.add(threading.get_ident())
        body = python_body(func)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        return func(*args, **kwargs)


def test_a_function_mode_keeps_the_chunks_on_the_calling_thread():
    ids = set()

    def work(a, b, ws):
        ids.add(threading.get_ident())

    with _OpsSeen():
        for_each_chunk(RANGES, work, dict, 4)
    assert ids == {threading.get_ident()}


def test_a_function_mode_sees_every_op_of_a_pass(threads, workers_used):
    x, _, labels, up = _inputs()

    def counted():
        with _OpsSeen() as mode:
            out = _fwd_bwd(x, labels, up)
        return out, mode

    (one, mode_one), (two, mode_two) = _one_and_two(threads, counted)
    _equal(one, two)
    assert mode_two.threads == {threading.get_ident()}
    # Each of the 32 chunks runs its ops in view of the mode, forward and backward.
    assert mode_one.count > 2 * 32 and mode_two.count == mode_one.count


def test_flop_counter_counts_the_fused_heads_matmuls(threads):
    from torch.utils.flop_counter import FlopCounterMode

    h, w, labels, up = _head_inputs()
    counts = []
    for n in (1, 2):
        threads(n)
        with FlopCounterMode(display=False) as flops:
            _head_fwd_bwd(h, w, labels, up)
        counts.append(flops.get_total_flops())
    n_rows, hid, vocab = h.shape[0], h.shape[1], w.shape[0]
    # Forward: the logits; backward: the logits again and the two gradients.
    assert counts == [2 * n_rows * hid * vocab * (1 + 3)] * 2


# ---------------------------------------------------------------- the pool off


@pytest.fixture
def detection():
    """Clear the once-per-process detections before and after the test (it patches their inputs)."""
    caches = (_threads._openmp, _threads._mkl_local, _threads._workers_setting)
    for c in caches:
        c.cache_clear()
    yield
    for c in caches:
        c.cache_clear()


def _pool_off_checks(threads, workers_used):
    x, ref, labels, up = _inputs()
    h, w, hlabels, hup = _head_inputs()
    threads(2)
    got = _fwd_bwd(x, labels, up), _kl(x, ref), _head_fwd_bwd(h, w, hlabels, hup)
    assert set(workers_used) == {1}
    with _threads.limit_threads(1):
        pass  # nothing to set, nothing raised
    assert _threads.pool_workers() == 1
    return got


def test_a_platform_without_cdll_none_runs_passes_on_the_calling_thread(
    threads, workers_used, detection, monkeypatch
):
    # On Windows ctypes.CDLL(None) raises TypeError: OpenMP's per-thread count
    # cannot be set, so no worker may start.
    x, ref, labels, up = _inputs()
    h, w, hlabels, hup = _head_inputs()
    threads(2)
    want = _fwd_bwd(x, labels, up), _kl(x, ref), _head_fwd_bwd(h, w, hlabels, hup)
    real_cdll = ctypes.CDLL

    def windows_cdll(name, *args, **kwargs):
        if name is None:
            raise TypeError("LoadLibrary() argument 1 must be str, not None")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(_threads.ctypes, "CDLL", windows_cdll)
    _threads._openmp.cache_clear()  # detected again, on the patched platform
    workers_used.clear()
    for a, b in zip(_pool_off_checks(threads, workers_used), want, strict=True):
        _equal(a, b)


@pytest.mark.parametrize(
    "backend",
    ["ATen parallel backend: native thread pool", "ATen parallel backend: Intel(R) TBB"],
)
def test_a_torch_without_openmp_runs_passes_on_the_calling_thread(
    threads, workers_used, detection, monkeypatch, backend
):
    info = torch.__config__.parallel_info()
    without_openmp = "\n".join(line for line in info.splitlines() if "OpenMP" not in line)
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: f"{without_openmp}\n{backend}")
    _pool_off_checks(threads, workers_used)


def test_env_var_zero_turns_the_pool_off(threads, workers_used, detection, monkeypatch):
    monkeypatch.setenv(_threads.WORKERS_ENV_VAR, "0")
    _pool_off_checks(threads, workers_used)


def test_env_var_sets_the_number_of_workers(threads, detection, monkeypatch):
    cpu = torch.device("cpu")
    threads(2)
    if _threads._openmp() is None:
        pytest.skip("torch does not run its CPU ops on OpenMP here: the pool is off")
    assert pool.pass_workers(cpu, 10) == 2
    monkeypatch.setenv(_threads.WORKERS_ENV_VAR, " 3 ")
    _threads._workers_setting.cache_clear()
    assert pool.pass_workers(cpu, 10) == 3
    assert pool.pass_workers(cpu, 2) == 2  # never more workers than chunks
    assert pool.pass_workers(torch.device("meta"), 10) == 1


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_env_var_is_a_value_error_at_first_use(threads, detection, monkeypatch, value):
    monkeypatch.setenv(_threads.WORKERS_ENV_VAR, value)
    x, _, labels, _ = _inputs()
    threads(2)
    with pytest.raises(ValueError, match=_threads.WORKERS_ENV_VAR):
        _logprobs(x, labels)
