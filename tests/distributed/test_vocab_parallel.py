"""Vocabulary-parallel log-probs, entropy, KL and fused head equal the single-process functions.

Real collectives: gloo, tensor-parallel sizes 2 and 4 (one spawn per size runs
every case). Each rank's values must equal the single-process rlmath function
on the whole vocabulary and an fp64 reference written from the math; the
gradients of the ranks, put side by side, must equal the single-process
gradient (zero on padding columns).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.autograd import gradcheck

import rlmath as R
from rlmath import VocabParallel
from rlmath.distributed import run_distributed
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    log_probs_from_logits_response_rmpad,
)
from tests.memory_tracker import MemoryTracker

from .tp_workers import CASES, IGNORE, RMPAD_R, Case, build, layout, rmpad_problem, tp_worker

WORLDS = [2, 4]

# The vocabulary-parallel calls in a world of one (torch.distributed not initialized).
_ONE = {"vocab_parallel": VocabParallel()}
lp_vp = functools.partial(R.log_probs_from_logits, **_ONE)
ent_vp = functools.partial(R.entropy_from_logits, **_ONE)
lp_ent_vp = functools.partial(R.log_probs_and_entropy_from_logits, **_ONE)
kl_vp = functools.partial(R.kl_from_logits, **_ONE)
pi2_vp = functools.partial(R.sum_pi_squared_from_logits, **_ONE)
head_vp = functools.partial(R.log_probs_and_entropy_from_hidden, **_ONE)
rmpad_vp = functools.partial(R.log_probs_from_logits_response_rmpad, **_ONE)


def tol(case: Case) -> dict:
    if case.dtype == torch.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    return {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def tp_results():
    """``{world: [rank results]}``: one spawn per tensor-parallel size."""
    names = [c.name for c in CASES]
    return {w: run_distributed(tp_worker, w, names) for w in WORLDS}


# ---------------------------------------------------------------- references


def _masked_lp(lp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.where(labels == IGNORE, 0, lp)


def _safe_labels(labels: torch.Tensor) -> torch.Tensor:
    return torch.where(labels == IGNORE, 0, labels)


def math_reference(logits, ref_logits, labels, temperature):
    """fp64 log-probs, entropy and KL written from the definitions (autograd for gradients)."""
    # A tensor temperature broadcasts to the batch shape: one more dim for the vocabulary.
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    z = logits / t
    ls = torch.log_softmax(z, -1)
    p = ls.exp()
    ls_safe = torch.where(p > 0, ls, 0)
    lab = _safe_labels(labels)
    lab_k = lab if lab.dim() == logits.dim() else lab.unsqueeze(-1)
    lp = ls.gather(-1, lab_k)
    lp = lp if lab.dim() == logits.dim() else lp.squeeze(-1)
    ent = -(p * ls_safe).sum(-1)
    kl = None
    if ref_logits is not None:
        lr = torch.log_softmax(ref_logits / t, -1)
        lr_safe = torch.where(p > 0, lr, 0)
        kl = (p * (ls_safe - lr_safe)).sum(-1)
    return _masked_lp(lp, labels), ent, kl


def single_process_logits(case: Case, world: int, fn: str) -> dict:
    return _single_process_logits(case, layout(case, world)[0], fn)


@functools.cache
def _single_process_logits(case: Case, padded: int, fn: str) -> dict:
    """Values and full-vocabulary gradients from rlmath.log_probs (``fn="rlmath"``) or the math.

    Depends on the world size only through the padded width (cached on it).
    """
    data = build(case, padded)
    v = case.vocab
    x = data["logits"][..., :v]
    ref = data["ref_logits"][..., :v]
    labels, temp, coef = data["labels"], data["temperature"], data["coef"]
    if fn == "math":
        x, ref = x.double(), ref.double()
        temp = temp.double() if isinstance(temp, torch.Tensor) else temp
    leaves = [x.clone().requires_grad_() for _ in range(4)]
    ref_leaf = ref.clone().requires_grad_()
    if fn == "rlmath":
        lab = _safe_labels(labels)
        lp = _masked_lp(log_probs_from_logits(leaves[0], lab, temperature=temp), labels)
        ent = entropy_from_logits(leaves[1], temperature=temp)
        lp2, ent2 = log_probs_and_entropy_from_logits(
            leaves[2], labels, temperature=temp, ignore_index=IGNORE
        )
        kl = kl_from_logits(leaves[3], ref_leaf, temperature=temp)
    else:
        lp, _, _ = math_reference(leaves[0], None, labels, temp)
        _, ent, _ = math_reference(leaves[1], None, labels, temp)
        lp2, ent2, _ = math_reference(leaves[2], None, labels, temp)
        # A row whose labels are all ignored is skipped: entropy 0 as well.
        dead = labels == IGNORE if labels.dim() == x.dim() - 1 else (labels == IGNORE).all(-1)
        ent2 = torch.where(dead, 0, ent2)
        _, _, kl = math_reference(leaves[3], ref_leaf, labels, temp)

    def loss(c, y):
        return (c.to(y.dtype) * y).sum()

    total = loss(coef[0], lp) + loss(coef[1], ent) + loss(coef[2], lp2) + loss(coef[3], ent2)
    (total + loss(coef[5], kl)).backward()
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "lp2": lp2.detach(),
        "ent2": ent2.detach(),
        "kl": kl.detach(),
        "grad_lp": leaves[0].grad,
        "grad_ent": leaves[1].grad,
        "grad_lp_ent": leaves[2].grad,
        "grad_kl": leaves[3].grad,
        "grad_kl_ref": ref_leaf.grad,
    }


def single_process_head(case: Case, world: int, fn: str) -> dict:
    return _single_process_head(case, layout(case, world)[0], fn)


@functools.cache
def _single_process_head(case: Case, padded: int, fn: str) -> dict:
    """The unsharded head: rlmath.fused_head (``fn="fused"``) or full logits + rlmath.log_probs.

    An ignored position gives log-prob and entropy 0 (the fused head's rule).
    """
    data = build(case, padded)
    v = case.vocab
    labels, coef, temp = data["labels"], data["coef"], data["temperature"]
    ignored = labels == IGNORE
    out = {}
    for bias in (True, False):
        h = data["hidden"].clone().requires_grad_()
        w = data["weight"][:v].clone().requires_grad_()
        b = data["bias"][:v].clone().requires_grad_() if bias else None
        if fn == "fused":
            lp, ent = log_probs_and_entropy_from_hidden(
                h, w, labels, bias=b, temperature=temp, ignore_index=IGNORE
            )
        else:
            logits = h @ w.T + b if b is not None else h @ w.T
            lp, ent = log_probs_and_entropy_from_logits(
                logits, _safe_labels(labels), temperature=temp
            )
            lp, ent = torch.where(ignored, 0, lp), torch.where(ignored, 0, ent)
        if b is not None:
            ((coef[0].to(lp.dtype) * lp).sum() + (coef[1].to(ent.dtype) * ent).sum()).backward()
            out.update(
                lp=lp.detach(),
                ent=ent.detach(),
                grad_hidden=h.grad,
                grad_weight=w.grad,
                grad_bias=b.grad,
            )
        else:
            (coef[2].to(lp.dtype) * lp).sum().backward()
            out.update(lp_nb=lp.detach(), grad_hidden_nb=h.grad, grad_weight_nb=w.grad)
    return out


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    pad = torch.zeros(*x.shape[:-1], width - x.shape[-1], dtype=x.dtype)
    return torch.cat([x, pad], -1)


def _gathered(results, case: Case, world: int, key: str, dim: int = -1) -> torch.Tensor:
    """The ranks' gradient shards side by side (in vocabulary order)."""
    _, shards = layout(case, world)
    order = sorted(range(world), key=lambda r: shards[r][0])
    return torch.cat([results[r][case.name][key] for r in order], dim)


def _close(got, want, case, **extra):
    kw = tol(case) | extra
    torch.testing.assert_close(got, want.to(got.dtype), **kw)


LOGIT_CASES = [c for c in CASES if not c.hidden]
HEAD_CASES = [c for c in CASES if c.hidden]
VALUE_KEYS = ("lp", "ent", "lp2", "ent2", "kl")
GRAD_KEYS = ("grad_lp", "grad_ent", "grad_lp_ent", "grad_kl", "grad_kl_ref")


def _applies(case: Case, world: int) -> bool:
    return not (case.layout == "even" and case.vocab % world)


# ---------------------------------------------------------------- tests


@pytest.mark.integration
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", LOGIT_CASES, ids=lambda c: c.name)
def test_logits_functions_equal_single_process(tp_results, case, world):
    if not _applies(case, world):
        pytest.skip("vocabulary does not divide evenly")
    results = tp_results[world]
    padded, _ = layout(case, world)
    refs = [single_process_logits(case, world, "rlmath")]
    if case.dtype != torch.bfloat16:
        refs.append(single_process_logits(case, world, "math"))
    grad_tol = {"rtol": 2e-2, "atol": 2e-2} if case.dtype == torch.bfloat16 else {}
    value_tol = {"rtol": 1e-5, "atol": 1e-5} if case.dtype == torch.bfloat16 else {}
    for exp in refs:
        for res in results:
            r = res[case.name]
            assert r["unchanged"], "the caller's logits were modified"
            for key in VALUE_KEYS:
                _close(r[key], exp[key], case, **value_tol)
            _close(r["lp_chunk3"], exp["lp"], case, **value_tol)
            _close(r["validated"], exp["lp2"], case, **value_tol)
        for key in GRAD_KEYS:
            got = _gathered(results, case, world, key)
            _close(got, _pad_last(exp[key], padded), case, **grad_tol)
    # Σπ² against the definition (fp64), on the real columns.
    data = build(case, padded)
    z = data["logits"][..., : case.vocab].double()
    t = data["temperature"]
    t = t.double().unsqueeze(-1) if isinstance(t, torch.Tensor) else t
    want = torch.softmax(z / t, -1).square().sum(-1)
    for res in results:
        _close(res[case.name]["sum_pi_sq"], want, case, **value_tol)
    # Outputs are replicated: bitwise the same on every rank.
    for res in results[1:]:
        for key in VALUE_KEYS:
            assert torch.equal(res[case.name][key], results[0][case.name][key])


@pytest.mark.integration
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", HEAD_CASES, ids=lambda c: c.name)
def test_fused_head_equals_single_process(tp_results, case, world):
    if not _applies(case, world):
        pytest.skip("vocabulary does not divide evenly")
    results = tp_results[world]
    padded, _ = layout(case, world)
    for fn in ("fused", "logits"):
        exp = single_process_head(case, world, fn)
        for res in results:
            r = res[case.name]
            assert r["ent_none"]
            for key in ("lp", "ent", "lp_nb", "grad_hidden"):
                _close(r[key], exp[key], case)
        # reduce_grad_hidden=False: the ranks' parts add up to the unsharded gradient.
        parts = torch.stack([res[case.name]["grad_hidden_nb"] for res in results])
        _close(parts.sum(0), exp["grad_hidden_nb"], case)
        assert not torch.allclose(parts[0], exp["grad_hidden_nb"].to(parts.dtype))
        for key in ("grad_weight", "grad_weight_nb"):
            got = _gathered(results, case, world, key, dim=0)
            zeros = exp[key].new_zeros(padded - case.vocab, exp[key].shape[1])
            _close(got, torch.cat([exp[key], zeros]), case)
        got = _gathered(results, case, world, "grad_bias", dim=0)
        _close(got, _pad_last(exp["grad_bias"], padded), case)
    # grad_hidden is all-reduced: identical bits on every rank.
    for res in results[1:]:
        for key in ("grad_hidden", "lp", "ent"):
            assert torch.equal(res[case.name][key], results[0][case.name][key])


@pytest.mark.integration
def test_tensor_parallel_subgroups(tp_results):
    """World 4 split into two TP groups of 2: each group equals the single process."""
    case = next(c for c in CASES if c.name == "pad_inf_f64")
    padded, _ = layout(case, 2)
    exp = single_process_logits(case, 2, "math")
    results = tp_results[4]
    for pair in ([0, 1], [2, 3]):
        for r in pair:
            for key in VALUE_KEYS:
                _close(results[r]["subgroup"][key], exp[key], case)
        for key in GRAD_KEYS:
            got = torch.cat([results[r]["subgroup"][key] for r in pair], -1)
            _close(got, _pad_last(exp[key], padded), case)


@pytest.mark.integration
@pytest.mark.parametrize("world", WORLDS)
def test_response_rmpad_equals_single_process(tp_results, world):
    ids, mask, logits, temperature, coef = rmpad_problem()
    x = logits.clone().requires_grad_()
    want = log_probs_from_logits_response_rmpad(ids, mask, x, RMPAD_R, temperature=temperature)
    (coef * want).sum().backward()
    results = tp_results[world]
    for res in results:
        torch.testing.assert_close(res["rmpad"]["logp"], want.detach(), rtol=1e-10, atol=1e-10)
    grad = torch.cat([res["rmpad"]["grad"] for res in results], -1)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-10)
    assert (want.detach() != 0).sum() > 6  # the case is not trivially zero


