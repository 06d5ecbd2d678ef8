"""The Triton backend through Triton's interpreter: every function on CPU tensors against fp64.

``TRITON_INTERPRET=1`` makes Triton run the kernels in Python on CPU tensors
(set here before the backend is first imported), so this file checks the
kernels' math — values and gradients against fp64 references written from
the definitions — on a machine without a GPU. Small fp32 shapes only (the
interpreter is slow); the interpreter computes bf16 wrongly without an
error, so half precision is tested on the GPU (``tests/test_cuda.py``).
Skipped where ``triton`` does not import or is older than the backend needs
(:data:`rlmath.engine.triton_backend.MIN_TRITON`), and where a CUDA device is present
without ``TRITON_INTERPRET=1`` (the compiled kernels are tested there). The
interpreter never compiles a kernel: ``make test-gpu-compile``
(:mod:`tests.engine.triton_gpu_check`) compiles every specialization the
wrappers produce for the GPU and checks the compiled code.

Tolerances: :mod:`tests.engine.triton_reference`.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed (pip install 'triton>=3.4', the triton extra)",
        allow_module_level=True,
    )
if not os.environ.get("TRITON_INTERPRET") and torch.cuda.is_available():
    pytest.skip(
        "a CUDA device is present: the compiled kernels are tested in tests/test_cuda.py "
        "(set TRITON_INTERPRET=1 to run the interpreter tests here)",
        allow_module_level=True,
    )
os.environ["TRITON_INTERPRET"] = "1"  # before the backend's kernels are first defined
import rlmath as R
import rlmath.engine.backends as backends
from rlmath.distributed import vocab_parallel as vp
from rlmath.engine import LogProbsEntropyFunction, OpConfig, available_backends, resolve_backend
from tests.engine.triton_reference import (
    EPS,
    KLRef,
    LogitsRef,
    check,
    gen,
    logits_with_hard_cases,
    row_delta,
)
from tests.logprobs.reference import log_softmax64

IGNORE = -100

# The interpreter evaluates in numpy the -inf - (-inf) and log(0) that the kernels
# compute and then discard (masked lanes, rows without mass); numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module", autouse=True)
def triton_backend():
    """The interpreted backend for this module only: other modules' ``"auto"`` never sees it."""
    saved = dict(backends._BACKENDS), dict(backends._UNAVAILABLE)
    try:
        import rlmath.engine.triton_backend as tb
    except ImportError as exc:  # e.g. a triton older than the kernels need
        pytest.skip(f"the triton backend cannot load here: {exc}")

    if not tb.INTERPRETED:
        pytest.skip("the triton backend was imported before TRITON_INTERPRET=1 was set")
    backends.register_backend(tb.TRITON_BACKEND)
    yield tb
    backends._BACKENDS.clear()
    backends._BACKENDS.update(saved[0])
    backends._UNAVAILABLE.clear()
    backends._UNAVAILABLE.update(saved[1])


@pytest.fixture(params=["one block", "many blocks"])
def blocks(request, monkeypatch):
    """The kernels' own block size, or 64 columns per step (loops of many steps per row)."""
    from rlmath.engine.triton_backend import launch

    if request.param == "many blocks":
        monkeypatch.setattr(launch, "MAX_BLOCK_ELEMENTS", 64)
    return request.param


# ------------------------------------------------------------------ data and references


def _run_lp_ent(x, labels, temp, gl, ge, *, backend="triton", **kw):
    leaf = x.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(
        leaf, labels, temperature=temp, backend=backend, **kw
    )
    (lp * gl.view(lp.shape)).sum().add((ent * ge).sum()).backward()
    return lp, ent, leaf.grad


# ------------------------------------------------------------------ registration


def test_backend_is_registered_for_fp32_cpu_under_the_interpreter():
    x = torch.randn(3, 5)
    assert available_backends(x)[0] == "triton"
    assert resolve_backend("auto", x) == "triton"
    x64 = x.double()
    assert available_backends(x64) == ["torch"] and resolve_backend("auto", x64) == "torch"
    with pytest.raises(ValueError, match="backend 'triton' does not accept torch.float64"):
        R.log_probs_from_logits(x64, torch.zeros(3, dtype=torch.long), backend="triton")
    # The interpreter rounds to bf16 wrongly: half precision stays with the torch backend here.
    assert available_backends(x.bfloat16()) == ["torch"]
    assert available_backends(x.half()) == ["torch"]


def test_kernels_take_the_temperature_as_a_tensor_argument():
    """A per-row temperature is a pointer argument and a scalar one a float: never a constexpr."""
    from rlmath.engine.triton_backend import (
        kl_backward,
        kl_forward,
        logits_backward,
        logits_forward,
        sum_pi_squared,
    )

    kernels = [
        logits_forward._logits_stats_kernel,
        logits_backward._logits_grad_kernel,
        kl_forward._kl_stats_kernel,
        kl_backward._kl_grad_kernel,
        sum_pi_squared._pi_squared_kernel,
    ]
    for k in kernels:
        params = {p.name: p for p in k.fn.params} if hasattr(k.fn, "params") else None
        names = list(k.arg_names)
        assert "TEMP" in names and "inv_t_scalar" in names
        if params is not None:
            assert not params["TEMP"].is_constexpr and not params["inv_t_scalar"].is_constexpr


# ------------------------------------------------------------------ log-probs and entropy


def _check_lp_ent(got, ref: LogitsRef, what: str, live=None) -> None:
    lp, ent, grad = got
    rows = slice(None) if live is None else live
    check(lp.reshape(ref.lp.shape)[rows], ref.lp[rows], ref.tol[rows, None], f"{what}: log-probs")
    check(ent[rows], ref.H[rows], ref.tol[rows], f"{what}: entropy")
    check(grad[rows], ref.grad[rows], ref.grad_tol[rows], f"{what}: gradient")


