"""Outcome estimators given a tensor ``index`` never read it (or anything else) on the host.

Group ids come from a sort of the index on its device (no ``torch.unique``,
whose output size is data-dependent and syncs on CUDA). ``tests/host_sync.py``
makes every host read raise on CPU; on CUDA the calls also run under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import rlmath

from ..host_sync import forbid_host_reads
from .helpers import grouped_batch

GROUPED = [
    name
    for name in rlmath.list_advantage_estimators()
    if "index" in inspect.signature(rlmath.get_advantage_estimator(name)).parameters
]


def _calls(device):
    rewards, mask, index = (t.to(device) for t in grouped_batch(3))
    g = torch.Generator(device="cpu").manual_seed(0)
    old_log_prob = (-torch.rand(rewards.shape, generator=g, dtype=torch.float64)).to(device)
    sum_pi_squared = torch.rand(rewards.shape, generator=g, dtype=torch.float64).to(device)
    float_index = index.double() / 10  # float ids take the same path
    for name in GROUPED:
        fn = rlmath.get_advantage_estimator(name)
        if "optimal_token_baseline" in name:
            yield name, lambda fn=fn: fn(rewards, mask, index, old_log_prob, sum_pi_squared)
        elif name == "gigpo":
            # Agent steps: the rows of a group alternate between two trajectories.
            traj = index * 2 + torch.arange(index.numel(), device=device) % 2
            step = torch.arange(index.numel(), device=device).flip(0)
            yield name, lambda fn=fn, t=traj, s=step: fn(rewards, mask, index, t, s, s % 3)
        else:
            yield name, lambda fn=fn: fn(rewards, mask, index)
            yield f"{name} (float ids)", lambda fn=fn: fn(rewards, mask, float_index)
    yield "group_stats", lambda: rlmath.group_stats(rewards.sum(-1), index)
    yield "group_ids", lambda: rlmath.group_ids(index, index.numel())


def test_group_ids_from_a_sort_equal_unique():
    _, _, index = grouped_batch(5)
    for idx in (index, index.double() * -0.5, index % 3 == 0, index.int()):
        with forbid_host_reads():
            ids = rlmath.group_ids(idx, idx.numel())
        want = torch.unique(idx, return_inverse=True)[1]
        # Same partition: equal ids exactly where the index values are equal.
        assert torch.equal(ids[:, None] == ids[None, :], want[:, None] == want[None, :])
        assert ids.dtype == torch.int64
        assert ids.min() == 0 and ids.max() == want.max()  # dense ids 0 … G−1


CALLS = list(_calls("cpu"))


@pytest.mark.parametrize(("name", "call"), CALLS, ids=[c[0] for c in CALLS])
def test_no_host_reads_with_a_tensor_index(name, call):
    want = call()
    with forbid_host_reads():
        got = call()
    got, want = _tensors(got), _tensors(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def _tensors(out):
    return [out] if isinstance(out, torch.Tensor) else list(out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_on_cuda():
    calls = list(_calls("cuda"))
    for _, call in calls:  # warm-up: first-time allocations are not what is checked
        call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _, call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
