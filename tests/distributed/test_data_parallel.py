"""Data-parallel statistics equal the single-process ones on the concatenated batch.

Real collectives: gloo, 2 and 4 processes on this machine.
"""

import pytest
import torch

import rlmath
from rlmath import distributed as rd
from rlmath.distributed import run_distributed

from .dp_workers import (
    collective_count_worker,
    dp_stats_worker,
    mixed_dtype_worker,
    single_process_expected,
)

TOL = {"float64": 1e-10, "float32": 1e-5}


@pytest.mark.integration
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_dp_stats_equal_single_process(world, dtype_name):
    seed = 17 + world
    results = run_distributed(dp_stats_worker, world, seed, dtype_name)
    exp = single_process_expected(seed, world, dtype_name)
    tol = TOL[dtype_name]
    grad = torch.zeros_like(exp["grad"])
    for res in results:
        for key in ("sum", "mean", "var", "var_biased"):
            torch.testing.assert_close(res[key], exp[key], rtol=tol, atol=tol)
        for got, want in zip(res["mmms"], exp["mmms"]):
            torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol)
        sl = slice(*res["slice"])
        for key in ("whiten", "whiten_noshift"):
            torch.testing.assert_close(res[key], exp[key][sl], rtol=tol, atol=tol)
        for key in ("empty_mean", "empty_var"):
            assert res[key].item() == 0.0
        assert (res["empty_whiten"] == 0).all()
        grad[sl] = res["grad"]
    # Each rank's backward gives its slice of the full-batch gradient.
    torch.testing.assert_close(grad, exp["grad"], rtol=tol, atol=tol)


def test_single_process_fallback_without_init():
    values = torch.randn(5, 3, dtype=torch.float64)
    mask = torch.rand(5, 3) < 0.5
    mask[0, 0] = True
    import torch.distributed as dist

    import rlmath

    # Without torch.distributed the world group is None: the statistics are this
    # process's, as with group=None.
    world = dist.group.WORLD
    for fn in (rlmath.masked_mean, rlmath.masked_var, rlmath.masked_whiten):
        torch.testing.assert_close(fn(values, mask, group=world), fn(values, mask))
    mean, vmax, vmin, std = rd.distributed_mean_max_min_std(values, mask=mask)
    sel = values[mask]
    torch.testing.assert_close(
        torch.stack([mean, vmax, vmin]), torch.stack([sel.mean(), sel.max(), sel.min()])
    )
    if sel.numel() > 1:
        torch.testing.assert_close(std, sel.std())
    none_max = rd.distributed_mean_max_min_std(values, compute_max=False, compute_std=False)
    assert none_max[1] is None and none_max[3] is None


def test_bad_input():
    with pytest.raises(ValueError, match="mask must have the shape of values"):
        rlmath.masked_mean(torch.zeros(3), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(dp_stats_worker, 0, 1, "float64")
    with pytest.raises(TypeError, match="local_tensor"):
        rd.distributed_mean_max_min_std([1.0])


def test_complex_values_are_rejected():
    v = torch.randn(3, 4, dtype=torch.complex64)
    m = torch.ones(3, 4, dtype=torch.bool)
    for fn in (rlmath.masked_sum, rlmath.masked_mean, rlmath.masked_var, rlmath.masked_whiten):
        with pytest.raises(TypeError, match="values must be a real"):
            fn(v, m)
    with pytest.raises(TypeError, match="local_tensor must be a real"):
        rd.distributed_mean_max_min_std(v, mask=m)


@pytest.mark.integration
def test_different_dtypes_on_different_ranks_raise_on_every_rank():
    """fp64 on one rank and fp32 on another used to kill gloo with SIGABRT."""
    results = run_distributed(mixed_dtype_worker, 2, ["float64", "float32"])
    for rank, res in enumerate(results):
        for name in ("sum", "mean", "var", "whiten", "mmms"):
            kind, message = res[name]
            assert kind == "ValueError", (rank, name)
            arg = "local_tensor" if name == "mmms" else "values"
            assert f"{arg} must give the same statistics dtype on every rank" in message
            assert ("torch.float64" if rank == 0 else "torch.float32") in message
        assert res["after"] == 2.0  # the group is still usable


@pytest.mark.integration
def test_dtypes_with_the_same_statistics_dtype_work():
    """bf16 and fp32 values both give fp32 statistics: nothing to refuse."""
    results = run_distributed(mixed_dtype_worker, 2, ["bfloat16", "float32"])
    means = [res["mean"] for res in results]
    assert all(kind == "ok" for kind, _ in means)
    torch.testing.assert_close(means[0][1], means[1][1], rtol=0, atol=0)


@pytest.mark.integration
def test_each_statistic_issues_the_fewest_collectives():
    """The moments are computed once: 2 all-reduces for a sum or mean, 3 for a
    variance, a whitening or the logging statistics (whose max and min travel
    with the dtype check); backward of a whitening adds one sum per forward sum
    that carries a gradient (the mean's and the squared deviations')."""
    results = run_distributed(collective_count_worker, 2)
    for out in results:
        assert out["masked_sum"] == 2
        assert out["masked_mean"] == 2
        assert out["masked_var"] == 3
        assert out["masked_whiten"] == 3
        assert out["distributed_mean_max_min_std"] == 3
        assert out["masked_whiten_backward"] == 2
    values = torch.cat([out["values"] for out in results])
    weights = torch.cat([out["weights"] for out in results])
    valid = values[weights != 0]
    expected = (
        (values * weights).sum() / weights.sum(),
        valid.max(),
        valid.min(),
        valid.std(),
    )
    for out in results:
        for got, want in zip(out["mmms"], expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
