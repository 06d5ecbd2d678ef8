"""Group ids of any hashable type and per-group statistics, against plain loops."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import (
    _device,
    get_advantage_estimator,
    group_ids,
    group_stats,
    list_advantage_estimators,
)
from rlmath.advantages.groups import segment_ids, segment_reduce, to_samples

from .helpers import grouped_batch


def same_partition(ids: torch.Tensor, labels: list) -> bool:
    """ids[i] == ids[j] exactly when labels[i] == labels[j]."""
    n = len(labels)
    return all(
        (bool(ids[i] == ids[j])) == (labels[i] == labels[j]) for i in range(n) for j in range(n)
    )


LABELS = ["b", "a", "c", "a", "b", "b", "d"]


@pytest.mark.parametrize(
    "index",
    [
        LABELS,
        tuple(LABELS),
        np.array(LABELS),
        np.array(LABELS, dtype=object),
        [ord(x) for x in LABELS],
        np.array([ord(x) for x in LABELS], dtype=np.int32),
        torch.tensor([ord(x) for x in LABELS]),
        torch.tensor([float(ord(x)) for x in LABELS]),
        [("p", ord(x)) for x in LABELS],
        [torch.tensor(ord(x)) for x in LABELS],
    ],
    ids=[
        "list",
        "tuple",
        "np-str",
        "np-object",
        "ints",
        "np-int",
        "tensor",
        "float-tensor",
        "tuples",
        "0d-tensors",
    ],
)
def test_group_ids_any_hashable(index):
    ids = group_ids(index, len(LABELS))
    assert ids.dtype == torch.int64 and ids.shape == (len(LABELS),)
    assert same_partition(ids, LABELS)
    assert int(ids.min()) == 0 and int(ids.max()) == len(set(LABELS)) - 1


def test_group_ids_bad_input():
    with pytest.raises(ValueError, match="index"):
        group_ids([1, 2, 3], 4)
    with pytest.raises(ValueError, match="index"):
        group_ids(torch.zeros(2, 2), 4)
    with pytest.raises(TypeError, match="index"):
        group_ids([[1], [2]], 2)
    with pytest.raises(TypeError, match="index"):
        group_ids("abcd", 4)
    with pytest.raises(TypeError, match="index"):
        group_ids(7, 1)


def loop_stats(scores: list[float], labels: list):
    groups: dict = {}
    for s, g in zip(scores, labels):
        groups.setdefault(g, []).append(s)
    mean, std, count, flat = [], [], [], []
    for g in labels:
        xs = groups[g]
        m = math.fsum(xs) / len(xs)
        sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        mean.append(m)
        std.append(sd)
        count.append(len(xs))
        flat.append(all(x == xs[0] for x in xs))
    return mean, std, count, flat


def test_group_stats_against_loop():
    labels = ["x", "y", "x", "z", "y", "x", "w", "w", "v"]
    scores = torch.tensor([1.0, 2.0, 0.5, 3.0, 2.0, -1.0, 0.1, 0.1, 9.0], dtype=torch.float64)
    mean, std, count, zero_std = group_stats(scores, labels)
    e_mean, e_std, e_count, e_flat = loop_stats(scores.tolist(), labels)
    torch.testing.assert_close(mean, torch.tensor(e_mean, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(std, torch.tensor(e_std, dtype=torch.float64), rtol=0, atol=1e-15)
    assert count.tolist() == e_count and count.dtype == torch.int64
    assert zero_std.tolist() == e_flat and zero_std.dtype == torch.bool


def test_all_equal_group_is_exact():
    # 0.1 three times: sum/3 is not exactly 0.1 in floating point, the stats must be.
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7], dtype=torch.float32)
    stats = group_stats(scores, [0, 0, 0, 1])
    assert stats.mean[:3].tolist() == [scores[0].item()] * 3
    assert stats.std.tolist() == [0.0] * 4
    assert stats.zero_std.tolist() == [True] * 4


def test_multi_column_scores_and_dtypes():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(12, 3, generator=gen)
    labels = [i % 4 for i in range(12)]
    stats = group_stats(scores, labels)
    assert stats.mean.shape == (12, 3) and stats.mean.dtype == torch.float32
    for k in range(3):
        col = group_stats(scores[:, k].double(), labels)
        torch.testing.assert_close(stats.std[:, k].double(), col.std, rtol=1e-6, atol=1e-6)
    half = group_stats(scores[:, 0].bfloat16(), labels)
    assert half.mean.dtype == torch.float32


def test_nan_propagates_to_its_group_only():
    scores = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    stats = group_stats(scores, [0, 0, 1, 1])
    assert torch.isnan(stats.mean[:2]).all() and torch.isfinite(stats.mean[2:]).all()


@given(seed=st.integers(0, 10_000), n=st.integers(1, 30))
def test_permutation_equivariance(seed, n):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (n,), generator=gen).double()
    labels = torch.randint(0, 5, (n,), generator=gen)
    perm = torch.randperm(n, generator=gen)
    a = group_stats(scores, labels)
    b = group_stats(scores[perm], labels[perm])
    # Integer scores: group sums are exact in any order, so the means (one division),
    # counts and zero-std flags are identical. The std sums the same squared deviations
    # in another order: ≤ (n − 1)·u relative each (Higham §4.2, non-negative terms), so
    # with the division the variances differ by ≤ 2n·u relatively and the square roots
    # by half that plus a rounding each: (n + 2)·u.
    for name in ("mean", "count", "zero_std"):
        torch.testing.assert_close(getattr(a, name)[perm], getattr(b, name), rtol=0, atol=0)
    u = torch.finfo(torch.float64).eps / 2
    torch.testing.assert_close(a.std[perm], b.std, rtol=(n + 2) * u, atol=0)


def test_bad_scores():
    with pytest.raises(TypeError, match="scores"):
        group_stats(torch.ones(3, dtype=torch.long), [0, 0, 1])
    with pytest.raises(ValueError, match="scores"):
        group_stats(torch.ones(0), [])
    with pytest.raises(ValueError, match="index"):
        group_stats(torch.ones(3), [0, 1])


# ----------------------------------------------------------------------------- segment labels


def test_segment_ids_use_a_narrow_integer_index_as_it_is():
    # On a CPU, ids within B consecutive integers are already labels in [0, B).
    index = torch.tensor([3, 1, 3, 0, 2, 1])
    assert torch.equal(segment_ids(index, 6), index)
    shifted = torch.tensor([-7, -5, -7, -4], dtype=torch.int32)  # within 4 values from -7
    got = segment_ids(shifted, 4)
    assert got.dtype == torch.int64 and got.tolist() == [0, 2, 0, 3]
    assert shifted.tolist() == [-7, -5, -7, -4]  # the index itself is not shifted


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([10**12, 5, 10**12, -3]),  # wider than B: numbered densely
        torch.tensor([0.5, 1.5, 0.5, 2.5]),  # floating ids: numbered densely
        torch.tensor([True, False, True, True]),
        ["a", "b", "a", "c"],
    ],
    ids=["wide", "float", "bool", "strings"],
)
def test_segment_ids_fall_back_to_group_ids(index):
    assert torch.equal(segment_ids(index, 4), group_ids(index, 4))


def test_segment_ids_take_the_sort_where_host_reads_are_not_free(monkeypatch):
    monkeypatch.setattr(_device, "reads_host", lambda device: False)
    index = torch.tensor([3, 1, 3, 0, 2, 1])
    assert torch.equal(segment_ids(index, 6), group_ids(index, 6))


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 40),
    low=st.integers(-(2**40), 2**40),
    spread=st.integers(1, 80),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
)
def test_segment_ids_are_labels_in_range_with_the_index_partition(seed, n, low, spread, dtype):
    gen = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    low = max(info.min, min(low, info.max - spread))
    index = (low + torch.randint(0, spread, (n,), generator=gen)).to(dtype)
    ids = segment_ids(index, n)
    assert ids.dtype == torch.int64 and ids.shape == (n,)
    assert 0 <= int(ids.min()) and int(ids.max()) < n
    assert same_partition(ids, index.tolist())


GROUPED = [
    name
    for name in list_advantage_estimators()
    if "index" in inspect.signature(get_advantage_estimator(name)).parameters
    and "optimal_token_baseline" not in name
]


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("labels", ["narrow", "shifted"])
def test_estimators_are_bitwise_equal_with_and_without_the_sort(name, labels, monkeypatch):
    """The index used as labels (CPU) and the dense ids of the sort give the same bits."""
    rewards, mask, index = grouped_batch(4)
    dense = group_ids(index, index.numel())  # 0 … G−1: within B values
    index = dense if labels == "narrow" else dense - 1000
    fn = get_advantage_estimator(name)
    extra = {}
    if name == "gigpo":  # agent steps: two trajectories per group, shifted labels as well
        traj = index * 2 + torch.arange(index.numel()) % 2
        extra = {"traj_index": traj, "step_index": traj.flip(0), "anchor_state": traj % 3}
    fast = fn(rewards.float(), mask, index, **extra)
    monkeypatch.setattr(_device, "reads_host", lambda device: False)
    sorted_ = fn(rewards.float(), mask, index, **extra)
    for a, b in zip(fast, sorted_, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_segment_ids_reject_bad_input_as_group_ids_does():
    for bad, err in (
        (torch.arange(3), ValueError),  # wrong length (fast-path dtype)
        (torch.zeros(2, 2, dtype=torch.long), ValueError),  # not 1-D
        ("abcd", TypeError),
        (7, TypeError),
    ):
        with pytest.raises(err, match="index"):
            segment_ids(bad, 4)


# ----------------------------------------------------------------------------- segment reductions


def loop_segment(x: torch.Tensor, ids: torch.Tensor, reduce: str) -> dict[int, torch.Tensor]:
    """Per-group max/min in float64 by a Python loop over the samples (NaN propagates)."""
    out: dict[int, torch.Tensor] = {}
    for i, g in enumerate(ids.tolist()):
        v = x[i].double()
        if g not in out:
            out[g] = v.clone()
        else:
            pick = torch.maximum if reduce == "amax" else torch.minimum  # both propagate NaN
            out[g] = pick(out[g], v)
    return out


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 30),
    groups=st.integers(1, 8),
    cols=st.sampled_from([0, 3]),
)
def test_segment_reduce_against_a_loop(reduce, seed, n, groups, cols):
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if cols == 0 else (n, cols)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    pick = torch.randint(0, 12, shape, generator=gen)
    x[pick == 0], x[pick == 1], x[pick == 2] = float("nan"), float("inf"), float("-inf")
    ids = torch.randint(0, min(groups, n), (n,), generator=gen)  # labels in [0, B)
    got = segment_reduce(x, ids, reduce)
    want = loop_segment(x, ids, reduce)
    identity = -torch.inf if reduce == "amax" else torch.inf
    for g in range(n):  # absent groups hold the identity
        expect = want.get(g, torch.full(shape[1:], identity, dtype=torch.float64))
        torch.testing.assert_close(got[g], expect, rtol=0, atol=0, equal_nan=True)
    old = x.new_zeros(x.shape).scatter_reduce_(
        0, ids.view(-1, *([1] * (x.dim() - 1))).expand_as(x), x, reduce, include_self=False
    )
    present = torch.zeros(n, dtype=torch.bool).index_fill_(0, ids, True)
    torch.testing.assert_close(got[present], old[present], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(to_samples(got, ids).nan_to_num(), got[ids].nan_to_num())


def test_segment_reduce_bad_input():
    ids = torch.tensor([0, 1, 0])
    with pytest.raises(ValueError, match="amax"):
        segment_reduce(torch.ones(3), ids, "sum")
    with pytest.raises(TypeError, match="floating"):
        segment_reduce(torch.ones(3, dtype=torch.long), ids, "amax")
