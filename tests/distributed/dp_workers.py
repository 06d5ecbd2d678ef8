"""Functions run inside spawned ranks by the distributed tests.

Each rank builds the same global batch from a seed, takes its own slice (rank 1
gets an empty mask), and returns what it computed so the test process can
compare with the single-process functions on the whole batch.
"""

import torch
import torch.distributed as dist

import rlmath
from rlmath import distributed as rd


def global_batch(seed: int, rows: int = 12, cols: int = 7):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g, dtype=torch.float64) * 2 + 0.5
    mask = torch.rand(rows, cols, generator=g) < 0.6
    return values, mask


def row_slices(rows: int, world: int):
    """Uneven contiguous slices; rank 1 (if any) gets rows whose mask is emptied."""
    bounds = torch.linspace(0, rows, world + 1).round().long().tolist()
    return [slice(bounds[r], bounds[r + 1]) for r in range(world)]


def dp_stats_worker(seed: int, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    r, world = dist.get_rank(), dist.get_world_size()
    values, mask = global_batch(seed)
    if world > 1:
        mask[row_slices(values.shape[0], world)[1]] = False  # a rank with no valid token
    sl = row_slices(values.shape[0], world)[r]
    local_v = values[sl].to(dtype).clone().requires_grad_()
    local_m = mask[sl]
    out = {
        "sum": rlmath.masked_sum(local_v, local_m, group=dist.group.WORLD),
        "mean": rlmath.masked_mean(local_v, local_m, group=dist.group.WORLD),
        "var": rlmath.masked_var(local_v, local_m, group=dist.group.WORLD),
        "var_biased": rlmath.masked_var(local_v, local_m, unbiased=False, group=dist.group.WORLD),
        "whiten": rlmath.masked_whiten(local_v, local_m, group=dist.group.WORLD),
        "whiten_noshift": rlmath.masked_whiten(
            local_v, local_m, shift_mean=False, group=dist.group.WORLD
        ),
        "mmms": rd.distributed_mean_max_min_std(local_v, mask=local_m, group=dist.group.WORLD),
    }
    # Each rank backpropagates its share of a total loss that mixes global
    # statistics (counted once overall) with its local whitened values.
    coef = torch.arange(values.numel(), dtype=torch.float64).reshape(values.shape)[sl].cos()
    loss = (out["mean"] * 3 + out["var"] - out["sum"] * 0.25) / world
    loss = loss + (coef * out["whiten"]).sum() + (coef.sin() * out["whiten_noshift"]).sum()
    loss.backward()
    empty = torch.zeros_like(local_m)
    out["empty_mean"] = rlmath.masked_mean(local_v, empty, group=dist.group.WORLD)
    out["empty_var"] = rlmath.masked_var(local_v, empty, group=dist.group.WORLD)
    out["empty_whiten"] = rlmath.masked_whiten(local_v, empty, group=dist.group.WORLD)
    out = {k: _detach(v) for k, v in out.items()}
    out["grad"] = local_v.grad.detach()
    out["slice"] = (sl.start, sl.stop)
    out["mask"] = mask
    return out


def _detach(v):
    if isinstance(v, tuple):
        return tuple(x.detach() if x is not None else None for x in v)
    return v.detach()


def single_process_expected(seed: int, world: int, dtype_name: str):
    """The same quantities on the whole batch in one process (plain rlmath.masked)."""
    dtype = getattr(torch, dtype_name)
    values, mask = global_batch(seed)
    if world > 1:
        mask[row_slices(values.shape[0], world)[1]] = False
    v = values.to(dtype).clone().requires_grad_()
    exp = {
        "sum": rlmath.masked_sum(v, mask),
        "mean": rlmath.masked_mean(v, mask),
        "var": rlmath.masked_var(v, mask),
        "var_biased": rlmath.masked_var(v, mask, unbiased=False),
        "whiten": rlmath.masked_whiten(v, mask),
        "whiten_noshift": rlmath.masked_whiten(v, mask, shift_mean=False),
    }
    coef = torch.arange(values.numel(), dtype=torch.float64).reshape(values.shape).cos()
    loss = exp["mean"] * 3 + exp["var"] - exp["sum"] * 0.25
    loss = loss + (coef * exp["whiten"]).sum() + (coef.sin() * exp["whiten_noshift"]).sum()
    loss.backward()
    exp = {k: t.detach() for k, t in exp.items()}
    sel = v.detach()[mask]
    exp["mmms"] = (sel.mean(), sel.max(), sel.min(), sel.std())
    exp["grad"] = v.grad
    return exp


def mixed_dtype_worker(dtypes: list[str]):
    """Rank r passes values of ``dtypes[r]``; returns, per function, what it raised or gave.

    After the refused calls a normal collective checks that the group still works.
    """
    r = dist.get_rank()
    dtype = getattr(torch, dtypes[r])
    g = torch.Generator().manual_seed(r)
    values = torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.ones(4, 3, dtype=torch.bool)
    calls = {
        "sum": lambda: rlmath.masked_sum(values, mask, group=dist.group.WORLD),
        "mean": lambda: rlmath.masked_mean(values, mask, group=dist.group.WORLD),
        "var": lambda: rlmath.masked_var(values, mask, group=dist.group.WORLD),
        "whiten": lambda: rlmath.masked_whiten(values, mask, group=dist.group.WORLD),
        "mmms": lambda: rd.distributed_mean_max_min_std(values, mask=mask, group=dist.group.WORLD),
    }
    out = {}
    for name, call in calls.items():
        try:
            res = call()
        except ValueError as err:
            out[name] = ("ValueError", str(err))
        else:
            out[name] = ("ok", res[0] if isinstance(res, tuple) else res.detach())
    check = torch.ones(1)
    dist.all_reduce(check)
    out["after"] = check.item()
    return out


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")


def collective_count_worker():
    """How many collectives each statistic issues (forward and backward counted apart).

    Every torch.distributed collective the functions could call is wrapped
    with a counter; the mask is fractional so that the weighted mean and the
    valid-element std of ``distributed_mean_max_min_std`` are both exercised.
    """
    r = dist.get_rank()
    g = torch.Generator().manual_seed(10 + r)
    values = torch.randn(5, 4, generator=g, dtype=torch.float64)
    weights = torch.rand(5, 4, generator=g, dtype=torch.float64)
    weights[weights < 0.3] = 0
    counts = {"n": 0}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(fn):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)

        return wrapper

    def count(call):
        counts["n"] = 0
        result = call()
        return counts["n"], result

    for name, fn in originals.items():
        setattr(dist, name, counted(fn))
    try:
        leaf = values.clone().requires_grad_()
        out = {
            "masked_sum": count(lambda: rlmath.masked_sum(values, weights, group=dist.group.WORLD))[
                0
            ],
            "masked_mean": count(
                lambda: rlmath.masked_mean(values, weights, group=dist.group.WORLD)
            )[0],
            "masked_var": count(lambda: rlmath.masked_var(values, weights, group=dist.group.WORLD))[
                0
            ],
            "masked_whiten": count(
                lambda: rlmath.masked_whiten(leaf, weights, group=dist.group.WORLD)
            )[0],
        }
        n_mmms, mmms = count(
            lambda: rd.distributed_mean_max_min_std(values, mask=weights, group=dist.group.WORLD)
        )
        out["distributed_mean_max_min_std"] = n_mmms
        whitened = rlmath.masked_whiten(leaf, weights, group=dist.group.WORLD)
        out["masked_whiten_backward"] = count(lambda: whitened.sum().backward())[0]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    out["mmms"] = tuple(t.detach() for t in mmms)
    out["values"], out["weights"] = values, weights
    return out
