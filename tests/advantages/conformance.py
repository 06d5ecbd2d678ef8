"""The conformance checks every registered advantage estimator must pass.

An estimator is called by parameter name: :data:`INPUTS` builds each input an
estimator can ask for (``token_level_rewards``, ``index``, ``values``, …) from
one shared batch, so a new estimator whose parameters are all known here is
tested with no edit at all, and one with a new required input fails
``test_every_registered_estimator_has_inputs`` until a builder is added.

Each ``check_*`` function raises ``AssertionError`` on a violation; the test
module runs them for every name in the registry and, once, on deliberately
broken estimators to show that each check can fail.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tests.advantages.helpers import U64, grouped_batch

#: Unit roundoff of fp32, the compute dtype of every estimator for low-precision inputs.
U32 = torch.finfo(torch.float32).eps / 2

#: Junk written under the mask: none of it may reach an output.
JUNK = (float("nan"), float("inf"), float("-inf"), 1e30)


@dataclass(frozen=True)
class Batch:
    """The shared batch: shuffled groups of sizes 1–5 (an all-equal one), two empty rows."""

    rewards: torch.Tensor  # (B, T) fp64, every value exact in bf16
    mask: torch.Tensor  # (B, T) bool
    index: torch.Tensor  # (B,) int64 group ids, not contiguous


def make_batch(seed: int = 0, *, dense: bool = True) -> Batch:
    """The shared batch; ``dense=False`` keeps only an integer outcome reward per row.

    Without the small dense rewards every group's score spread is 0 or at
    least 0.4, which keeps the rounding bound of :func:`reorder_atol` tight
    enough for the dtype check to tell fp32 math from half-precision math.
    """
    rewards, mask, index = grouped_batch(seed)
    if not dense:
        t = rewards.shape[1]
        last = (torch.arange(t) * mask).argmax(-1)
        score = torch.where(mask, rewards, 0).sum(-1).round()
        rewards = torch.zeros_like(rewards)
        rewards[torch.arange(len(index)), last] = torch.where(mask.any(-1), score, 0)
    return Batch(_bf16_exact(rewards), mask, index)


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """Round through bf16 so that every dtype of the dtype check sees the same numbers."""
    return x.to(torch.bfloat16).to(torch.float64)


def _row_uniform(batch: Batch, salt: float, shape_t: bool = True) -> torch.Tensor:
    """Values in (0, 1) derived from each row's content, so they follow shuffles and splits."""
    b, t = batch.rewards.shape
    score = torch.where(batch.mask, batch.rewards, 0).sum(-1, keepdim=True)
    cols = torch.arange(t, dtype=torch.float64) if shape_t else torch.zeros(1, dtype=torch.float64)
    return 0.5 + 0.45 * torch.sin(score * 2.1 + cols * 0.7 + salt)


def _log_probs(batch: Batch) -> torch.Tensor:
    return _bf16_exact(torch.log(_row_uniform(batch, 0.3)))


def _sum_pi_squared(batch: Batch) -> torch.Tensor:
    # Σ_v π_v² lies in [π_j², 1]: π_j² plus a share of the remaining mass squared.
    p = _row_uniform(batch, 0.3)
    return _bf16_exact(p * p + (1 - p) ** 2 * _row_uniform(batch, 1.9))


def _position_in_group(batch: Batch) -> torch.Tensor:
    """Each row's rank among the rows of its group, in batch order."""
    seen: dict[int, int] = {}
    ranks = []
    for g in batch.index.tolist():
        ranks.append(seen.get(g, 0))
        seen[g] = ranks[-1] + 1
    return torch.tensor(ranks, dtype=torch.int64)


def _trajectories(batch: Batch) -> torch.Tensor:
    """Agent steps: the rows of a group alternate between two trajectories of that group."""
    return batch.index * 2 + _position_in_group(batch) % 2


def _steps(batch: Batch) -> torch.Tensor:
    """Step numbers within each trajectory, in decreasing batch order (not the rows' order)."""
    return 10 - _position_in_group(batch) // 2