@pytest.mark.integration
@pytest.mark.parametrize("world", WORLDS)
def test_validate_catches_bad_layouts_on_every_rank(tp_results, world):
    for res in tp_results[world]:
        v = res["validation"]
        assert "tile" in v["overlap"] and "vocab_start_index" in v["overlap"]
        assert "labels must lie in" in v["label_range"]
        assert "same tokens" in v["rows"]
        assert "same labels" in v["labels_differ"]
        assert v["ok"] == ""


@pytest.mark.integration
@pytest.mark.parametrize("world", WORLDS)
def test_example_matches_single_process(tp_results, world):
    """examples/distributed_logprobs.py (run inside the same spawn) reports tiny differences."""
    for res in tp_results[world]:
        diffs = res["example"]
        assert set(diffs) == {"log_probs", "entropy", "grad_logits"}
        assert max(diffs.values()) < 1e-10


# ------------------------------------------------- single process (world of one)


def _problem(seed=0, rows=(3, 5), vocab=13, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, vocab, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, rows, generator=g)
    labels[0, 0] = IGNORE
    temp = torch.rand(rows[0], 1, generator=g, dtype=dtype) + 0.5
    return x, labels, temp


def test_gradcheck_log_probs_entropy_world_one():
    x, labels, temp = _problem()
    x.requires_grad_()

    def f(z):
        return lp_ent_vp(z, labels, temperature=temp, chunk_size=4)

    assert gradcheck(f, (x,))
    assert gradcheck(lambda z: ent_vp(z, temperature=0.7, chunk_size=2), (x,))
    # Padding columns (vocab_size) are out of the softmax and get no gradient.
    assert gradcheck(
        lambda z: lp_vp(z, labels.clamp(max=9), vocab_size=10, chunk_size=4),
        (x,),
    )
    lp = lp_vp(x, labels.clamp(max=9), vocab_size=10)
    lp.sum().backward()
    assert (x.grad[..., 10:] == 0).all()
    want = log_probs_from_logits(x[..., :10], _safe_labels(labels.clamp(max=9)))
    torch.testing.assert_close(lp, _masked_lp(want, labels), rtol=1e-12, atol=1e-12)


