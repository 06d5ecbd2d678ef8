"""A sampler's kept set over a vocabulary split between processes equals one process's.

Real collectives: gloo, 2 and 4 ranks (one spawn per size runs every case of
``sampling_workers.CASES``: every sampler, top-k / top-p / min-p alone and
together, per-row parameters and temperatures, ties, bf16 and fp64 logits, a
response function, and uneven shards placed by ``start``).

What must hold, and why:

- min-p and top-k thresholds are order statistics (a min and the k-th largest
  of the union of every shard's k largest): the same numbers as one process.
- top-p compares masses. The sharded search sums them exactly (float64 sums of
  one bucket's float32 weights, ``rlmath/engine/torch_backend/kept_shards.py``),
  one process sums in the compute dtype: the two kept sets can differ only in a
  row whose cut lies within rounding of ``p · S``. A row is *near* when the
  float64 reference keeps a different set at ``p · (1 ± 2⁻¹⁶)``, far above
  float32's rounding of those sums (``V u ≈ 6e-5`` relative at most, here much
  less); near rows are left out of the comparison, and must be rare.
- With the kept set the same, shards on the 128-column tile grid give bitwise
  one process's log-probs, entropy and gradients (the engine adds every tile's
  sums in the same tree, :mod:`rlmath.engine.tree`); uneven shards placed by
  ``start`` are combined by a log-sum-exp of per-shard sums: float32 rounding,
  ``2⁵ u (|value| + log V)`` per value.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlmath.distributed import run_distributed
from tests.logprobs.sampling_reference import kept_row

from .sampling_workers import (
    BY_NAME,
    CASES,
    SamplingCase,
    build,
    call,
    loss_of,
    sampling_worker,
    shard_bounds,
)

pytestmark = pytest.mark.integration

WORLDS = [2, 4]
U32 = 2.0**-24


@pytest.fixture(scope="module")
def results():
    names = [c.name for c in CASES]
    return {w: run_distributed(sampling_worker, w, names) for w in WORLDS}


def _param(value, i: int):
    if isinstance(value, torch.Tensor):
        v = value[i].item()
        return int(v) if value.dtype == torch.int64 else float(v)
    return value


def near_rows(case: SamplingCase, problem: dict) -> torch.Tensor:
    """Rows whose top-p cut moves when ``p`` moves by a relative ``2⁻¹⁶`` (fp64 reference)."""
    kw = problem["kwargs"]
    M = problem["logits"].shape[0]
    near = torch.zeros(M, dtype=torch.bool)
    if "top_p" not in kw:
        return near
    T = problem["temperature"]
    z = problem["logits"].double() / (
        T.double().unsqueeze(-1) if isinstance(T, torch.Tensor) else T
    )
    for i in range(M):
        row = z[i].tolist()
        k, p, mp = (_param(kw.get(n), i) for n in ("top_k", "top_p", "min_p"))
        sets = {
            frozenset(kept_row(row, case.sampler, k, min(q, 1.0), mp))
            for q in (p * (1 - 2**-16), p * (1 + 2**-16))
        }
        near[i] = len(sets) > 1
    return near


def one_process(case: SamplingCase, problem: dict):
    full = problem["logits"].clone().requires_grad_(True)
    out = call(case, full, problem, None)
    loss_of(out).backward()
    return out, full.grad


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_sharded_kept_set_equals_one_process(results, world, name):
    case = BY_NAME[name]
    problem = build(case)
    want, want_grad = one_process(case, problem)
    near = near_rows(case, problem)
    assert int(near.sum()) <= max(1, near.numel() // 20), "too many rows at the cut: reseed"
    # The outputs of a response function are (B, R), not the logits' rows: its problem
    # must have no near row, and then every output is compared.
    assert not (case.response and near.any())
    rows = ~near
    out = rows if not case.response else torch.ones_like(want.kept_count, dtype=torch.bool)
    log_v = math.log(case.vocab)
    for rank in range(world):
        got = results[world][rank][name]
        assert torch.equal(got["kept_count"][out], want.kept_count[out])
        assert torch.equal(got["outside"][out], want.outside[out])
        start, stop = shard_bounds(case, world, rank)
        grads = (got["grad"][rows], want_grad[:, start:stop][rows])
        values = [(got["log_probs"][out], want.log_probs.detach()[out])]
        if want.entropy is not None:
            values.append((got["entropy"][out], want.entropy.detach()[out]))
        if not case.explicit:
            # On the tile grid: bitwise one process.
            for a, b in [*values, grads]:
                assert torch.equal(a, b)
            continue
        for a, b in values:
            assert torch.all((a - b).abs() <= 2**5 * U32 * (b.abs() + log_v))
        # A row's gradient is a combination of p_j and one-hots with the same rounding.
        assert torch.all((grads[0] - grads[1]).abs() <= 2**5 * U32 * (1 + log_v))


def test_every_rank_gets_the_same_kept_sets(results):
    for world in WORLDS:
        for name in BY_NAME:
            first = results[world][0][name]
            for rank in range(1, world):
                other = results[world][rank][name]
                assert torch.equal(other["kept_count"], first["kept_count"]), (world, name)
                assert torch.equal(other["outside"], first["outside"]), (world, name)


def test_the_kept_set_does_not_depend_on_the_number_of_shards(results):
    # Exact masses: the same kept set at 2 and 4 ranks, near rows included.
    for name in BY_NAME:
        a, b = results[2][0][name], results[4][0][name]
        assert torch.equal(a["kept_count"], b["kept_count"]), name
        assert torch.equal(a["outside"], b["outside"]), name


# ------------------------------------------------------------------ the fused head
#
# Each rank holds its rows of the head; the hidden states are the same everywhere. In
# fp64, the logits of a shard's columns are dot products of H terms, rounded as one
# process rounds them up to the matmul's blocking: the kept sets agree (no row near a cut
# here), the values within 1e-10, and the hidden-state gradient (summed over the ranks)
# and each rank's weight and bias gradients within 1e-9 of one process.


@pytest.fixture(scope="module")
def head_results():
    from .sampling_workers import HEAD_CASES, head_sampling_worker

    return {w: run_distributed(head_sampling_worker, w, list(HEAD_CASES)) for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["head_top_p", "head_all_three_sglang", "head_uneven"])
def test_sharded_fused_head_under_a_kept_set_equals_one_process(head_results, world, name):
    from rlmath.fused_head import log_probs_and_entropy_from_hidden

    from .sampling_workers import head_problem, head_shard

    pr = head_problem(name)
    leaves = [pr[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    want = log_probs_and_entropy_from_hidden(
        leaves[0], leaves[1], pr["labels"], bias=leaves[2], kept_stats=True, **pr["kwargs"]
    )
    loss_of(want).backward()
    for rank in range(world):
        got = head_results[world][rank][name]
        start, stop = head_shard(name, world, rank)
        assert torch.equal(got["kept_count"], want.kept_count)
        assert torch.equal(got["outside"], want.outside)
        torch.testing.assert_close(got["log_probs"], want.log_probs.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(got["entropy"], want.entropy.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(got["grad_hidden"], leaves[0].grad, rtol=0, atol=1e-9)
        torch.testing.assert_close(
            got["grad_weight"], leaves[1].grad[start:stop], rtol=0, atol=1e-9
        )
        torch.testing.assert_close(got["grad_bias"], leaves[2].grad[start:stop], rtol=0, atol=1e-9)


def test_packed_logits_without_a_row_give_zeros_on_every_rank():
    from .sampling_workers import dead_rows_worker

    for out in run_distributed(dead_rows_worker, 2):
        assert torch.equal(out.log_probs, torch.zeros(2, 3))
        assert not out.outside.any() and torch.equal(out.kept_count, torch.zeros(2, 3).long())