#: parameter name → builder of that input from the batch. Optional inputs that
#: change the computation (importance weights, reward components) are built
#: too, so that the checks cover them; scalars use non-default values.
INPUTS: dict[str, Callable[[Batch], Any]] = {
    "token_level_rewards": lambda b: b.rewards,
    "response_mask": lambda b: b.mask,
    "index": lambda b: b.index,
    "values": lambda b: _bf16_exact(2 * _row_uniform(b, 1.1) - 1),
    "gamma": lambda b: 0.9,
    "lam": lambda b: 0.95,
    "reward_baselines": lambda b: _bf16_exact(_row_uniform(b, 2.7, shape_t=False)[:, 0]),
    "old_log_prob": _log_probs,
    "sum_pi_squared": _sum_pi_squared,
    "rollout_is_weights": lambda b: _bf16_exact(0.5 + 1.5 * _row_uniform(b, 0.8)),
    "traj_index": _trajectories,
    "step_index": _steps,
    # Steps at the same depth of the two trajectories of a group share a state.
    "anchor_state": lambda b: _steps(b) % 2,
    "reward_components": lambda b: _bf16_exact(
        torch.cat([_row_uniform(b, s, shape_t=False) for s in (0.2, 1.4, 2.6)], dim=1)
    ),
}

#: Parameters the checks set themselves or leave at their defaults.
HANDLED_ELSEWHERE = {"group"}

#: ``(B, T)`` floating inputs: junk goes under their mask and the dtype check casts them.
TOKEN_INPUTS = {
    "token_level_rewards",
    "values",
    "old_log_prob",
    "sum_pi_squared",
    "rollout_is_weights",
}


def missing_inputs(fn: Callable[..., Any]) -> list[str]:
    """Required parameters of ``fn`` that no builder in :data:`INPUTS` provides."""
    params = inspect.signature(fn).parameters.values()
    return [
        p.name
        for p in params
        if p.default is p.empty and p.name not in INPUTS and p.name not in HANDLED_ELSEWHERE
    ]


def build_inputs(fn: Callable[..., Any], batch: Batch) -> dict[str, Any]:
    """Keyword arguments for ``fn``: every parameter with a builder."""
    names = inspect.signature(fn).parameters
    return {name: build(batch) for name, build in INPUTS.items() if name in names}