def test_gradcheck_kl_world_one():
    x, _, temp = _problem(1)
    ref = (x * 0.5 + 0.1).clone().requires_grad_()
    x.requires_grad_()
    assert gradcheck(
        lambda z, r: kl_vp(z, r, temperature=temp, chunk_size=2),
        (x, ref),
    )


def test_gradcheck_fused_head_world_one():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (2, 3), generator=g)
    labels[1, 2] = IGNORE

    def f(h, w, b):
        return head_vp(
            h,
            w,
            labels,
            bias=b,
            temperature=1.3,
            vocab_size=9,
            chunk_size=4,
            vocab_chunk_size=4,
        )

    assert gradcheck(f, (h, w, b))


def test_fused_head_never_reads_ignored_rows():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(4, 6, generator=g, dtype=torch.float64)
    h[1] = float("nan")  # a padding position
    h.requires_grad_()
    w = torch.randn(10, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, IGNORE, 5, 0])
    lp, ent = head_vp(h, w, labels, chunk_size=2)
    assert lp[1] == 0 and ent[1] == 0
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(w.grad).all() and (h.grad[1] == 0).all()
    assert torch.isfinite(h.grad).all()


def test_world_one_equals_single_process_and_keeps_inputs():
    x, labels, temp = _problem(3, dtype=torch.float32)
    before = x.clone()
    lp, ent = lp_ent_vp(x, labels, temperature=temp)
    want_lp, want_ent = log_probs_and_entropy_from_logits(
        x, labels, temperature=temp, ignore_index=IGNORE
    )
    # A world of one is the single-process operation itself: bitwise the same.
    assert torch.equal(lp, want_lp) and torch.equal(ent, want_ent)
    full_lp, full_ent = log_probs_and_entropy_from_logits(x, _safe_labels(labels), temperature=temp)
    torch.testing.assert_close(lp, _masked_lp(full_lp, labels), rtol=1e-6, atol=1e-6)
    live = labels != IGNORE
    assert torch.equal(ent[live], full_ent[live]) and (ent[~live] == 0).all()
    assert lp.dtype == torch.float32 and lp[0, 0] == 0
    assert torch.equal(x, before)


