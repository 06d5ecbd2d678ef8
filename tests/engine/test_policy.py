"""Chunk and tile sizes: bounded, and evaluated inside the operators."""

from __future__ import annotations

import torch

from rlmath.engine.policy import auto_chunk_size


def test_auto_chunk_size_cpu():
    threads = torch.get_num_threads()
    two_mib = 2**21
    for v in (1, 100, 32000, 151936, 10**7):
        for n in (None, 1, 3, 100, 4096, 8192, 10**6):
            c = auto_chunk_size(v, n)
            assert c == auto_chunk_size(v, n, device="cpu")
            assert c >= 1
            # About 2 MiB of fp32 per buffer, at least two rows per thread.
            expected = max(two_mib // (4 * v), 2 * threads)
            if n is not None:
                expected = min(expected, n)
            assert max(1, expected - threads + 1) <= c <= expected
            if n is not None:
                assert c <= n
    if threads == 2:
        assert auto_chunk_size(32000, 8192) == 16
        assert auto_chunk_size(151936, 4096) == 4


def test_auto_chunk_size_other_devices(monkeypatch):
    """GPU chunks: about 16 of them, each fp32 buffer 64 MiB to 1 GiB (and at most 1/64 of
    the device's memory), so that launches do not dominate; CPU sizes are unchanged."""
    from rlmath.engine import policy

    threads = torch.get_num_threads()
    min_bytes, max_bytes = 64 * 2**20, 2**30
    monkeypatch.setattr(policy, "_device_memory", lambda device: None)  # no CUDA device here
    for v in (1, 100, 32000, 151936, 10**7):
        c = auto_chunk_size(v, device="cuda")
        assert c >= 1
        assert c * v * 4 <= max(min_bytes, v * 4 * threads)
        for n in (1, 100, 4096, 8192, 10**6):
            c = auto_chunk_size(v, n, device=torch.device("cuda"))
            assert 1 <= c <= n
            assert c * v * 4 <= max(max_bytes, v * 4 * threads)  # buffer bounded
            lo, hi = max(1, min_bytes // (4 * v)), max(1, max_bytes // (4 * v))
            expected = min(max(n // 16, lo), hi, n)  # about 16 chunks between the bounds
            assert expected - threads < c <= expected
            if n * v * 4 >= 16 * min_bytes and n // 16 <= hi:
                assert c * v * 4 >= min_bytes - v * 4 * threads  # never small GPU chunks
    # [16384, 151936] logits: 16 chunks of 1024 rows (594 MiB of fp32 each).
    assert auto_chunk_size(151936, 16384, device="cuda") == 1024
    assert auto_chunk_size(32000, 8192, device="cuda") == 524 - 524 % threads
    # A 24 GiB device: a buffer takes at most 384 MiB.
    monkeypatch.setattr(policy, "_device_memory", lambda device: 24 * 2**30)
    assert auto_chunk_size(151936, 16384, device="cuda") * 151936 * 4 <= 384 * 2**20
    # The CPU default is unchanged.
    assert auto_chunk_size(32000, 8192) == max(16, 2 * threads) - max(16, 2 * threads) % threads
