"""run_distributed's timeout: a hung rank fails the call and leaves no process behind.

Nothing here measures time: the tests check which error is raised and that
every worker process is gone afterwards.
"""

import datetime
import os

import pytest
import torch.multiprocessing as mp

from rlmath.distributed import init_from_env, run_distributed

from .launch_workers import missing_rank_worker, ok_worker, sleep_worker


def _pids(pid_dir):
    return [int((pid_dir / name).read_text()) for name in sorted(os.listdir(pid_dir))]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_that_never_finish_time_out_and_are_terminated(tmp_path):
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) \[0, 1\] of 2 still running after timeout=5 s"
    ):
        run_distributed(sleep_worker, 2, str(tmp_path), timeout=5)
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids)


def test_a_rank_missing_from_a_collective_fails_the_call(tmp_path):
    """The waiting rank hits the collective timeout or the call's own deadline, whichever first."""
    with pytest.raises((TimeoutError, mp.ProcessRaisedException)):
        run_distributed(missing_rank_worker, 2, str(tmp_path), timeout=5)
    pids = _pids(tmp_path)
    assert len(pids) == 2
    assert not any(_alive(p) for p in pids)


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