MEM_N, MEM_V, MEM_CHUNK = 384, 1000, 8


def _tracked(fn, *inputs):
    with MemoryTracker() as mem:
        mem.phase = "forward"
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        mem.phase = "backward"
        sum(o.sum() for o in outs if o is not None).backward()
    return mem


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_is_bounded_world_one(dtype):
    """No (N, V/tp) temporary: forward holds chunk buffers, backward only the gradients."""
    x = torch.randn(MEM_N, MEM_V).to(dtype).requires_grad_()
    r = torch.randn(MEM_N, MEM_V).to(dtype).requires_grad_()
    labels = torch.randint(0, 900, (MEM_N,))
    kw = {"chunk_size": MEM_CHUNK, "vocab_size": 900}
    fns = [
        lambda x: lp_ent_vp(x, labels, temperature=0.8, **kw),
        lambda x: ent_vp(x, **kw),
        lambda x: kl_vp(x, r, **kw),
    ]
    n_v = MEM_N * MEM_V
    # A few fp32 chunk buffers and per-row numbers; an fp32 (N, V) copy is 8 times more.
    scratch = 4 * (4 * MEM_CHUNK * MEM_V) + 64 * MEM_N
    assert scratch * 8 <= 4 * n_v
    for i, fn in enumerate(fns):
        x.grad = r.grad = None
        mem = _tracked(fn, x)
        assert mem.largest(phase="forward") <= 8 * MEM_CHUNK * MEM_V
        assert mem.peak_by_phase["forward"] <= scratch
        grads = [x, r] if i == 2 else [x]
        big = mem.allocations_at_least(n_v, phase="backward")
        assert sorted((a.shape, a.dtype) for a in big) == [((MEM_N, MEM_V), dtype)] * len(grads)
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        assert mem.peak_by_phase["backward"] <= grad_bytes + scratch


