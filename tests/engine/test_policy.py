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