def takes(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


def call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    out = fn(**kwargs)
    assert isinstance(out, tuple) and len(out) == 2, "an estimator returns (advantages, returns)"
    return out


def rows(kwargs: dict[str, Any], selected: torch.Tensor) -> dict[str, Any]:
    """The inputs of the samples ``selected`` (a bool or index tensor over the batch)."""
    return {k: v[selected] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


#: Inputs that scores, returns and baselines are made of (the quantities estimators
#: centre and scale); log-probabilities and weights only weigh them.
SCORE_INPUTS = ("token_level_rewards", "values", "reward_baselines", "reward_components")


def reorder_atol(kwargs: dict[str, Any], u: float) -> float:
    """Bound on the change of an output when its sums are evaluated differently.

    Reordering (a shuffle, a split over ranks) or rounding every operation to
    unit roundoff ``u`` moves a sum of N terms by at most (N − 1)·u·Σ|terms|
    (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2); a
    weighted mean is as accurate relative to the values it averages. The
    estimators centre by such sums (group, step or batch sums of at most
    N = B·T terms, each a product of a few rounded factors) and divide by a
    standard deviation (+ε) of at least d, the two-stage ones twice; with M
    the largest row sum of |score inputs| (a bound on every score, return and
    baseline), an output moves by at most 4·N·u·(1 + M/d)².
    """
    mask = kwargs["response_mask"]
    big = torch.zeros(mask.shape[0], dtype=torch.float64)
    for k in SCORE_INPUTS:
        if k not in kwargs or kwargs[k] is None:
            continue
        x = kwargs[k].double().abs()
        big += (
            torch.where(mask, x, 0).sum(-1)
            if x.shape == mask.shape
            else x.reshape(len(big), -1).sum(-1)
        )
    scores = torch.where(mask, kwargs["token_level_rewards"].double(), 0).sum(-1)
    spreads = [1.0, float(scores.std())]
    if "index" in kwargs:
        index = kwargs["index"]
        spreads += [
            float(scores[index == g].std()) for g in index.unique() if (index == g).sum() > 1
        ]
    d = min(x for x in spreads if x > 0)
    return 4 * mask.numel() * u * (1 + float(big.max()) / d) ** 2


# --------------------------------------------------------------------------- checks


#: Oracle parameter names that differ from the estimators' (verl's) names.
ORACLE_ALIASES = {"rewards": "token_level_rewards", "mask": "response_mask"}


def check_oracle(fn: Callable[..., Any], oracle: Callable[..., Any], batch: Batch) -> None:
    """The estimator equals its fp64 loop oracle on the shared batch (ids as a Python list)."""
    kwargs = build_inputs(fn, batch)
    args = {}
    for name in inspect.signature(oracle).parameters:
        source = ORACLE_ALIASES.get(name, name)
        if source in kwargs:
            args[name] = kwargs[source]
    if "index" in args:
        args["index"] = args["index"].tolist()
    atol = reorder_atol(kwargs, U64)
    for got, want in zip(call(fn, kwargs), oracle(**args)):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=atol)


def check_contract(fn: Callable[..., Any], batch: Batch) -> None:
    """(B, T) outputs of fp64 for fp64 inputs, finite, exactly 0 where masked; inputs untouched."""
    kwargs = build_inputs(fn, batch)
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    for out in call(fn, kwargs):
        assert out.shape == batch.rewards.shape, out.shape
        assert out.dtype == torch.float64, out.dtype
        assert torch.isfinite(out).all(), "non-finite output on a finite batch"
        assert torch.all(out[~batch.mask] == 0), "masked output is not 0"
    for k, v in before.items():
        assert torch.equal(kwargs[k], v), f"{k} was modified"


def check_masked_junk(fn: Callable[..., Any], batch: Batch) -> None:
    """NaN, ±inf or 1e30 under the mask of every token input change no output bit."""
    kwargs = build_inputs(fn, batch)
    clean = call(fn, kwargs)
    for junk in JUNK:
        dirty = dict(kwargs)
        for k in TOKEN_INPUTS & kwargs.keys():
            dirty[k] = torch.where(batch.mask, kwargs[k], junk)
        for c, d in zip(clean, call(fn, dirty)):
            assert torch.equal(c, d), f"junk {junk} under the mask changed an output"


def check_dtypes(fn: Callable[..., Any], batch: Batch) -> None:
    """fp32/bf16/fp16 inputs give fp32 outputs within fp32 rounding of the fp64 math.

    The reference is the fp64 call on the same (cast) inputs, so that the
    comparison measures the computation, not the rounding of the inputs; the
    batch is the well-conditioned one (``make_batch(dense=False)``).
    """
    batch = make_batch(dense=False)
    kwargs = build_inputs(fn, batch)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        low = {
            k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in kwargs.items()
        }
        wide = {
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in low.items()
        }
        atol = reorder_atol(wide, U32)
        for got, want in zip(call(fn, low), call(fn, wide)):
            assert got.dtype == torch.float32, (dtype, got.dtype)
            torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)


def _with_index(kwargs: dict[str, Any], index: Any) -> dict[str, Any]:
    return {**kwargs, "index": index}


def check_degenerate_groups(fn: Callable[..., Any], batch: Batch) -> None:
    """All singletons, all groups flat, one sample: finite outputs, 0 where masked.

    Singletons and all-equal groups have no spread (std 0); an estimator must
    not divide by it. Estimators without groups see the same batches.
    """
    kwargs = build_inputs(fn, batch)
    b, t = batch.rewards.shape
    cases = {"one sample": rows(kwargs, torch.tensor([int(batch.mask.any(-1).nonzero()[0, 0])]))}
    if "index" in kwargs:
        cases["all singletons"] = _with_index(kwargs, torch.arange(b) * 3 + 1)
        # Every row scores 1.5 on its last valid token: each group is all-equal.
        last = (torch.arange(t) * batch.mask).argmax(-1)
        flat = torch.zeros_like(batch.rewards)
        flat[torch.arange(b), last] = 1.5
        cases["all groups flat"] = {
            **kwargs,
            "token_level_rewards": torch.where(batch.mask, flat, 0),
        }
    for label, case in cases.items():
        mask = case["response_mask"]
        for out in call(fn, case):
            assert torch.isfinite(out).all(), f"{label}: non-finite output"
            assert torch.all(out[~mask] == 0), f"{label}: masked output is not 0"


