"""run_distributed's timeout: a hung rank fails the call and leaves no process behind.

Nothing here measures time: the tests check which error is raised and that
every worker process is gone afterwards.
"""

import datetime

import pytest
import torch.multiprocessing as mp

from rlmath.distributed import init_from_env, run_distributed

from .launch_workers import missing_rank_worker, ok_worker, sleep_worker


@pytest.fixture
def contexts(monkeypatch):
    """The process contexts run_distributed starts, to check afterwards that no worker lives."""
    import rlmath.distributed.launch as launch

    started = []
    real = launch.mp.start_processes

    def start_processes(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch.mp, "start_processes", start_processes)
    return started


def _all_gone(started):
    procs = [p for ctx in started for p in ctx.processes]
    return bool(procs) and all(not p.is_alive() and p.exitcode is not None for p in procs)


@pytest.mark.integration
def test_ranks_that_never_finish_time_out_and_are_terminated(contexts):
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) \[0, 1\] of 2 still running after timeout=3 s"
    ):
        run_distributed(sleep_worker, 2, timeout=3)
    assert _all_gone(contexts)


@pytest.mark.integration
def test_a_rank_missing_from_a_collective_fails_the_call(contexts):
    """The waiting rank hits the collective timeout or the call's own deadline, whichever first."""
    with pytest.raises((TimeoutError, mp.ProcessRaisedException)):
        run_distributed(missing_rank_worker, 2, timeout=3)
    assert _all_gone(contexts)


@pytest.mark.integration
def test_timeout_none_and_timedelta_still_run():
    assert run_distributed(ok_worker, 2, timeout=None) == [2.0, 2.0]
    assert run_distributed(ok_worker, 2, timeout=datetime.timedelta(minutes=2)) == [2.0, 2.0]


@pytest.mark.parametrize(
    ("timeout", "error"), [(0, ValueError), (-1.0, ValueError), ("5", TypeError)]
)
def test_bad_timeout(timeout, error):
    with pytest.raises(error, match="timeout"):
        run_distributed(ok_worker, 2, timeout=timeout)
    with pytest.raises(error, match="timeout"):
        init_from_env(timeout=timeout)
