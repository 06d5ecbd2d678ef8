"""The invariance contract: a row's log-prob, entropy, KL and Σπ² are bitwise the same, whatever the layout.

Bitwise (``torch.equal``), never ``allclose``: the batch the row is in, the
chunk size, the thread count, packed rows against the same rows padded, and
the tensor-parallel degree (1, 2, 4, 8 gloo ranks, each holding an aligned
run of 128-column tiles), for values and gradients, fp32 and bf16 logits.
The tree that makes the vocabulary split invisible is checked on its own for
any split (hypothesis).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmath import VocabParallel
from rlmath.distributed import run_distributed
from rlmath.engine import tree
from rlmath.engine.stats import STATS_TREE
from rlmath.engine.torch_backend import buffers, cpu_matmul, head_forward
from rlmath.engine.torch_backend.head_forward import tile_stats
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import (
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits_response_rmpad,
    sum_pi_squared_from_logits,
)

N, V = 37, 3072  # 3072 = 8 ranks × 3 tiles of 128


def _data(dtype: torch.dtype, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (N,), generator=g)
    labels[5] = -100
    temperature = torch.rand(N, generator=g, dtype=torch.float32) + 0.5
    return logits, labels, temperature


# ------------------------------------------------------------------ the tree alone


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 400),
    cut_seed=st.integers(0, 2**31 - 1),
    n_cuts=st.integers(0, 9),
    stats=st.booleans(),
)
def test_tree_from_any_split_of_the_tiles_equals_the_whole(total, cut_seed, n_cuts, stats):
    g = torch.Generator().manual_seed(cut_seed)
    op = STATS_TREE if stats else tree.ADD
    x = torch.randn(3, total, 2, generator=g).exp()
    if stats:  # (m, s, t) per tile, some tiles without mass (-inf, 0, 0)
        m = torch.randn(3, total, 1, generator=g) * 5
        t = -torch.rand(3, total, 1, generator=g) * x[..., :1]
        x = torch.cat([m, x[..., :1], t], -1)
        x[torch.rand(3, total, generator=g) < 0.2] = torch.tensor([float("-inf"), 0.0, 0.0])
    whole = tree.fold(x, op)
    perm = torch.randperm(max(total - 1, 1), generator=g)[: min(n_cuts, total - 1)] + 1
    bounds = [0, *sorted(perm.tolist()), total] if total > 1 else [0, total]
    nodes: dict[tuple[int, int], torch.Tensor] = {}
    for a, b in itertools.pairwise(bounds):
        plan = tree.node_plan(a, b - a, total)
        values = tree.local_nodes(x[:, a:b], a, total, op)
        assert len(plan) == len(values)
        for node, value in zip(plan, values, strict=True):
            assert node not in nodes  # every tile is handed on once
            nodes[node] = value
    assert torch.equal(tree.evaluate(nodes, total, op), whole)
    if stats:  # the merged (m, s, t) is that of every tile's mass at once (fp64)
        shift = (x[..., 0].double() - whole[:, None, 0].double()).exp()
        mass = torch.where(x[..., 0] == float("-inf"), 0.0, x[..., 1].double() * shift)
        # Per level: m - M rounded (|m - M|·u in the exponent), exp, product, sum (3u).
        depth = max(1, (total - 1).bit_length())
        live = x[..., 0] > float("-inf")
        spread = torch.where(live, whole[:, None, 0] - x[..., 0], 0).amax(1).double()
        bound = depth * (spread + 3) * 2.0**-24 * mass.sum(1)
        assert ((whole[:, 1].double() - mass.sum(1)).abs() <= bound).all()
        # The entropy term: e^{m - M}·(t + (m - M)·s) per tile, one rounding more per level.
        d = torch.where(live, x[..., 0].double() - whole[:, None, 0].double(), 0.0)
        terms = torch.where(live, shift * (x[..., 2].double() + d * x[..., 1].double()), 0.0)
        size = torch.where(live, shift * (x[..., 2].double().abs() + d.abs() * x[..., 1]), 0.0)
        bound_t = depth * (spread + 4) * 2.0**-24 * size.sum(1)
        assert ((whole[:, 2].double() - terms.sum(1)).abs() <= bound_t).all()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 250, 1187])
def test_tree_sum_is_within_the_pairwise_bound_of_the_exact_sum(n):
    # Pairwise summation of depth d = ceil(log2 n): |error| <= d·u·Σ|x| (u = 2^-24 in fp32),
    # against the sum in fp64 of the same fp32 values.
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, 1, generator=g) * torch.rand(4, n, 1, generator=g) * 100
    got = tree.fold(x)[:, 0].double()
    exact = x.double().sum(1)[:, 0]
    depth = max(1, (n - 1).bit_length())
    bound = depth * 2.0**-24 * x.double().abs().sum(1)[:, 0]
    assert ((got - exact).abs() <= bound).all()


def test_tree_adds_every_tile_once():
    x = torch.arange(1, 12, dtype=torch.float64).reshape(1, 11, 1)
    assert tree.fold(x).item() == 66
    assert tree.tile_sums(torch.ones(2, 300)).tolist() == [[128, 128, 44]] * 2


@settings(max_examples=100, deadline=None)
@given(
    c=st.integers(1, 9), n=st.integers(1, 300), k=st.integers(1, 2), seed=st.integers(0, 2**31 - 1)
)
def test_a_kept_tree_adds_as_the_tree_built_each_call(c, n, k, seed):
    # A small tree on a CPU adds into a buffer kept per thread; the same additions.
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(c, n, k, generator=g).exp() for _ in range(2))
    kept_x, kept_y = buffers.fold_tiles(x), buffers.fold_tiles(y)
    assert buffers.kept_tree(x) is not None
    built_x, built_y = tree.fold(x), tree.fold(y)
    assert torch.equal(kept_x, built_x)  # not overwritten by the second call
    assert torch.equal(kept_y, built_y)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    columns=st.integers(1, 2000),
    k=st.integers(1, 2),
    nan=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_run_of_tile_sums_written_in_place_adds_as_the_tree(rows, columns, k, nan, seed):
    # A pass's chunks write their tile sums into a run buffer (padded to a power of
    # two, k sums outermost) and the run adds them there: the bits of tile_sums + fold.
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, columns, generator=g) for _ in range(k)]
    if nan:  # the 0·(-inf) products a NaN-skipping sum drops
        xs[0][0, columns // 2] = float("nan")
    n = tree.tile_count(columns)
    run = tree.TileRun(rows, n, k, torch.float32, torch.device("cpu"))
    cut = rows // 2  # two chunks
    for s, x in enumerate(xs):
        for a, b in ((0, cut), (cut, rows)):
            got = tree.tile_sums(x[a:b], nan=nan, out=run.slot(s, a, b))
            assert torch.equal(got, tree.tile_sums(x[a:b], nan=nan))
    expected = tree.fold(torch.stack([tree.tile_sums(x, nan=nan) for x in xs], -1))
    assert torch.equal(run.fold(), expected.T)
    assert not run.fold().isnan().any() or not nan


@pytest.mark.parametrize("columns", [1, 200, 4096])
def test_the_kl_sums_written_into_kept_trees_equal_the_sums_folded_apart(monkeypatch, columns):
    # chunk_kl writes its tile sums into this thread's kept trees (both sums of
    # exponentials in one tree of 2c rows); without kept trees it folds each sum apart.
    from rlmath.engine.torch_backend import kl_forward
    from rlmath.engine.torch_backend.buffers import Workspace

    g = torch.Generator().manual_seed(columns)
    z, r = (torch.randn(6, columns, generator=g) * 3 for _ in range(2))
    z[0, : columns // 2] = float("-inf")
    r[0, : columns // 2] = float("-inf")

    def run():
        ws = Workspace(6, columns, torch.float32, torch.device("cpu"))
        return kl_forward.chunk_kl(z, r, ws, None)

    kept = run()
    assert kl_forward._kept_tree(torch.empty(6, columns), 12) is not None
    monkeypatch.setattr(kl_forward, "tree_for", lambda *a: None)
    apart = run()
    for a, b in zip(kept, apart, strict=True):
        assert torch.equal(a, b)


def test_a_kept_tree_made_in_inference_mode_serves_calls_outside_it():
    x = torch.rand(3, 37, 2, dtype=torch.float64)
    buffers.release_kept()
    assert not buffers._pool.kept.trees
    with torch.inference_mode():
        inside = buffers.fold_tiles(x)
    assert buffers._pool.kept.trees  # kept, though made under inference mode
    outside = buffers.fold_tiles(x)
    assert torch.equal(inside, outside)
    assert not outside.is_inference()
    buffers.release_kept()
    assert not buffers._pool.kept.trees


def test_no_tree_is_kept_under_a_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.rand(2, 9, 1)
    with Seen():
        assert buffers.kept_tree(x) is None
        assert torch.equal(buffers.fold_tiles(x), tree.fold(x))


# ------------------------------------------------------------------ one process


def _forward(logits, labels, temperature, **kw):
    lp, ent = log_probs_and_entropy_from_logits(logits, labels, temperature=temperature, **kw)
    ref = logits.flip(-1)  # a reference distribution that differs in every row
    kl = kl_from_logits(logits, ref, temperature=temperature, **kw)
    pi2 = sum_pi_squared_from_logits(logits, temperature=temperature, **kw)
    return lp, ent, kl, pi2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_a_batch(dtype):
    logits, labels, temperature = _data(dtype)
    big = torch.cat([logits] * 28)[:1024]  # 1024 rows
    big_labels = torch.cat([labels] * 28)[:1024]
    big_t = torch.cat([temperature] * 28)[:1024]
    everything = _forward(big, big_labels, big_t)
    for rows in (slice(3, 4), slice(0, 7)):
        alone = _forward(logits[rows], labels[rows], temperature[rows])
        for got, want in zip(alone, everything, strict=True):
            assert torch.equal(got, want[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_size_and_threads_do_not_change_a_bit(dtype):
    logits, labels, temperature = _data(dtype)
    want = _forward(logits, labels, temperature)
    for chunk in (1, 7, None):
        got = _forward(logits, labels, temperature, chunk_size=chunk)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), chunk
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            got = _forward(logits, labels, temperature)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), threads
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ the fused head


def _head(hidden, weight, labels, temperature, rows):
    leaf = hidden[rows].clone().requires_grad_()
    lp, ent = log_probs_and_entropy_from_hidden(
        leaf, weight, labels[rows], temperature=temperature[rows]
    )
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_tile_statistics_against_fp64(dtype):
    # 300 columns: two whole tiles and a tail of 44; row 1's second tile has no
    # finite logit, row 2 some -inf logits among finite ones.
    g = torch.Generator().manual_seed(4)
    c, width = 5, 300
    x = (torch.randn(c, width, generator=g) * 4).to(dtype)
    x[1, 128:256] = float("-inf")
    x[2, ::3] = float("-inf")
    temperature = (torch.rand(c, 1, generator=g) + 0.5).float()
    out = torch.empty(c, 3, 3)
    ws = buffers.Workspace(c, width, torch.float32, x.device)
    tile_stats(x, ws, temperature=temperature, entropy=True, out=out)
    z = x.double() / temperature.double()
    eps = 2.0**-24
    for k, (a, b) in enumerate([(0, 128), (128, 256), (256, 300)]):
        zt = z[:, a:b]
        m = zt.amax(-1)
        dead = m == float("-inf")
        y = torch.where(zt > float("-inf"), zt - m[:, None], float("-inf"))
        e = y.exp()
        s = e.sum(-1)
        t = torch.where(e > 0, e * y, 0.0).sum(-1)
        got = out[:, k].double()
        assert torch.equal(got[:, 0], torch.where(dead, float("-inf"), m.float().double()))
        assert (got[dead, 1:] == 0).all()
        live = ~dead
        # y = fl(x / T) - m: 2u relative in z, |z|·2u absolute in y, then exp and the
        # sum of <= 128 terms (gamma_127 of the terms' sum).
        zmax = zt.abs().where(zt.isfinite(), 0).amax(-1)
        bound_s = (2 * zmax * 2 * eps + 2 * eps + 127 * eps) * s
        ey = e.mul(y.abs()).where(e > 0, 0).sum(-1)
        bound_t = (2 * zmax * 2 * eps + 3 * eps + 127 * eps) * ey + 2 * zmax * 2 * eps * s
        assert ((got[live, 1] - s[live]).abs() <= bound_s[live]).all(), k
        assert ((got[live, 2] - t[live]).abs() <= bound_t[live]).all(), k


@pytest.mark.skipif(
    not cpu_matmul.uses_onednn(torch.float32, torch.device("cpu")),
    reason="the head's fp32 matmuls run in torch's BLAS here, whose rows depend on the batch",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_head_gives_a_row_alone_the_bits_of_the_row_in_a_batch(dtype):
    # 600 rows × 5000 columns: several row blocks and three vocabulary tiles of the
    # head's CPU blocks (2048 columns each, whatever the number of rows).
    g = torch.Generator().manual_seed(0)
    n, h, v = 600, 96, 5000
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[4] = -100
    temperature = torch.rand(n, generator=g) + 0.5
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            everything = _head(hidden, weight, labels, temperature, slice(0, n))
            for rows in (slice(3, 4), slice(0, 2), slice(0, 9), slice(100, 357)):
                alone = _head(hidden, weight, labels, temperature, rows)
                for got, want in zip(alone, everything, strict=True):
                    assert torch.equal(got, want[rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


def test_packed_rows_equal_the_same_rows_padded():
    logits, labels, _ = _data(torch.float32)
    # Two sequences of 10 and 6 response tokens, padded to (2, 12) or packed.
    lengths = [10, 6]
    padded_logits = torch.zeros(2, 12, V)
    padded_labels = torch.full((2, 12), -100)
    pos, rows = 0, []
    for i, n in enumerate(lengths):
        padded_logits[i, :n] = logits[pos : pos + n]
        padded_labels[i, :n] = labels[pos : pos + n]
        rows.append((pos, n))
        pos += n
    padded = _forward(padded_logits, padded_labels, 1.0)[0]
    packed = _forward(logits[:pos], labels[:pos], 1.0)[0]
    for i, (a, n) in enumerate(rows):
        assert torch.equal(padded[i, :n], packed[a : a + n])


# ------------------------------------------------------------------ tensor parallel


def _grads(logits, labels, temperature, rank, world, vocab_size):
    width = logits.shape[-1] // world
    part = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    vp = VocabParallel(group=dist.group.WORLD) if world > 1 else None
    lp, ent = log_probs_and_entropy_from_logits(
        part, labels, temperature=temperature, vocab_parallel=vp, vocab_size=vocab_size
    )
    g = torch.Generator().manual_seed(3)
    loss = (torch.randn(lp.shape, generator=g) * torch.nan_to_num(lp)).sum()
    loss = loss + (torch.randn(ent.shape, generator=g) * ent).sum()
    (grad,) = torch.autograd.grad(loss, part)
    pi2 = sum_pi_squared_from_logits(
        part.detach(), temperature=temperature, vocab_parallel=vp, vocab_size=vocab_size
    )
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    ref = (logits.float() + 0.3 * noise).to(logits.dtype)[:, rank * width : (rank + 1) * width]
    kl = kl_from_logits(
        part, ref, temperature=temperature, vocab_parallel=vp, vocab_size=vocab_size
    )
    (kl_grad,) = torch.autograd.grad((kl * torch.arange(N)).sum(), part)
    return lp.detach(), ent.detach(), grad, pi2, kl.detach(), kl_grad


def _tp_run(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for vocab_size in (None, V - 72):
            logits, labels, temperature = _data(dtype)
            if vocab_size is not None:
                labels = torch.where(labels >= vocab_size, labels - 100, labels)
            out[(dtype, vocab_size)] = _grads(logits, labels, temperature, rank, world, vocab_size)
    return out


def _tp_worker() -> dict:
    return _tp_run(dist.get_rank(), dist.get_world_size())


@pytest.fixture(scope="module")
def one_process():
    return _tp_run(0, 1)


@pytest.mark.integration
@pytest.mark.parametrize("world", [2, 4, 8])
def test_tensor_parallel_degree_does_not_change_a_bit(world, one_process):
    results = run_distributed(_tp_worker, world)
    width = V // world
    for rank, result in enumerate(results):
        for key, (lp, ent, grad, pi2, kl, kl_grad) in result.items():
            want_lp, want_ent, want_grad, want_pi2, want_kl, want_kl_grad = one_process[key]
            assert torch.equal(pi2, want_pi2), (world, rank, key)
            assert torch.equal(kl, want_kl), (world, rank, key)
            cols = slice(rank * width, (rank + 1) * width)
            assert torch.equal(kl_grad, want_kl_grad[:, cols]), (world, rank, key)
            assert torch.equal(lp.nan_to_num(7.0), want_lp.nan_to_num(7.0)), (world, rank, key)
            assert torch.equal(ent, want_ent), (world, rank, key)
            assert torch.equal(grad, want_grad[:, rank * width : (rank + 1) * width]), (
                world,
                rank,
                key,
            )


@pytest.mark.integration
def test_packed_response_rows_over_shards_equal_one_process():
    results = run_distributed(_packed_worker, 2)
    want = _packed_run(0, 1)
    for got in results:
        assert torch.equal(got, want)


def _packed_run(rank: int, world: int) -> torch.Tensor:
    logits, labels, _ = _data(torch.float32)
    width = V // world
    part = logits[:, rank * width : (rank + 1) * width]
    # 37 packed tokens: sequences of 20 and 17 tokens (right-padded to 20).
    ids = labels.clamp_min(0)
    input_ids = torch.zeros(2, 20, dtype=torch.long)
    input_ids[0], input_ids[1, :17] = ids[:20], ids[20:]
    mask = torch.zeros(2, 20, dtype=torch.long)
    mask[0], mask[1, :17] = 1, 1
    vp = VocabParallel(group=dist.group.WORLD) if world > 1 else None
    return log_probs_from_logits_response_rmpad(input_ids, mask, part, 6, vocab_parallel=vp)


def _packed_worker() -> torch.Tensor:
    return _packed_run(dist.get_rank(), dist.get_world_size())


# ------------------------------------------------------------------ the fused head over shards

H = 48


def _head_shard(dtype, rank, world, vocab_size, chunk_size, vocab_chunk_size=None):
    _, labels, temperature = _data(dtype)  # the labels and temperatures of the logits tests
    if vocab_size is not None:
        labels = torch.where(labels >= vocab_size, labels - 100, labels)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    bias = torch.randn(V, generator=g).to(dtype)
    width = V // world
    w = weight[rank * width : (rank + 1) * width].clone().requires_grad_()
    b = bias[rank * width : (rank + 1) * width].clone().requires_grad_()
    vp = VocabParallel(group=dist.group.WORLD) if world > 1 else None
    lp, ent = log_probs_and_entropy_from_hidden(
        hidden, w, labels, bias=b, temperature=temperature, vocab_parallel=vp,
        vocab_size=vocab_size, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
    )  # fmt: skip
    noise = torch.Generator().manual_seed(3)
    loss = (torch.randn(lp.shape, generator=noise) * torch.nan_to_num(lp)).sum()
    loss = loss + (torch.randn(ent.shape, generator=noise) * ent).sum()
    gh, gw, gb = torch.autograd.grad(loss, (hidden, w, b))
    return lp.detach(), ent.detach(), gw, gb, gh


def _head_tp_run(rank: int, world: int, narrow_blocks: bool = False) -> dict:
    keys = [
        (dtype, vocab_size, chunk_size)
        for dtype in (torch.float32, torch.bfloat16)
        for vocab_size in (None, V - 72)
        for chunk_size in (None, 16)
    ]
    if not narrow_blocks:
        return {key: _head_shard(*key[:1], rank, world, *key[1:]) for key in keys}
    # Blocks of 256 columns merged four at a time: one process runs three groups
    # of blocks, a shard of 1536 columns two (four blocks and two).
    saved = head_forward.GROUP_COLUMNS
    head_forward.GROUP_COLUMNS = 1024
    try:
        return {key: _head_shard(*key[:1], rank, world, *key[1:], 256) for key in keys}
    finally:
        head_forward.GROUP_COLUMNS = saved


def _head_tp_worker(narrow_blocks: bool) -> dict:
    return _head_tp_run(dist.get_rank(), dist.get_world_size(), narrow_blocks)


@pytest.mark.integration
@pytest.mark.skipif(
    not cpu_matmul.uses_onednn(torch.float32, torch.device("cpu")),
    reason="the head's fp32 matmuls run in torch's BLAS here, whose rows depend on the batch",
)
@pytest.mark.parametrize(
    ("world", "narrow_blocks"), [(2, False), (4, False), (8, False), (2, True)]
)
def test_the_fused_heads_statistics_do_not_depend_on_the_tensor_parallel_degree(
    world, narrow_blocks
):
    # V = 3072: one process runs head blocks of 2048 and 1024 columns; a shard of
    # 1536, 768 or 384 columns other blocks, whose tiles meet in the same tree
    # (or narrow blocks in groups, against one process's default blocks).
    want = _head_tp_run(0, 1)
    results = run_distributed(_head_tp_worker, world, narrow_blocks)
    width = V // world
    for rank, result in enumerate(results):
        cols = slice(rank * width, (rank + 1) * width)
        for key, (lp, ent, gw, gb, gh) in result.items():
            want_lp, want_ent, want_gw, want_gb, _ = want[key]
            assert torch.equal(lp.nan_to_num(7.0), want_lp.nan_to_num(7.0)), (world, rank, key)
            assert torch.equal(ent, want_ent), (world, rank, key)
            if key[2] is not None:
                # Sums over the rows, in row blocks of the same height on every rank
                # (by default the height follows the shard's width: a memory budget).
                assert torch.equal(gw, want_gw[cols]), (world, rank, key)
                assert torch.equal(gb, want_gb[cols]), (world, rank, key)
            # grad_hidden is all-reduced over the shards (another order of the same sum):
            # the same on every rank, not the bits of one process.
            assert torch.equal(gh, results[0][key][4]), (world, rank, key)


def _truncated_head_run(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        _, labels, temperature = _data(dtype)
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
        weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
        width = V // world
        w = weight[rank * width : (rank + 1) * width].clone().requires_grad_()
        vp = VocabParallel(group=dist.group.WORLD) if world > 1 else None
        for sampler in ({"top_p": 0.9}, {"top_k": 50}, {"min_p": 0.05, "top_p": 0.8}):
            lp, ent = log_probs_and_entropy_from_hidden(
                hidden, w, labels, temperature=temperature, vocab_parallel=vp, chunk_size=16,
                **sampler,
            )[:2]  # fmt: skip
            loss = (torch.nan_to_num(lp) * torch.arange(N)).sum() + ent.sum()
            (gw,) = torch.autograd.grad(loss, (w,))
            out[(dtype, tuple(sampler))] = (lp.detach(), ent.detach(), gw)
    return out


def _truncated_head_worker() -> dict:
    return _truncated_head_run(dist.get_rank(), dist.get_world_size())


@pytest.mark.integration
@pytest.mark.skipif(
    not cpu_matmul.uses_onednn(torch.float32, torch.device("cpu")),
    reason="the head's fp32 matmuls run in torch's BLAS here, whose rows depend on the batch",
)
@pytest.mark.parametrize("world", [2, 4])
def test_the_fused_head_under_a_kept_set_does_not_depend_on_the_tensor_parallel_degree(world):
    # Under a sampler the head hands whole blocks of rows to the logits passes,
    # which sum over the kept tokens in the tree.
    want = _truncated_head_run(0, 1)
    width = V // world
    for rank, result in enumerate(run_distributed(_truncated_head_worker, world)):
        for key, (lp, ent, gw) in result.items():
            want_lp, want_ent, want_gw = want[key]
            assert torch.equal(lp.nan_to_num(7.0), want_lp.nan_to_num(7.0)), (world, rank, key)
            assert torch.equal(ent, want_ent), (world, rank, key)
            assert torch.equal(gw, want_gw[rank * width : (rank + 1) * width]), (world, rank, key)


def _uneven_head_worker() -> str:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, generator=g)
    weight = torch.randn(256 if rank == 0 else 384, 8, generator=g)  # rank 1 starts at 384
    labels = torch.randint(0, 256, (5,), generator=g)
    try:
        log_probs_and_entropy_from_hidden(
            hidden, weight, labels, vocab_parallel=VocabParallel(group=dist.group.WORLD)
        )
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.integration
def test_a_head_whose_shards_leave_a_gap_raises_on_every_rank():
    # Shards placed by their widths (start=None) but of unequal widths: a gap at
    # [256, 384). Caught before the statistics' all-gather, whose size follows from it.
    for message in run_distributed(_uneven_head_worker, 2, timeout=120):
        assert message.startswith("ShardLayoutError"), message
        assert "[(0, 256), (384, 384)]" in message