def check_empty_batch(fn: Callable[..., Any], batch: Batch) -> None:
    """``B = 0`` (a data-parallel rank left without samples) and ``T = 0`` give empty results.

    Each output has the rewards' ``(B, T)`` shape and the estimator's result
    dtype; nothing raises.
    """
    full = build_inputs(fn, batch)
    expected = call(fn, full)
    for selected in (torch.arange(0), None):
        if selected is not None:
            kwargs = rows(full, selected)
        else:
            token_shape = batch.rewards.shape
            kwargs = {
                k: v[:, :0] if isinstance(v, torch.Tensor) and v.shape == token_shape else v
                for k, v in full.items()
            }
        shape = (
            tuple(kwargs["token_level_rewards"].shape) if "token_level_rewards" in kwargs else None
        )
        for out, ref in zip(call(fn, kwargs), expected, strict=True):
            assert out.numel() == 0, f"{tuple(out.shape)} from an empty batch"
            assert out.dtype == ref.dtype
            if shape is not None:
                assert tuple(out.shape) == shape, (tuple(out.shape), shape)


def relabelled_indices(index: torch.Tensor) -> dict[str, Any]:
    """The same grouping under other ids: gaps, negatives, int32, strings, numpy objects."""
    ids = index.unique()
    big = {int(g): (-1) ** i * (10**12 + 7919 * i) for i, g in enumerate(ids.tolist())}
    relabel = torch.tensor([big[int(g)] for g in index.tolist()], dtype=torch.int64)
    strings = [f"uid-{int(g) * 37 % 101:03d}" for g in index.tolist()]
    return {
        "sparse int64": relabel,
        "int32": (index * 1000 - 5).to(torch.int32),
        "list of str": strings,
        "numpy object": np.array(strings, dtype=object),
        "numpy int": index.numpy() + 2**40,
    }


def check_group_ids(fn: Callable[..., Any], batch: Batch) -> None:
    """Only the grouping matters, not the ids' values, order, type or container."""
    kwargs = build_inputs(fn, batch)
    if "index" not in kwargs:
        return
    base = call(fn, kwargs)
    for label, index in relabelled_indices(batch.index).items():
        for b, o in zip(base, call(fn, _with_index(kwargs, index))):
            assert torch.equal(b, o), f"relabelling the groups ({label}) changed an output"


def check_row_order(fn: Callable[..., Any], batch: Batch) -> None:
    """Permuting the samples permutes the outputs: groups need not be contiguous rows."""
    kwargs = build_inputs(fn, batch)
    base = call(fn, kwargs)
    atol = reorder_atol(kwargs, U64)
    for seed in (0, 1):
        perm = torch.randperm(batch.index.numel(), generator=torch.Generator().manual_seed(seed))
        for b, o in zip(base, call(fn, rows(kwargs, perm))):
            torch.testing.assert_close(o, b[perm], rtol=0, atol=atol)


#: How :func:`dp_split` shares the batch out: whole groups to each rank, or
#: every row to rank 0 and none to rank 1 (a rank left without samples).
DP_SPLITS = ("halves", "one_rank_empty")


def dp_split(batch: Batch, split: str = "halves") -> list[torch.Tensor]:
    """Two ranks' row indices: whole groups per rank, rows in batch order.

    ``"halves"``: rank 0 takes about half of the groups, rank 1 the rest; each
    holds a singleton and one of the two empty rows of the batch.
    ``"one_rank_empty"``: rank 0 takes every row, rank 1 a ``(0, T)`` batch.
    """
    if split == "one_rank_empty":
        every = torch.arange(len(batch.index))
        return [every, every[:0]]
    ids = batch.index.unique()
    first = torch.isin(batch.index, ids[::2])
    return [torch.nonzero(first)[:, 0], torch.nonzero(~first)[:, 0]]


def dp_call(
    fn: Callable[..., Any], batch: Batch, rank: int, group: Any, split: str = "halves"
) -> tuple[torch.Tensor, ...]:
    """What ``rank`` computes on its share; ``group`` is passed if ``fn`` takes one."""
    kwargs = rows(build_inputs(fn, batch), dp_split(batch, split)[rank])
    if takes(fn, "group"):
        kwargs["group"] = group
    return call(fn, kwargs)


def check_dp_invariance(
    fn: Callable[..., Any], batch: Batch, per_rank: list[tuple], split: str = "halves"
) -> None:
    """The ranks' outputs, put back in batch order, equal the single-process ones.

    Batch-wide statistics (whitening, GPG's α) must be computed over the
    ranks: an estimator with such statistics takes a ``group``.
    """
    kwargs = build_inputs(fn, batch)
    whole = call(fn, kwargs)
    atol = reorder_atol(kwargs, U64)
    for rank, part in enumerate(dp_split(batch, split)):
        for w, p in zip(whole, per_rank[rank]):
            torch.testing.assert_close(p, w[part], rtol=0, atol=atol)