@pytest.mark.parametrize("temp_kind", ["none", "scalar", "rows"])
def test_log_probs_entropy_and_gradient_against_fp64(blocks, temp_kind):
    N, V = 48, 700
    x = logits_with_hard_cases(N, V, 1)
    g = gen(2)
    labels = torch.randint(2, V - 3, (N,), generator=g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    temp = {"none": 1.0, "scalar": 0.7, "rows": torch.rand(N, generator=g) + 0.5}[temp_kind]
    x_before = x.clone()
    got = _run_lp_ent(x, labels, temp, gl, ge)
    assert torch.equal(x, x_before)  # no input modified
    assert all(t.dtype == torch.float32 for t in got)
    _check_lp_ent(got, LogitsRef(x, labels, temp, gl, ge), temp_kind)
    grad = got[2]
    assert (grad[:, V - 3 :] == 0).all() and (grad[:, 1] == 0).all()  # padded columns


def test_log_probs_only_and_entropy_only(blocks):
    N, V = 40, 513
    x = logits_with_hard_cases(N, V, 3)
    g = gen(4)
    labels = torch.randint(2, V - 3, (N,), generator=g)
    gl = torch.randn(N, generator=g)
    leaf = x.clone().requires_grad_()
    lp = R.log_probs_from_logits(leaf, labels, temperature=0.9, backend="triton")
    (lp * gl).sum().backward()
    ref = LogitsRef(x, labels, 0.9, gl, torch.zeros(N))
    check(lp, ref.lp[:, 0], ref.tol, "log-probs")
    check(leaf.grad, ref.grad, ref.grad_tol, "gradient of the log-probs")
    leaf = x.clone().requires_grad_()
    ent = R.entropy_from_logits(leaf, backend="triton")
    ent.sum().backward()
    ref = LogitsRef(x, labels, 1.0, torch.zeros(N), torch.ones(N))
    check(ent, ref.H, ref.tol, "entropy")
    check(leaf.grad, ref.grad, ref.grad_tol, "gradient of the entropy")


def test_k_labels_with_repeats_and_ignored_candidates():
    N, V, K = 32, 301, 3
    x = logits_with_hard_cases(N, V, 5)
    g = gen(6)
    labels = torch.randint(2, V - 3, (N, K), generator=g)
    labels[3, 2] = labels[3, 0]  # a repeated candidate counts twice
    labels[7, 1] = IGNORE  # an ignored candidate in a live row
    labels[9] = IGNORE  # a dead row, holding junk
    x[9] = float("nan")
    gl, ge = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    got = _run_lp_ent(x, labels, 0.8, gl, ge, ignore_index=IGNORE)
    live = torch.ones(N, dtype=torch.bool)
    live[9] = False
    clean = torch.where(live[:, None], x, 0.0)
    _check_lp_ent(got, LogitsRef(clean, labels, 0.8, gl, ge, ignore=IGNORE), "K=3", live)
    lp, ent, grad = got
    assert (lp[9] == 0).all() and ent[9] == 0 and (grad[9] == 0).all()  # NaN never read
    assert lp[7, 1] == 0


def test_ignored_rows_give_exact_zeros_whatever_they_hold():
    N, V = 24, 257
    x = logits_with_hard_cases(N, V, 7)
    g = gen(8)
    labels = torch.randint(2, V - 3, (N,), generator=g)
    dead = torch.zeros(N, dtype=torch.bool)
    dead[[2, 5, 6, 23]] = True
    labels[dead] = IGNORE
    dirty = x.clone()
    dirty[2], dirty[5], dirty[6], dirty[23] = float("nan"), float("inf"), 1e30, float("-inf")
    temp = torch.rand(N, generator=g) + 0.5
    dirty_temp = torch.where(dead, 0.0, temp)  # a 0 temperature on a padded position
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    clean = _run_lp_ent(x, labels, temp, gl, ge, ignore_index=IGNORE)
    got = _run_lp_ent(dirty, labels, dirty_temp, gl, ge, ignore_index=IGNORE)
    for a, b in zip(got, clean, strict=True):
        assert torch.equal(a[~dead], b[~dead])
        assert (a[dead] == 0).all()


def test_rows_that_do_not_merge_and_broadcast_temperature():
    """Positions 1..5 of each sequence: batch dims with no common stride, read through row offsets."""
    B, S, V = 3, 10, 211
    g = gen(9)
    base = torch.randn(B, S, V, generator=g) * 2
    labels = torch.randint(0, V, (B, 5), generator=g)
    temp = torch.rand(B, 1, generator=g) + 0.5
    gl, ge = torch.randn(B, 5, generator=g), torch.randn(B, 5, generator=g)
    leaf = base.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(
        leaf[:, 1:6], labels, temperature=temp, backend="triton"
    )
    ((lp * gl).sum() + (ent * ge).sum()).backward()
    x = base[:, 1:6].reshape(-1, V)
    t = temp.expand(B, 5).reshape(-1)
    ref = LogitsRef(x, labels.reshape(-1), t, gl.reshape(-1), ge.reshape(-1))
    _check_lp_ent((lp.reshape(-1), ent.reshape(-1), leaf.grad[:, 1:6].reshape(-1, V)), ref, "rows")
    assert (leaf.grad[:, 0] == 0).all() and (leaf.grad[:, 6:] == 0).all()


def test_transposed_logits_read_with_a_column_stride():
    """``(V, N).T`` logits: rows of stride 1, columns of stride N (the KL too)."""
    N, V = 24, 333
    g = gen(40)
    base = torch.randn(V, N, generator=g) * 2
    r = torch.randn(V, N, generator=g).T
    labels = torch.randint(0, V, (N,), generator=g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    leaf = base.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(leaf.T, labels, backend="triton")
    (lp * gl + ent * ge).sum().backward()
    x = base.T.contiguous()
    _check_lp_ent((lp, ent, leaf.grad.T), LogitsRef(x, labels, 1.0, gl, ge), "transposed")
    kl = R.kl_from_logits(base.T, r, backend="triton")
    ref = KLRef(x, r.contiguous(), 1.0, torch.ones(N))
    check(kl, ref.kl, ref.tol, "KL of transposed logits")


def test_column_offsets_that_overflow_int32_are_read_from_a_copy():
    from rlmath.engine.triton_backend.launch import int32_columns

    wide = torch.empty_strided((4, 3), (1, 2**30), device="meta")  # last column at 2^31
    assert int32_columns(wide).is_contiguous()
    fits = torch.empty_strided((4, 3), (1, 2**29), device="meta")
    assert int32_columns(fits) is fits


def test_deterministic_and_batch_invariant():
    """Two runs are bitwise equal, and a row's results do not depend on the rows around it."""
    N, V = 64, 600
    x = logits_with_hard_cases(N, V, 10)
    labels = torch.randint(2, V - 3, (N,), generator=gen(11))
    gl, ge = torch.ones(N), torch.full((N,), 0.5)
    a = _run_lp_ent(x, labels, 0.9, gl, ge)
    b = _run_lp_ent(x, labels, 0.9, gl, ge)
    for u, w in zip(a, b, strict=True):
        assert torch.equal(u, w)
    for i in (0, 17, 63):
        one = _run_lp_ent(x[i : i + 1], labels[i : i + 1], 0.9, gl[:1], ge[:1])
        for u, w in zip(one, a, strict=True):
            assert torch.equal(u[0], w[i])


# ------------------------------------------------------------------ vocabulary shards


def test_vocab_parallel_world_of_one_with_padding(blocks):
    """``vocab_size`` marks the shard's last columns as padding: left out, zero gradient."""
    N, V, real = 30, 400, 371
    g = gen(12)
    x = torch.randn(N, V, generator=g) * 3
    x[:, real:] = 7.0  # padding values must not count
    labels = torch.randint(0, real, (N,), generator=g)
    labels[4] = IGNORE
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    leaf = x.clone().requires_grad_()
    lp, ent = vp.vocab_parallel_log_probs_and_entropy(
        leaf, labels, vocab_size=real, temperature=0.8, backend="triton"
    )
    (lp * gl + ent * ge).sum().backward()
    ref = LogitsRef(x[:, :real], labels, 0.8, gl, ge, ignore=IGNORE)
    _check_lp_ent((lp, ent, leaf.grad[:, :real]), ref, "shard with padding")
    assert (leaf.grad[:, real:] == 0).all() and (leaf.grad[4] == 0).all()


def _shard_worker(k: int, entropy: bool) -> dict[str, tuple[torch.Tensor, ...]]:
    """Rank 0 holds tokens [0, 100), rank 1 [100, 400) of which 280 are real (vocab_size 380)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    N = 28
    g = gen(13)
    x_full = torch.randn(N, 400, generator=g) * 2
    labels = torch.randint(0, 380, (N, k), generator=g)
    labels[5] = IGNORE
    gl, ge = torch.randn(N, k, generator=g), torch.randn(N, generator=g)
    start, width = (0, 100) if rank == 0 else (100, 300)
    shard = R.VocabParallel(group=dist.group.WORLD, start=start)
    out = {}
    for be in ("torch", "triton"):
        leaf = x_full[:, start : start + width].clone().requires_grad_()
        kw = {"vocab_size": 380, "vocab_parallel": shard, "backend": be}
        if entropy:
            lp, ent = R.log_probs_and_entropy_from_logits(leaf, labels, **kw)
            loss = (lp * gl).sum() + (ent * ge).sum()
        else:
            lp = R.log_probs_from_logits(leaf, labels, **kw)
            ent, loss = lp, (lp * gl).sum()
        loss.backward()
        out[be] = (lp.detach(), ent.detach(), leaf.grad)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("entropy", [False, True])
def test_a_shard_that_holds_only_some_labels_matches_the_torch_backend(k, entropy):
    """Two gloo ranks; on each, the labels outside its shard are the other's (not owned here)."""
    from rlmath.distributed import run_distributed

    for rank, out in enumerate(run_distributed(_shard_worker, 2, k, entropy)):
        for a, b in zip(out["triton"], out["torch"], strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        if rank == 1:
            assert (out["triton"][2][:, 280:] == 0).all()


_GRID_N, _GRID_V, _GRID_REAL = 6, 512, 500
_GRID_TEMPS = ("T = 1", "scalar T", "T per row")


def _tile_grid_data() -> dict[str, object]:
    """The logits (512 columns, 500 real), reference logits, labels, loss weights, temperatures."""
    g = gen(21)
    x = torch.randn(_GRID_N, _GRID_V, generator=g) * 2
    ref = x + 0.3 * torch.randn(_GRID_N, _GRID_V, generator=g)
    labels = torch.randint(0, _GRID_REAL, (_GRID_N,), generator=g)
    labels[2] = IGNORE
    gl, ge = torch.randn(_GRID_N, generator=g), torch.randn(_GRID_N, generator=g)
    temps = dict(zip(_GRID_TEMPS, (1.0, 0.7, torch.rand(_GRID_N, generator=g) + 0.5), strict=True))
    return {"x": x, "ref": ref, "labels": labels, "gl": gl, "ge": ge, "temps": temps}


def _grid_kept_ids() -> torch.Tensor:
    """A replayed kept set as global token ids, padded with -1: every third token, per row."""
    ids = torch.arange(0, _GRID_REAL, 3).expand(_GRID_N, -1).clone()
    ids[1, 40:] = -1
    return ids


def _kept_sets_over_the_grid(x, labels, temp, kw, patched=True) -> list[torch.Tensor]:
    """Log-probs, entropy and the log-probs' gradient under top-p, min-p, top-k + top-p and a
    replayed kept set (bool mask and ids) on this rank's shard. ``patched``: fail if a kept
    set's tile sums go to the pure-torch pass."""
    from rlmath.engine.triton_backend import logits_forward as triton_forward

    torch_pass = triton_forward.torch_logits_stats

    def no_torch_pass(*args, restrict=None, shift=None, **kwargs):
        assert restrict is None or shift is None, "a kept set's tile sums took the torch pass"
        return torch_pass(*args, restrict=restrict, shift=shift, **kwargs)

    ids = _grid_kept_ids()
    mask = torch.zeros(_GRID_N, _GRID_REAL, dtype=torch.bool)  # over the vocab_size tokens
    mask.scatter_(1, ids.clamp_min(0), ids >= 0)
    cases = ({"top_p": 0.8}, {"min_p": 0.05}, {"top_k": 40, "top_p": 0.9}, {"kept": mask},
             {"kept": ids})  # fmt: skip
    got = []
    if patched:
        triton_forward.torch_logits_stats = no_torch_pass
    try:
        for case in cases:
            leaf = x.clone().requires_grad_()
            lp, ent = R.log_probs_and_entropy_from_logits(leaf, labels, temperature=temp, **case,
                                                          **kw)  # fmt: skip
            lp.nan_to_num(0.0).sum().backward()
            got += [lp.detach(), ent.detach(), leaf.grad]
    finally:
        triton_forward.torch_logits_stats = torch_pass
    return got


def _tile_grid_worker() -> dict[str, list[torch.Tensor]]:
    """This rank's results over shards on the tile grid (2 or 4 ranks of equal width)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    d = _tile_grid_data()
    x, ref, labels, gl, ge = d["x"], d["ref"], d["labels"], d["gl"], d["ge"]
    width = _GRID_V // world
    cols = slice(rank * width, (rank + 1) * width)
    kw = {"vocab_parallel": R.VocabParallel(group=dist.group.WORLD), "vocab_size": _GRID_REAL,
          "backend": "triton"}  # fmt: skip
    out: dict[str, list[torch.Tensor]] = {}
    for name, temp in d["temps"].items():
        leaf = x[:, cols].clone().requires_grad_()
        lp, ent = R.log_probs_and_entropy_from_logits(leaf, labels, temperature=temp, **kw)
        (lp * gl + ent * ge).sum().backward()
        kl_leaf = x[:, cols].clone().requires_grad_()
        kl = R.kl_from_logits(kl_leaf, ref[:, cols], temperature=temp, **kw)
        (kl * gl).sum().backward()
        pi2 = R.sum_pi_squared_from_logits(x[:, cols], temperature=temp, **kw)
        kept_leaf = x[:, cols].clone().requires_grad_()
        kept = R.log_probs_from_logits(kept_leaf, labels, temperature=temp, top_k=20, **kw)
        (kept * gl).sum().backward()
        out[name] = [lp.detach(), ent.detach(), kl.detach(), pi2, kept.detach()]
        out[name + " grads"] = [leaf.grad, kl_leaf.grad, kept_leaf.grad]
    # Every form of kept set, its sums per tile in the kernel (not the pure-torch pass).
    out["kept sets"] = _kept_sets_over_the_grid(x[:, cols], labels, d["temps"]["T per row"], kw)
    torch_kw = {**kw, "backend": "torch"}
    out["kept sets, torch"] = _kept_sets_over_the_grid(
        x[:, cols], labels, d["temps"]["T per row"], torch_kw, patched=False
    )
    # Packed rows (the rows picked by index): two sequences of 4 and 2 tokens.
    ids = labels.clamp_min(0)
    input_ids, mask = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)
    input_ids[0], input_ids[1, :2], mask[0], mask[1, :2] = ids[:4], ids[4:], 1, 1
    packed = R.log_probs_from_logits_response_rmpad(input_ids, mask, x[:, cols], 3, **kw)
    out["packed"] = [packed]
    return out


@pytest.mark.integration
def test_shards_on_the_tile_grid_give_the_same_bits_on_2_and_4_ranks():
    """Values and gradients of log-probs, entropy, KL, Σπ² and kept-set log-probs over shards on
    the tile grid: bitwise the same on 2 and 4 ranks (each tile summed alone, then the fixed
    tree), and within the fp32 bounds of fp64. (One process runs the one-pass kernels, whose
    sums add in another order.)"""
    from rlmath.distributed import run_distributed

    worlds = {w: run_distributed(_tile_grid_worker, w) for w in (2, 4)}

    # Gradients (every entry of "... grads", every third of "kept sets") are per column.
    def per_column(key: str, i: int) -> bool:
        return key.endswith("grads") or (key.startswith("kept sets") and i % 3 == 2)

    want = {}  # the whole gradient from the ranks of the 2-rank run
    for key in worlds[2][0]:
        parts = [r[key] for r in worlds[2]]
        want[key] = [torch.cat(p, 1) if per_column(key, i) else p[0]
                     for i, p in enumerate(zip(*parts, strict=True))]  # fmt: skip
    for w, ranks in worlds.items():
        width = _GRID_V // w
        for rank, got in enumerate(ranks):
            for key, values in got.items():
                for i, (a, b) in enumerate(zip(values, want[key], strict=True)):
                    if per_column(key, i):  # this rank's columns
                        b = b[:, rank * width : (rank + 1) * width]
                    assert torch.equal(a, b), (w, rank, key, i)
    # The kept sets' kernel sums against the pure-torch pass over the same shards (each
    # checked against fp64 in its own tests): within fp32 rounding.
    for a, b in zip(want["kept sets"], want["kept sets, torch"], strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    d = _tile_grid_data()
    x, ref, real = d["x"][:, :_GRID_REAL], d["ref"][:, :_GRID_REAL], _GRID_REAL
    for name, temp in d["temps"].items():
        lp, ent, kl, pi2, _ = want[name]
        grad, kl_grad, _ = (g[:, :real] for g in want[name + " grads"])
        lref = LogitsRef(x, d["labels"], temp, d["gl"], d["ge"], ignore=IGNORE)
        _check_lp_ent((lp, ent, grad), lref, f"tile grid, {name}")
        kref = KLRef(x, ref, temp, d["gl"])
        check(kl, kref.kl, kref.tol, f"tile grid KL, {name}")
        check(kl_grad, kref.gz, kref.gz_tol, f"tile grid KL gradient, {name}")
        z = x.double() / (temp.double()[:, None] if isinstance(temp, torch.Tensor) else temp)
        p = log_softmax64(z).exp()
        # u / s²: relative errors of u and s (each within delta of the exponents) add up.
        check(pi2, (p * p).sum(-1), 4 * row_delta(z) * (p * p).sum(-1), f"tile grid Σπ², {name}")
    for g in want["T = 1 grads"]:  # the padding columns get no gradient
        assert (g[:, real:] == 0).all()


@pytest.mark.parametrize("mode", ["tau", "mask", "ids"])
def test_kept_tile_sums_against_fp64_over_several_programs_per_row(mode):
    """The per-tile kernel restricted to a kept set: each tile's sums against fp64, on rows of
    three programs (1024 columns each), labels added to the kept set."""
    from rlmath.engine.sampling import KeptSet
    from rlmath.engine.triton_backend.tile_sums import ENTROPY, tile_sums

    N, V = 4, 2500
    g = gen(23)
    x = torch.randn(N, V, generator=g) * 2
    temp = torch.rand(N, generator=g) + 0.5
    z = x / temp[:, None]  # the search's rounding: one fp32 division
    shift = z.amax(-1)
    labels = torch.randint(0, V, (N, 2), generator=g)
    owned = torch.tensor([[True, True], [True, False], [False, False], [True, True]])
    tau = torch.quantile(z, 0.995, dim=-1)  # a dozen tokens a row: some tiles keep none
    keep = z >= tau[:, None]
    kept = None
    if mode != "tau":
        keep = torch.rand(N, V, generator=g) < 0.005
        ids = [row.nonzero().squeeze(-1) for row in keep]
        width = max(len(r) for r in ids)
        kept = keep if mode == "mask" else torch.stack(
            [torch.cat([r, r.new_full((width - len(r),), -1)]) for r in ids])  # fmt: skip
    restrict = KeptSet(
        "kept" if kept is not None else "vllm", top_k=None, top_p=None, min_p=None, kept=kept,
        labels=labels, owned=owned, tau=tau, count=None, forward=False,
    )  # fmt: skip
    s, t = tile_sums(x, None, None, temp, V, shift, ENTROPY, restrict)
    keep = keep.clone()
    for i in range(N):
        keep[i, labels[i][owned[i]]] = True
    y = z.double() - shift.double()[:, None]
    e = torch.where(keep, y.exp(), 0.0)
    pad = -V % 128
    want_s = torch.nn.functional.pad(e, (0, pad)).view(N, -1, 128).sum(-1)
    want_t = torch.nn.functional.pad(e * y, (0, pad)).view(N, -1, 128).sum(-1)
    # Bounds from the kernel's steps, eps = 2^-24: z = x / T and z - M are rounded (the
    # exponent off by up to |y|·eps + eps), exp2(y·log2 e) adds the rounding of the product
    # (|y|·eps relative) and ex2.approx's 2 ulps: each e within (2|y| + 4)·eps relative; the
    # entropy term's product one more. Summing 128 terms in any order adds at most
    # 127·eps·Σ|terms| (Higham's γ_127, to first order).
    eps = EPS

    def per_tile(v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(v, (0, pad)).view(N, -1, 128).sum(-1)

    rel = (2 * y.abs() + 4) * eps
    tol_s = per_tile(e * rel) + 127 * eps * want_s
    tol_t = per_tile((e * y).abs() * (rel + eps)) + 127 * eps * per_tile((e * y).abs())
    check(s, want_s, tol_s, f"kept tile sums ({mode})")
    check(t, want_t, tol_t, f"kept tile entropy terms ({mode})")
    assert (want_s > 0).sum() < want_s.numel()  # some tiles hold no kept token


# ------------------------------------------------------------------ responses (narrow and packed rows)


def test_dense_response_log_probs_and_gradient():
    B, S, V, Rl = 3, 9, 157, 4
    g = gen(14)
    ids = torch.randint(0, V, (B, S), generator=g)
    logits = torch.randn(B, S, V, generator=g) * 2
    temp = torch.rand(B, 1, generator=g) + 0.5
    gl = torch.randn(B, Rl, generator=g)
    leaf = logits.clone().requires_grad_()
    lp = R.log_probs_from_logits_response(ids, leaf, Rl, temperature=temp, backend="triton")
    (lp * gl).sum().backward()
    rows = logits[:, S - Rl - 1 : S - 1].reshape(-1, V)
    t = temp.expand(B, Rl).reshape(-1)
    ref = LogitsRef(rows, ids[:, -Rl:].reshape(-1), t, gl.reshape(-1), torch.zeros(B * Rl))
    check(lp.reshape(-1), ref.lp[:, 0], ref.tol, "response log-probs")
    gsel = leaf.grad[:, S - Rl - 1 : S - 1].reshape(-1, V)
    check(gsel, ref.grad, ref.grad_tol, "response gradient")
    assert (leaf.grad[:, : S - Rl - 1] == 0).all() and (leaf.grad[:, -1] == 0).all()


def test_packed_response_functions_match_dense():
    B, S, V, Rl = 4, 10, 131, 4
    g = gen(15)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, -2:] = 0  # right padding inside the response
    mask[2, 5] = 0
    logits = torch.randn(B, S, V, generator=g) * 2
    packed = logits.reshape(B * S, V)[mask.bool().view(-1)]
    idx = mask.view(-1).nonzero().squeeze(1)
    temp = torch.rand(B, 1, generator=g) + 0.5
    out = {}
    for be in ("torch", "triton"):
        leaf = packed.clone().requires_grad_()
        a = R.log_probs_from_logits_response_rmpad(
            ids, mask, leaf, Rl, temperature=temp, backend=be
        )
        b = R.log_probs_from_logits_all_rmpad(
            ids.view(-1)[idx], leaf, idx, B, S, Rl, temperature=temp, backend=be
        )
        (a.sum() + 2 * b.sum()).backward()
        out[be] = (a, b, leaf.grad)
    for u, w in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(u, w, atol=1e-5, rtol=1e-5)


def test_repeated_packed_rows_sum_their_gradients_deterministically():
    """Rows picked twice (and dead picks of a live row) add up, as ``index_add`` would."""
    V = 97
    g = gen(16)
    x = torch.randn(6, V, generator=g) * 2
    rows = torch.tensor([3, 0, 3, 5, 3, 1, 0, 2])
    labels = torch.randint(0, V, (8, 1), generator=g)
    labels[6] = IGNORE  # a dead pick of row 0
    x_dirty = x.clone()
    x_dirty[4] = float("nan")  # a row nobody picks
    grads = {}
    for be in ("torch", "triton"):
        cfg = OpConfig(backend=be, ignore_index=IGNORE, want_entropy=True)
        leaf = x_dirty.clone().requires_grad_()
        lp, ent, *_ = LogProbsEntropyFunction.apply(leaf, labels, None, rows, None, None, cfg)
        w = torch.arange(1.0, 9.0)
        ((lp[:, 0] * w).sum() + (ent * w.flip(0)).sum()).backward()
        grads[be] = (lp, ent, leaf.grad)
    for u, w in zip(grads["triton"], grads["torch"], strict=True):
        torch.testing.assert_close(u, w, atol=2e-6, rtol=1e-5)
    assert (grads["triton"][2][4] == 0).all()


# ------------------------------------------------------------------ KL and Σ π²


@pytest.mark.parametrize("temp_kind", ["scalar", "rows"])
def test_kl_and_both_gradients_against_fp64(blocks, temp_kind):
    N, V = 40, 600
    g = gen(17)
    z = torch.randn(N, V, generator=g) * 2
    r = z + 0.3 * torch.randn(N, V, generator=g)  # close distributions: small KLs
    r[:5] = torch.randn(5, V, generator=g) * 2  # and far ones
    z[1] = -2000.0 - torch.rand(V, generator=g)  # all-negative rows
    z[:, V - 4 :] = r[:, V - 4 :] = float("-inf")  # padded vocabulary in both
    temp = 0.8 if temp_kind == "scalar" else torch.rand(N, generator=g) + 0.5
    gk = torch.randn(N, generator=g)
    zl, rl = z.clone().requires_grad_(), r.clone().requires_grad_()
    kl = R.kl_from_logits(zl, rl, temperature=temp, backend="triton")
    (kl * gk).sum().backward()
    ref = KLRef(z, r, temp, gk)
    check(kl, ref.kl, ref.tol, "KL")
    check(zl.grad, ref.gz, ref.gz_tol, "KL gradient of the logits")
    check(rl.grad, ref.gr, ref.gr_tol, "KL gradient of the reference logits")
    assert (zl.grad[:, V - 4 :] == 0).all() and (rl.grad[:, V - 4 :] == 0).all()


def test_kl_edge_cases_match_the_torch_backend():
    """+inf where the policy has mass the reference lacks; NaN stays NaN; an fp64 reference."""
    V = 50
    g = gen(18)
    z, r = torch.randn(5, V, generator=g), torch.randn(5, V, generator=g)
    r[0, 3] = float("-inf")  # policy mass where the reference has none: +inf
    r[1] = float("-inf")
    z[2, 0] = float("nan")
    z[3, :10] = r[3, :10] = float("-inf")  # both -inf: contributes 0
    for be in ("torch", "triton"):
        kl = R.kl_from_logits(z, r, backend=be)
        assert kl[0] == float("inf") and kl[1] == float("inf") and torch.isnan(kl[2])
        assert torch.isfinite(kl[3]) and torch.isfinite(kl[4])
    torch.testing.assert_close(
        R.kl_from_logits(z, r, backend="triton"), R.kl_from_logits(z, r, backend="torch"),
        atol=1e-6, rtol=0, equal_nan=True,
    )  # fmt: skip
    # An fp64 reference makes the compute dtype fp64: the pure-torch pass runs, bitwise.
    r64 = r.double()
    assert torch.equal(
        R.kl_from_logits(z[3:], r64[3:], backend="triton"),
        R.kl_from_logits(z[3:], r64[3:], backend="torch"),
    )


def test_vocab_parallel_kl_world_of_one_with_padding():
    N, V, real = 20, 256, 230
    g = gen(19)
    z, r = torch.randn(N, V, generator=g) * 2, torch.randn(N, V, generator=g) * 2
    zl = z.clone().requires_grad_()
    kl = vp.vocab_parallel_kl_from_logits(zl, r, vocab_size=real, backend="triton")
    kl.sum().backward()
    ref = KLRef(z[:, :real], r[:, :real], 1.0, torch.ones(N))
    check(kl, ref.kl, ref.tol, "KL of a shard with padding")
    check(zl.grad[:, :real], ref.gz, ref.gz_tol, "KL gradient of a shard with padding")
    assert (zl.grad[:, real:] == 0).all()


def test_sum_pi_squared_against_fp64(blocks):
    N, V = 40, 500
    x = logits_with_hard_cases(N, V, 20)
    temp = torch.rand(N, generator=gen(21)) + 0.5
    got = R.sum_pi_squared_from_logits(x, temperature=temp, backend="triton")
    z = x.double() / temp.double()[:, None]
    p = log_softmax64(z).exp()
    want = (p * p).sum(-1)
    # u / s²: relative errors of u and s (each within delta of the exponents) add up.
    check(got, want, 4 * row_delta(z) * want, "Σ π²")
    assert torch.equal(vp.vocab_parallel_sum_pi_squared(x, temperature=temp, backend="triton"), got)


# ------------------------------------------------------------------ fused head


def _head_data(N, H, V, seed):
    g = gen(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) / H**0.5 * 2
    b = torch.randn(V, generator=g)
    return h, w, b


@pytest.mark.parametrize(
    "chunk,vchunk", [(None, None), (32, 150)], ids=["one block", "row chunks x tiles"]
)
def test_fused_head_values_and_gradients_against_fp64(chunk, vchunk):
    N, H, V = 96, 48, 611
    h, w, b = _head_data(N, H, V, 22)
    g = gen(23)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[3, 40]] = IGNORE
    h[3] = float("nan")  # an ignored position's hidden state is never read
    temp = torch.rand(N, generator=g) + 0.5
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    lp, ent = R.log_probs_and_entropy_from_hidden(
        *leaves[:2], labels, bias=leaves[2], temperature=temp, chunk_size=chunk,
        vocab_chunk_size=vchunk, backend="triton",
    )  # fmt: skip
    (lp * gl + ent * ge).sum().backward()
    clean = torch.where(labels[:, None] != IGNORE, h, 0.0).double()
    w64, b64 = w.double(), b.double()
    x = clean @ w64.T + b64
    # The fp32 matmul leaves each logit within H·eps·Σ_k|h_k·w_k| (+|b|) of x.
    mm_err = H * EPS * ((clean.abs() @ w64.abs().T) + b64.abs()).amax(-1)
    ref = LogitsRef(x, labels, temp, gl, ge, ignore=IGNORE, extra=2 * mm_err / temp.double())
    check(lp, ref.lp[:, 0], ref.tol, "head log-probs")
    check(ent, ref.H, ref.tol, "head entropy")
    assert lp[3] == 0 and ent[3] == 0 and (leaves[0].grad[3] == 0).all()
    # Each gradient is a sum of logit-gradient entries times h or w: their bounds,
    # plus the rounding of a sum of V (or N) terms.
    G, E = ref.grad, ref.grad_tol
    gh = E @ w64.abs() + (V + 1) * EPS * (G.abs() @ w64.abs())
    gw = E.T @ clean.abs() + (N + 1) * EPS * (G.abs().T @ clean.abs())
    gb = E.sum(0) + (N + 1) * EPS * G.abs().sum(0)
    check(leaves[0].grad, G @ w64, gh, "grad hidden")
    check(leaves[1].grad, G.T @ clean, gw, "grad weight")
    check(leaves[2].grad, G.sum(0), gb, "grad bias")


def test_fused_head_matches_the_torch_backend_with_k_labels_and_padding():
    """A vocabulary-parallel head in a world of one: padded weight rows, K labels, -inf bias."""
    N, H, V, real = 64, 32, 520, 500
    h, w, b = _head_data(N, H, V, 24)
    b[7] = float("-inf")  # a masked token
    g = gen(25)
    labels = torch.randint(0, real, (N, 2), generator=g)
    labels[labels == 7] = 8
    labels[10] = IGNORE
    labels[11, 1] = IGNORE
    gl, ge = torch.randn(N, 2, generator=g), torch.randn(N, generator=g)
    out = {}
    for be in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        lp, ent = vp.vocab_parallel_log_probs_and_entropy_from_hidden(
            leaves[0], leaves[1], labels, bias_shard=leaves[2], vocab_size=real,
            temperature=0.9, vocab_chunk_size=128, backend=be,
        )  # fmt: skip
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        out[be] = (lp, ent, *(t.grad for t in leaves))
    for u, v in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(u, v, atol=2e-5, rtol=2e-5)
    gw, gb = out["triton"][3], out["triton"][4]
    assert (gw[real:] == 0).all() and (gb[real:] == 0).all() and torch.isfinite(gb).all()
    assert gb[7] == 0


def test_fused_head_is_deterministic_and_entropy_optional():
    N, H, V = 40, 16, 300
    h, w, _ = _head_data(N, H, V, 26)
    labels = torch.randint(0, V, (N,), generator=gen(27))
    runs = []
    for _ in range(2):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = R.log_probs_and_entropy_from_hidden(
            hl, wl, labels, vocab_chunk_size=64, backend="triton"
        )
        (lp.sum() + ent.sum()).backward()
        runs.append((lp, ent, hl.grad, wl.grad))
    for u, v in zip(*runs, strict=True):
        assert torch.equal(u, v)
    lp_only, none = R.log_probs_and_entropy_from_hidden(
        h, w, labels, return_entropy=False, vocab_chunk_size=64, backend="triton"
    )
    assert none is None and torch.equal(lp_only, runs[0][0].detach())


# ------------------------------------------------------------------ the layouts the GPU compile check covers


@pytest.mark.parametrize("temp_kind", ["none", "rows"])
def test_kl_and_sum_pi_squared_of_shifted_logits_against_fp64(blocks, temp_kind):
    """``x[:, :-1]`` of ``(B, S, V)`` logits: rows read through the offset table (in units of V)."""
    B, S, V = 3, 6, 160
    g = gen(41)
    z = torch.randn(B, S, V, generator=g) * 2
    r = z + 0.5 * torch.randn(B, S, V, generator=g)
    z[0, 1] = -1500.0 - torch.rand(V, generator=g)  # an all-negative row
    temp = 1.0 if temp_kind == "none" else torch.rand(B, S - 1, generator=g) + 0.5
    gk = torch.randn(B, S - 1, generator=g)
    zl, rl = z.clone().requires_grad_(), r.clone().requires_grad_()
    kl = R.kl_from_logits(zl[:, :-1], rl[:, :-1], temperature=temp, backend="triton")
    (kl * gk).sum().backward()
    t = temp if isinstance(temp, float) else temp.reshape(-1)
    ref = KLRef(z[:, :-1].reshape(-1, V), r[:, :-1].reshape(-1, V), t, gk.reshape(-1))
    check(kl.reshape(-1), ref.kl, ref.tol, "KL of shifted logits")
    check(zl.grad[:, :-1].reshape(-1, V), ref.gz, ref.gz_tol, "KL gradient, shifted logits")
    check(rl.grad[:, :-1].reshape(-1, V), ref.gr, ref.gr_tol, "KL gradient, shifted reference")
    assert (zl.grad[:, -1] == 0).all() and (rl.grad[:, -1] == 0).all()
    got = R.sum_pi_squared_from_logits(z[:, :-1], temperature=temp, backend="triton")
    zz = z[:, :-1].reshape(-1, V).double() / (t if isinstance(t, float) else t.double()[:, None])
    want = (log_softmax64(zz).exp() ** 2).sum(-1)
    check(got.reshape(-1), want, 4 * row_delta(zz) * want, "Σ π² of shifted logits")


def test_shifted_logits_with_vocab_padding_against_fp64(blocks):
    """``x[:, :-1]`` of a shard whose last columns are padding: offsets and a padded load width."""
    B, S, V, real = 2, 5, 96, 83  # loads 96 columns, uses 83
    g = gen(42)
    x = torch.randn(B, S, V, generator=g) * 3
    x[..., real:] = float("nan")  # padding values are never used
    labels = torch.randint(0, real, (B, S - 1), generator=g)
    gl, ge = torch.randn(B, S - 1, generator=g), torch.randn(B, S - 1, generator=g)
    leaf = x.clone().requires_grad_()
    lp, ent = vp.vocab_parallel_log_probs_and_entropy(
        leaf[:, :-1], labels, vocab_size=real, temperature=0.9, backend="triton"
    )
    (lp * gl + ent * ge).sum().backward()
    rows = x[:, :-1, :real].reshape(-1, V - (V - real))
    ref = LogitsRef(rows, labels.reshape(-1), 0.9, gl.reshape(-1), ge.reshape(-1))
    grad = leaf.grad[:, :-1, :real].reshape(-1, real)
    _check_lp_ent((lp.reshape(-1), ent.reshape(-1), grad), ref, "shifted shard with padding")
    assert (leaf.grad[..., real:] == 0).all() and (leaf.grad[:, -1] == 0).all()


def test_packed_rows_gradient_against_fp64_with_unpicked_rows(blocks):
    """Each row of the logits is written once: picked rows their summed gradient, the others zeros
    (even where the gradient buffer held junk: it is never zero-filled first)."""
    V = 130
    g = gen(43)
    x = torch.randn(7, V, generator=g) * 2
    rows = torch.tensor([5, 0, 5, 2, 0, 5])  # rows 1, 3, 4 and 6 unpicked
    labels = torch.randint(0, V, (6, 1), generator=g)
    x_dirty = x.clone()
    x_dirty[[1, 3]] = float("nan")
    gl, ge = torch.randn(6, generator=g), torch.randn(6, generator=g)
    cfg = OpConfig(backend="triton", want_entropy=True)
    leaf = x_dirty.clone().requires_grad_()
    lp, ent, *_ = LogProbsEntropyFunction.apply(leaf, labels, None, rows, None, None, cfg)
    ((lp[:, 0] * gl).sum() + (ent * ge).sum()).backward()
    ref = LogitsRef(x[rows], labels, 1.0, gl, ge)
    check(lp[:, 0], ref.lp[:, 0], ref.tol, "packed log-probs")
    check(ent, ref.H, ref.tol, "packed entropy")
    want = torch.zeros(7, V, dtype=torch.float64).index_add_(0, rows, ref.grad)
    tol = torch.zeros(7, V, dtype=torch.float64).index_add_(0, rows, ref.grad_tol)
    check(leaf.grad, want, tol, "packed gradient")
    assert (leaf.grad[[1, 3, 4, 6]] == 0).all()


def test_auto_self_check_passes_under_the_interpreter_and_a_broken_kernel_falls_back(monkeypatch):
    """``"auto"`` runs the triton backend's self-check (here through the interpreter) once per
    family; a kernel made wrong fails it, and ``"auto"`` then uses the torch backend with one
    warning."""
    import dataclasses

    import rlmath.engine.triton_backend as tb

    monkeypatch.setattr(backends, "_CHECKS", {})
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    got = R.log_probs_from_logits(x, labels)
    assert backends._CHECKS == {("triton", "logits", "cpu", torch.float32): None}
    assert torch.equal(got, R.log_probs_from_logits(x, labels, backend="triton"))

    def wrong_stats(*args, **kwargs):  # log-sum-exps 1 % off, as a miscompiled kernel might
        m, s, t, z = tb.TRITON_KERNELS.logits_stats(*args, **kwargs)
        return m, s * 1.01, t, z

    kernels = dataclasses.replace(tb.TRITON_KERNELS, logits_stats=wrong_stats)
    monkeypatch.setitem(
        backends._BACKENDS, "triton", dataclasses.replace(tb.TRITON_BACKEND, kernels=kernels)
    )
    monkeypatch.setattr(backends, "_CHECKS", {})
    with pytest.warns(
        RuntimeWarning, match="'triton' backend failed its self-check for the logits"
    ):
        got = R.log_probs_from_logits(x, labels)
    assert torch.equal(got, R.log_probs_from_logits(x, labels, backend="torch"))


# ------------------------------------------------------------------ a sampler's kept set

_KEPT_CASES = {
    "vllm top_p": dict(top_p=0.9),
    "vllm top_k top_p min_p per row": "per-row",
    "sglang top_k top_p": dict(sampler="sglang", top_k=20, top_p=0.7),
    "hf top_k top_p min_p": dict(sampler="hf", top_k=30, top_p=0.8, min_p=0.02),
    "replayed ids": "ids",
    "replayed mask": "mask",
}


def _kept_inputs(case: str, N: int, V: int, g: torch.Generator) -> dict:
    spec = _KEPT_CASES[case]
    if spec == "per-row":
        return dict(
            top_k=torch.randint(1, 60, (N,), generator=g),
            top_p=torch.rand(N, generator=g) * 0.6 + 0.4,
            min_p=torch.rand(N, generator=g) * 0.1,
        )
    if spec in ("ids", "mask"):
        ids = torch.randint(0, V - 3, (N, 25), generator=g)
        ids[1, 4:] = -1  # padding
        ids[2] = ids[2, :1]  # one id, repeated
        if spec == "ids":
            return dict(kept=ids)
        mask = torch.zeros(N, V, dtype=torch.bool)
        mask.scatter_(1, ids.clamp_min(0), True)
        mask[1] = False
        mask[1, ids[1, :4]] = True
        return dict(kept=mask)
    return dict(spec)


def _kept_reference_mask(x, labels, temp, kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 ``(kept mask, outside, kept_count)`` from the engines' per-row rules."""
    from tests.logprobs.sampling_reference import reference

    kept = kw.get("kept")
    if kept is not None and kept.dtype != torch.bool:
        mask = torch.zeros(x.shape, dtype=torch.bool)
        mask.scatter_(1, kept.clamp_min(0), kept >= 0)
        kept = mask
    ref_kw = {k: v for k, v in kw.items() if k != "kept"}
    _, _, outside, count, mask = reference(x, labels, temperature=temp, kept=kept, **ref_kw)
    return mask, outside, count


@pytest.mark.parametrize("case", list(_KEPT_CASES))
def test_kept_set_log_probs_entropy_and_gradient_against_fp64(blocks, case):
    """The kept-set kernels (a threshold, a replayed mask, replayed ids located per block) give
    the log-softmax over the kept set with the labels added: values and gradients within the
    fp32 bounds of the fp64 reference of the masked logits; ``outside`` and the kept-set sizes
    exactly the engines' rule."""
    N, V = 24, 300
    g = gen(40)
    x = torch.randn(N, V, generator=g) * 3
    x[:, V - 3 :] = float("-inf")  # padded vocabulary
    x[3, :200] = float("-inf")  # an all -inf tail
    labels = torch.randint(0, V - 3, (N,), generator=g)
    labels[3] = 250  # a finite logit of the row with the -inf tail
    temp = torch.rand(N, generator=g) + 0.5
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    kw = _kept_inputs(case, N, V, g)
    x_before = x.clone()
    leaf = x.clone().requires_grad_()
    out = R.log_probs_and_entropy_from_logits(
        leaf, labels, temperature=temp, kept_stats=True, backend="triton", **kw
    )
    (out.log_probs * gl + out.entropy * ge).sum().backward()
    assert torch.equal(x, x_before)
    mask, outside, count = _kept_reference_mask(x, labels, temp, kw)
    assert torch.equal(out.outside, outside)
    assert torch.equal(out.kept_count, count)
    full = mask.clone()
    full[torch.arange(N), labels] = True
    ref = LogitsRef(x.masked_fill(~full, float("-inf")), labels, temp, gl, ge)
    _check_lp_ent((out.log_probs, out.entropy, leaf.grad), ref, case)
    assert (leaf.grad[~full] == 0).all()


def test_kept_set_log_probs_only_and_k_labels_match_the_torch_backend(blocks):
    """``log_probs_from_logits`` (the one-label gradient) and ``(N, K)`` labels with ignored
    candidates, scalar temperature: the kept-set kernels against the torch backend."""
    N, V, K = 20, 257, 3
    g = gen(41)
    x = torch.randn(N, V, generator=g) * 2
    labels = torch.randint(0, V, (N, K), generator=g)
    labels[2, 1] = IGNORE
    labels[5] = IGNORE
    out = {}
    for be in ("torch", "triton"):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        lp1 = R.log_probs_from_logits(a, labels[:, 0].clamp_min(0), top_p=0.8, backend=be)
        lpk = R.log_probs_from_logits(
            b, labels, temperature=0.7, top_k=40, ignore_index=IGNORE, backend=be
        )
        lp1.sum().backward()
        (lpk * torch.arange(1.0, K + 1)).sum().backward()
        out[be] = (lp1, a.grad, lpk, b.grad)
    for u, w in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(u, w, atol=2e-5, rtol=1e-5)


def test_kept_set_response_functions_dense_and_packed_match_the_torch_backend():
    """The response functions read their rows in place (dense) and through an offset table with
    repeated rows summed in backward (packed): kept-set kernels against the torch backend."""
    B, S, V, Rl = 3, 9, 131, 4
    g = gen(42)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    logits = torch.randn(B, S, V, generator=g) * 2
    packed = logits.reshape(B * S, V)[mask.bool().view(-1)]
    temp = torch.rand(B, 1, generator=g) + 0.5
    kept = torch.randint(0, V, (B, Rl, 12), generator=g)
    out = {}
    for be in ("torch", "triton"):
        dense, flat = logits.clone().requires_grad_(), packed.clone().requires_grad_()
        a = R.log_probs_from_logits_response(
            ids, dense, Rl, temperature=temp, top_p=0.85, top_k=50, backend=be
        )
        b = R.log_probs_from_logits_response_rmpad(
            ids, mask, flat, Rl, temperature=temp, top_p=0.85, backend=be
        )
        c = R.log_probs_from_logits_response_rmpad(ids, mask, flat, Rl, kept=kept, backend=be)
        (a.sum() + 2 * b.sum() + 3 * c.sum()).backward()
        out[be] = (a, b, c, dense.grad, flat.grad)
    for u, w in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(u, w, atol=2e-5, rtol=1e-5)


def test_kept_set_fused_head_matches_the_torch_backend():
    """The fused head's kept sets run each block's logits through the chosen backend."""
    N, H, V = 12, 16, 200
    g = gen(43)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    out = {}
    for be in ("torch", "triton"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = R.log_probs_and_entropy_from_hidden(
            hh, ww, labels, temperature=0.9, top_p=0.9, backend=be
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
        out[be] = (lp, ent, hh.grad, ww.grad)
    for u, v in zip(out["triton"], out["torch"], strict=True):
        torch.testing.assert_close(u, v, atol=2e-5, rtol=1e-5)


def _kept_shard_worker() -> dict[str, tuple[torch.Tensor, ...]]:
    """Rank 0 holds tokens [0, 90), rank 1 [90, 300) of which 200 are real (vocab_size 290)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    N = 16
    g = gen(44)
    x_full = torch.randn(N, 300, generator=g) * 2
    labels = torch.randint(0, 290, (N,), generator=g)
    start, width = (0, 90) if rank == 0 else (90, 210)
    shard = R.VocabParallel(group=dist.group.WORLD, start=start)
    out = {}
    for be in ("torch", "triton"):
        leaf = x_full[:, start : start + width].clone().requires_grad_()
        res = R.log_probs_and_entropy_from_logits(
            leaf, labels, temperature=0.8, top_k=30, top_p=0.9, kept_stats=True,
            vocab_size=290, vocab_parallel=shard, backend=be,
        )  # fmt: skip
        (res.log_probs.sum() + 0.5 * res.entropy.sum()).backward()
        out[be] = (res.log_probs.detach(), res.entropy.detach(), leaf.grad, res.outside,
                   res.kept_count)  # fmt: skip
    return out


@pytest.mark.integration
def test_kept_set_over_vocabulary_shards_matches_the_torch_backend():
    """Two gloo ranks of uneven shards: the global thresholds (the sharded search) applied by the
    kept-set kernels equal the torch backend's result; counts and ``outside`` exactly."""
    from rlmath.distributed import run_distributed

    for out in run_distributed(_kept_shard_worker, 2):
        for a, b in zip(out["triton"][:3], out["torch"][:3], strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        assert torch.equal(out["triton"][3], out["torch"][3])
        assert torch.equal(out["triton"][4], out["torch"][4])


def test_auto_self_checks_the_kept_set_kernels_as_their_own_family(monkeypatch):
    monkeypatch.setattr(backends, "_CHECKS", {})
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    got = R.log_probs_from_logits(x, labels, top_p=0.9)
    assert backends._CHECKS == {("triton", "kept", "cpu", torch.float32): None}
    assert torch.equal(got, R.log_probs_from_logits(x, labels, top_p=0.9, backend="triton"))


@pytest.mark.parametrize("sampler_kw", [{}, {"top_k": 40, "top_p": 0.8}], ids=["plain", "kept"])
def test_a_row_alone_and_packed_rows_equal_the_batch_and_the_padded_rows_bitwise(sampler_kw):
    """Layout invariance of the kernels, each backend with itself: a row alone equals the same
    row in a batch of 7 and of 24 (values and gradient), and the packed response function
    equals the dense one on the same tokens (values and the gradient of each row), under a
    sampler's kept set too."""
    N, V = 24, 300
    g = gen(45)
    x = torch.randn(N, V, generator=g) * 3
    labels = torch.randint(0, V, (N,), generator=g)
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    full = _run_lp_ent(x, labels, 0.8, gl, ge, **sampler_kw)
    for n in (1, 7):
        part = _run_lp_ent(x[:n], labels[:n], 0.8, gl[:n], ge[:n], **sampler_kw)
        for u, w in zip(part, full, strict=True):
            assert torch.equal(u, w[:n])
    B, S, Rl = 3, 8, 4
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    dense = (torch.randn(B, S, V, generator=g) * 2).requires_grad_()
    packed = dense.detach().reshape(B * S, V).clone().requires_grad_()
    a = R.log_probs_from_logits_response(ids, dense, Rl, backend="triton", **sampler_kw)
    b = R.log_probs_from_logits_response_rmpad(
        ids, mask, packed, Rl, backend="triton", **sampler_kw
    )
    assert torch.equal(a, b)
    (a * torch.arange(1.0, Rl + 1)).sum().backward()
    (b * torch.arange(1.0, Rl + 1)).sum().backward()
    assert torch.equal(dense.grad.reshape(B * S, V), packed.grad)
