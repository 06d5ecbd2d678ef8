"""Group ids of any hashable type and per-group statistics, against plain loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import group_ids, group_stats


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
