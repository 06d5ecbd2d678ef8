"""Fixtures of the engine's tests: torch's thread count, and the workers each pass ran on."""

import pytest
import torch

from rlmath.engine import execution
from rlmath.engine.workers import _mode_active
from tests.engine.pool_helpers import on_a_pool_thread_too


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def workers_used(monkeypatch):
    """The worker count of every chunked pass run during the test.

    A pass of two workers or more runs part of its work on a pool thread for sure.
    """
    for_each_chunk, for_each_block = execution.for_each_chunk, execution.for_each_block
    used = []

    def shared(work, workers):
        return on_a_pool_thread_too(work) if workers > 1 and not _mode_active() else work

    def spy(ranges, work, scratch, workers):
        used.append(workers)
        return for_each_chunk(ranges, shared(work, workers), scratch, workers)

    def block_spy(rows, columns, work, scratch, workers, **order):
        used.append(workers)
        return for_each_block(rows, columns, shared(work, workers), scratch, workers, **order)

    monkeypatch.setattr(execution, "for_each_chunk", spy)
    monkeypatch.setattr(execution, "for_each_block", block_spy)
    return used
