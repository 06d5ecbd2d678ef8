"""Backend registry: the torch path is the default; a registered backend is chosen at call time."""

from __future__ import annotations

import pytest
import torch

from rlmath import entropy_from_logits, kl_from_logits, log_probs_from_logits
from rlmath.logprobs import dispatch
from rlmath.logprobs.chunking import auto_chunk_size


def test_torch_backend_is_the_default():
    x = torch.randn(2, 5)
    assert dispatch.available_backends(x)[-1] == "torch"
    assert dispatch.get_kernel("kl", x) is dispatch.get_kernel("kl", x, backend="torch")


def test_registered_backend_is_selected_when_it_supports_the_input(monkeypatch):
    calls = []
    torch_lp = dispatch.get_kernel("log_probs_entropy", torch.empty(0), backend="torch")
    torch_kl = dispatch.get_kernel("kl", torch.empty(0), backend="torch")

    def lp(*args):
        calls.append("log_probs_entropy")
        return torch_lp(*args)

    def kl(*args):
        calls.append("kl")
        return torch_kl(*args)

    fake = dispatch.Backend(
        "fake",
        {"log_probs_entropy": lp, "kl": kl},
        supports=lambda t: t.dtype == torch.float64,
        priority=5,
    )
    monkeypatch.setitem(dispatch._BACKENDS, "fake", fake)
    x32, x64 = torch.randn(3, 7), torch.randn(3, 7, dtype=torch.float64)
    labels = torch.zeros(3, dtype=torch.long)
    log_probs_from_logits(x32, labels)
    assert calls == []
    log_probs_from_logits(x64, labels)
    entropy_from_logits(x64)
    kl_from_logits(x64, x64)
    assert calls == ["log_probs_entropy", "log_probs_entropy", "kl"]
    assert dispatch.available_backends(x64) == ["fake", "torch"]


def test_registry_errors():
    with pytest.raises(ValueError, match="op"):
        dispatch.get_kernel("softmax", torch.empty(1))
    with pytest.raises(ValueError, match="backend"):
        dispatch.get_kernel("kl", torch.empty(1), backend="triton-that-does-not-exist")
    with pytest.raises(ValueError, match="lacks kernels"):
        dispatch.register_backend(dispatch.Backend("half", {"kl": lambda *a: None}))


def test_auto_chunk_size_cpu():
    threads = torch.get_num_threads()
    one_mib = 2**20
    for v in (1, 100, 32000, 151936, 10**7):
        for n in (None, 1, 3, 100, 4096, 8192, 10**6):
            c = auto_chunk_size(v, n)
            assert c == auto_chunk_size(v, n, device="cpu")
            assert c >= 1
            # About 1 MiB of fp32 per buffer, at least two rows per thread.
            expected = max(one_mib // (4 * v), 2 * threads)
            if n is not None:
                expected = min(expected, n)
            assert max(1, expected - threads + 1) <= c <= expected
            if n is not None:
                assert c <= n
    if threads == 2:
        assert auto_chunk_size(32000, 8192) == 8
        assert auto_chunk_size(151936, 4096) == 4


def test_auto_chunk_size_other_devices():
    threads = torch.get_num_threads()
    two_mib, max_bytes = 2 * 2**20, 64 * 2**20
    for v in (1, 100, 32000, 151936, 10**7):
        c = auto_chunk_size(v, device="cuda")
        assert c >= 1
        assert c * v * 4 <= max(two_mib, v * 4 * threads)
        for n in (1, 100, 4096, 8192, 10**6):
            c = auto_chunk_size(v, n, device=torch.device("cuda"))
            assert 1 <= c <= n
            assert c * v * 4 <= max(max_bytes, v * 4 * threads)  # buffer bounded
            lo, hi = max(1, two_mib // (4 * v)), max(1, max_bytes // (4 * v))
            expected = min(max(n // 32, lo), hi, n)  # about 32 chunks between the bounds
            assert expected - threads < c <= expected
    assert auto_chunk_size(32000, 8192, device="cuda") == 256