def test_fused_head_never_allocates_the_logits_world_one():
    n, v, h = 512, 1000, 32
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    mem = _tracked(
        lambda a, b: head_vp(a, b, labels, chunk_size=64, vocab_chunk_size=256),
        hidden,
        weight,
    )
    # A block is 64 x 256; the weight gradient (v, h) is the largest allocation.
    assert mem.largest() <= 4 * v * h
    assert mem.peak_by_phase["backward"] <= 0.2 * 4 * n * v


def test_bf16_logits_give_fp32_results():
    x, labels, _ = _problem(4, dtype=torch.bfloat16)
    x.requires_grad_()
    lp = lp_vp(x, labels)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_bad_input():
    x, labels, _ = _problem()
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        lp_vp(x, labels, temperature=0.0)
    # Any ignore_index is accepted, a token id too (as in one process): those labels
    # are skipped.
    ig = lp_vp(x, labels.clamp(min=0), ignore_index=3)
    assert (ig[labels.clamp(min=0) == 3] == 0).all()
    lp_vp(x, labels.clamp(min=0), ignore_index=20, vocab_size=13)
    with pytest.raises(ValueError, match="vocab_parallel.start must be >= 0"):
        R.entropy_from_logits(x, vocab_parallel=VocabParallel(start=-1))
    with pytest.raises(TypeError, match="vocab_parallel must be an rlmath.VocabParallel"):
        R.entropy_from_logits(x, vocab_parallel={"group": None})
    with pytest.raises(TypeError, match="vocab_size must be an int"):
        ent_vp(x, vocab_size=12.5)
    with pytest.raises(ValueError, match="labels must have shape"):
        lp_vp(x, labels[:, :2])
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        lp_vp(x, labels.double())
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        ent_vp(labels)
    with pytest.raises(ValueError, match="ref_logits must have the shape of logits"):
        kl_vp(x, x[:, :2])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 13\)"):
        lp_vp(x, labels + 13, validate=True)
    h = torch.randn(3, 5, 4, dtype=torch.float64)
    w = torch.randn(13, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight must have shape \(V/tp, H\)"):
        head_vp(h, w[:, :3], labels)
    with pytest.raises(ValueError, match=r"bias must have shape \(V,\) = \(13,\)"):
        head_vp(h, w, labels, bias=torch.zeros(12, dtype=torch.float64))
    # Mixed dtypes are promoted (to fp64 here), as in one process.
    lp_mixed, _ = head_vp(h, w.float(), labels)
    assert lp_mixed.dtype == torch.float64
    ids, mask = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
    packed = torch.zeros(10, 7, dtype=torch.float64)
    rmpad = rmpad_vp
    with pytest.raises(ValueError, match=r"response_length must be in \[1, 5\]"):
        rmpad(ids, mask, packed, 6)
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        rmpad(ids, mask[:, :4], packed, 2)
    with pytest.raises(ValueError, match=r"one row per valid token \(10\), got 9"):
        rmpad(ids, mask, packed[:9], 2, validate=True)
    with pytest.raises(TypeError, match="input_ids must be an integer tensor"):
        rmpad(ids.float(), mask, packed, 2)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        pi2_vp(x, temperature=-1.0)
