"""Log-probs under a sampler's kept set (top-k / top-p / min-p) against per-row fp64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlmath
from rlmath import log_probs_and_entropy_from_logits, log_probs_from_logits
from tests.logprobs.sampling_reference import kept_row, reference

SAMPLERS = ["vllm", "sglang", "hf"]
N, V = 13, 37


def _data(seed: int = 0, dtype=torch.float64):
    """Logits with ties (rows on a coarse grid), -inf tails, and labels inside and outside."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    x[::2] = (x[::2] * 2).round() / 2  # even rows on a grid of 0.5: many ties
    x[3, -10:] = -math.inf
    x[7, 5:] = -math.inf  # five finite logits
    x[8, :] = 1.25  # every logit tied
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:6] = x[:6].argmax(-1)  # surely inside
    labels[7] = 2
    return x.to(dtype), labels


def _per_row(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 12, (N,), generator=g)
    k[0], k[1] = V, V + 5  # no top-k on these rows
    p = torch.rand(N, generator=g, dtype=torch.float64) * 0.9 + 0.05
    p[2] = 1.0  # no top-p
    mp = torch.rand(N, generator=g, dtype=torch.float64) * 0.3
    mp[4] = 0.0  # no min-p
    temp = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    return k, p, mp, temp


_K, _P, _MP, _T = _per_row()

COMBOS = {
    "k=1": dict(top_k=1),
    "k=5": dict(top_k=5),
    "k>=V": dict(top_k=V + 3),
    "p=0.3": dict(top_p=0.3),
    "p=0.9": dict(top_p=0.9),
    "p=1": dict(top_p=1.0),
    "min_p=0.1": dict(min_p=0.1),
    "min_p=0": dict(min_p=0.0),
    "k,p": dict(top_k=8, top_p=0.7),
    "k,min_p": dict(top_k=8, min_p=0.2),
    "p,min_p": dict(top_p=0.8, min_p=0.1),
    "k,p,min_p": dict(top_k=6, top_p=0.6, min_p=0.05),
    "per-row k": dict(top_k=_K),
    "per-row p": dict(top_p=_P),
    "per-row min_p": dict(min_p=_MP),
    "per-row k,p,min_p": dict(top_k=_K, top_p=_P, min_p=_MP),
    "per-row k, scalar p": dict(top_k=_K, top_p=0.75),
    "k=200": dict(top_k=200),
    "k=200,p": dict(top_k=200, top_p=0.8, min_p=0.01),
}
TEMPERATURES = {"T=1": 1.0, "T=0.7": 0.7, "per-row T": _T}


@pytest.mark.parametrize("temp", list(TEMPERATURES), ids=str)
@pytest.mark.parametrize("combo", list(COMBOS), ids=str)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_values_and_gradients_match_the_reference(sampler, combo, temp):
    x, labels = _data()
    kw = COMBOS[combo]
    T = TEMPERATURES[temp]
    leaf = x.clone().requires_grad_()
    got = log_probs_and_entropy_from_logits(
        leaf, labels, temperature=T, sampler=sampler, kept_stats=True, chunk_size=4, **kw
    )
    ref_leaf = x.clone().requires_grad_()
    logp, ent, outside, count, _ = reference(ref_leaf, labels, sampler=sampler, temperature=T, **kw)
    assert torch.equal(got.outside, outside)
    assert torch.equal(got.kept_count, count)
    torch.testing.assert_close(got.log_probs, logp.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got.entropy, ent.detach(), rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(5)
    w1, w2 = (
        torch.randn(N, generator=g, dtype=torch.float64),
        torch.randn(N, generator=g, dtype=torch.float64),
    )
    (got.log_probs * w1 + got.entropy * w2).sum().backward()
    (logp * w1 + ent * w2).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("combo", ["k,p,min_p", "per-row k,p,min_p", "p=0.3"])
def test_gradcheck_in_fp64(sampler, combo):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 11, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 11, (5,), generator=g)
    kw = {k: (v[:5] if isinstance(v, torch.Tensor) else v) for k, v in COMBOS[combo].items()}

    def f(x):
        lp, ent = log_probs_and_entropy_from_logits(
            x, labels, temperature=0.8, sampler=sampler, chunk_size=2, **kw
        )
        return lp, ent

    assert torch.autograd.gradcheck(f, (x,))


def _kept_mask(x, **kw):
    """rlmath's kept set, read through the public API: every token as a label, ``outside`` negated."""
    n, v = x.shape
    every = torch.arange(v).expand(n, v)
    return ~log_probs_from_logits(x, every, kept_stats=True, **kw).outside


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("combo", ["k,p,min_p", "per-row k,p,min_p", "p=0.9", "k=1"])
def test_replayed_kept_set_equals_recompute(sampler, combo):
    x, labels = _data(2)
    kw = dict(COMBOS[combo], sampler=sampler, temperature=_T)
    mask = _kept_mask(x, **kw)
    ref_mask = reference(x, labels, **kw)[4]
    assert torch.equal(mask, ref_mask)
    ids = torch.full((N, V), -1)
    lists = []
    for i in range(N):
        row = mask[i].nonzero().flatten()
        ids[i, : row.numel()] = row.flip(0)  # any order, padded with -1
        lists.append(row.tolist())
    results = []
    for kept in (None, mask, ids, lists):
        leaf = x.clone().requires_grad_()
        args = {"kept": kept, "temperature": _T, "sampler": sampler}
        if kept is None:
            args = kw
        out = log_probs_and_entropy_from_logits(leaf, labels, kept_stats=True, chunk_size=3, **args)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        results.append((out, leaf.grad))
    (want, want_grad), *replays = results
    for got, grad in replays:
        assert torch.equal(got.log_probs, want.log_probs)
        assert torch.equal(got.entropy, want.entropy)
        assert torch.equal(got.outside, want.outside)
        assert torch.equal(got.kept_count, want.kept_count)
        assert torch.equal(grad, want_grad)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_filters_that_cut_nothing_are_the_plain_call(sampler):
    x, labels = _data(4)
    plain_lp, plain_ent = log_probs_and_entropy_from_logits(x, labels, temperature=0.9)
    for kw in (dict(top_k=V), dict(top_k=V + 1), dict(top_p=1.0), dict(min_p=0.0)):
        lp, ent = log_probs_and_entropy_from_logits(
            x, labels, temperature=0.9, sampler=sampler, **kw
        )
        assert torch.equal(lp, plain_lp) and torch.equal(ent, plain_ent)
    # Per-row values that cut nothing run the truncating path: the same numbers.
    nothing = dict(
        top_k=torch.full((N,), V), top_p=torch.ones(N, dtype=torch.float64), min_p=torch.zeros(N)
    )
    out = log_probs_and_entropy_from_logits(
        x, labels, temperature=0.9, sampler=sampler, kept_stats=True, **nothing
    )
    assert torch.equal(out.log_probs, plain_lp) and torch.equal(out.entropy, plain_ent)
    assert not out.outside.any()
    assert torch.equal(out.kept_count, (x > -math.inf).sum(-1))


def test_ignored_labels_give_zero_and_are_never_outside():
    x, labels = _data(6)
    labels[[1, 9]] = -100
    out = log_probs_and_entropy_from_logits(x, labels, top_k=2, kept_stats=True)
    assert (out.log_probs[[1, 9]] == 0).all() and (out.entropy[[1, 9]] == 0).all()
    assert not out.outside[[1, 9]].any()


def test_a_label_outside_is_scored_as_if_kept_never_nan():
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    out = log_probs_from_logits(x, torch.tensor([3]), top_k=2, kept_stats=True)
    want = torch.log_softmax(x[0, [0, 1, 3]], -1)[2]
    assert out.outside.tolist() == [True]
    torch.testing.assert_close(out.log_probs[0], want, rtol=0, atol=1e-15)


def test_labels_of_several_candidates_are_all_added():
    x, _ = _data(7)
    labels = torch.stack([x.argmin(-1).clamp_max(4), x.argmax(-1)], -1)
    out = log_probs_from_logits(x, labels, top_p=0.5, kept_stats=True)
    z = x.clone()
    for i in range(N):
        keep = kept_row(x[i].tolist(), "vllm", None, 0.5, None) | set(labels[i].tolist())
        drop = [j for j in range(V) if j not in keep]
        z[i, drop] = -math.inf
    want = torch.log_softmax(z, -1).gather(1, labels)
    torch.testing.assert_close(out.log_probs, want, rtol=0, atol=1e-12)


def _group_masses(z: list[float], keep: set[int]) -> tuple[float, float]:
    """(mass of the kept set, mass without its smallest tie group), full softmax."""
    m = max(z)
    e = [math.exp(v - m) for v in z]
    s = sum(e)
    low = min(z[j] for j in keep)
    kept = sum(e[j] for j in keep) / s
    return kept, kept - sum(e[j] for j in keep if z[j] == low) / s


@given(
    row=st.lists(
        st.one_of(st.floats(-8, 8, allow_nan=False), st.sampled_from([0.0, 1.0, -1.0, 2.5])),
        min_size=2,
        max_size=24,
    ),
    p=st.floats(0.01, 0.99),
    sampler=st.sampled_from(SAMPLERS),
)
def test_top_p_keeps_at_least_p_and_no_more_than_needed(row, p, sampler):
    x = torch.tensor([row], dtype=torch.float64)
    mask = _kept_mask(x, top_p=p, sampler=sampler)[0]
    keep = set(mask.nonzero().flatten().tolist())
    kept, without_last = _group_masses(row, keep)
    tol = 1e-12
    if sampler == "sglang":  # the mass above each kept token is at most p
        assert kept > p - tol or len(keep) == len(row)
        assert without_last <= p + tol
    else:  # the mass above each kept token is below p
        assert kept >= p - tol
        assert without_last < p + tol
    # Ties at the threshold are kept whole.
    low = min(row[j] for j in keep)
    assert all(j in keep for j, v in enumerate(row) if v >= low)


@given(
    row=st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]), min_size=1, max_size=12),
    k=st.integers(1, 14),
    mp=st.floats(0.0, 1.0),
)
def test_top_k_and_min_p_keep_every_tie_and_the_largest(row, k, mp):
    x = torch.tensor([row], dtype=torch.float64)
    for sampler in SAMPLERS:
        keep = _kept_mask(x, top_k=k, min_p=mp, sampler=sampler)[0]
        assert keep[x[0].argmax()]
        assert set(keep.nonzero().flatten().tolist()) == kept_row(row, sampler, k, None, mp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_low_precision_logits_match_the_fp64_reference_of_their_values(dtype, sampler):
    x, labels = _data(8, dtype=dtype)
    kw = COMBOS["k,p,min_p"]
    leaf = x.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_from_logits(
        leaf, labels, sampler=sampler, temperature=0.8, **kw
    )
    (lp.sum() + ent.sum()).backward()
    ref_leaf = x.double().requires_grad_()
    rlp, rent, *_ = reference(ref_leaf, labels, sampler=sampler, temperature=0.8, **kw)
    (rlp.sum() + rent.sum()).backward()
    # The input is the same (bf16/fp16 values are exact in fp64); what is left is the fp32
    # arithmetic: each scaled logit, the max and log Σ exp carry a few fp32 roundings of
    # magnitude at most max|z| + log V.
    finite = x.double()[x.double() > -math.inf]
    scale = float(finite.abs().max()) / 0.8 + math.log(V)
    tol = 8 * torch.finfo(torch.float32).eps * scale
    torch.testing.assert_close(lp, rlp.detach().float(), rtol=0, atol=tol)
    torch.testing.assert_close(ent, rent.detach().float(), rtol=0, atol=tol)
    # The gradient is rounded to the logits' dtype once.
    gtol = torch.finfo(dtype).eps * float(ref_leaf.grad.abs().max()) + tol
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=0, atol=gtol)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p=torch.tensor([0.5, 0.0, 0.5])), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=torch.tensor([3, 0, 1])), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(min_p=torch.tensor([0.1, 2.0, 0.0])), "min_p"),
        (dict(top_k=torch.tensor([1, 2])), "top_k"),
        (dict(top_p=torch.full((4,), 0.5)), "top_p"),
        (dict(kept=torch.ones(3, 9, dtype=torch.bool)), "kept"),
        (dict(kept=torch.ones(2, 10, dtype=torch.bool)), "kept"),
        (dict(kept=torch.tensor([[0, 1], [2, 10], [1, -1]])), "kept"),
        (dict(kept=[[0], [1]]), "kept"),
        (dict(kept=[[0], [1], [2]], top_k=2), "kept"),
        (dict(sampler="trtllm", top_k=2), "sampler"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kw, name):
    x = torch.randn(3, 10)
    labels = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=name):
        log_probs_from_logits(x, labels, **kw)


def test_bad_types_raise_type_error():
    x, labels = torch.randn(3, 10), torch.tensor([1, 2, 3])
    for kw in (dict(top_k=2.5), dict(top_k=True), dict(top_p="0.5"), dict(top_k=torch.ones(3))):
        with pytest.raises(TypeError):
            log_probs_from_logits(x, labels, **kw)


@pytest.mark.parametrize("combo", list(COMBOS), ids=str)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_entropy_from_logits_under_the_kept_set(sampler, combo):
    x, _ = _data(4)
    kw = dict(COMBOS[combo], sampler=sampler, temperature=_T)
    # The row's largest logit is in every kept set: as a label it adds nothing to it.
    top = (x / _T.unsqueeze(-1)).argmax(-1)
    leaf = x.clone().requires_grad_()
    got = rlmath.entropy_from_logits(leaf, chunk_size=4, **kw)
    ref_leaf = x.clone().requires_grad_()
    _, want, _, _, _ = reference(ref_leaf, top, **kw)
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
    assert torch.equal(got, log_probs_and_entropy_from_logits(x, top, chunk_size=4, **kw)[1])
    w = torch.linspace(-1, 1, N, dtype=torch.float64)
    (got * w).sum().backward()
    (want * w).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=1e-12)


def test_vocab_parallel_in_a_world_of_one_is_the_plain_call():
    # Several processes: tests/distributed/test_vocab_parallel_sampling.py.
    x, labels = torch.randn(6, 50), torch.tensor([1, 2, 3, 4, 5, 6])
    mask = torch.rand(6, 50, generator=torch.Generator().manual_seed(0)) < 0.3
    for kw in (
        dict(top_k=9, top_p=0.7, min_p=0.01, temperature=0.9),
        dict(kept=mask, temperature=0.9),
        dict(kept=[row.nonzero().flatten().tolist() for row in mask]),
    ):
        one = log_probs_and_entropy_from_logits(x, labels, kept_stats=True, **kw)
        vp = log_probs_and_entropy_from_logits(
            x, labels, vocab_parallel=rlmath.VocabParallel(), kept_stats=True, **kw
        )
        for a, b in zip(one, vp, strict=True):
            assert torch.equal(a, b)


def test_no_input_is_modified():
    x, labels = _data(9)
    k, p, mp, T = (t.clone() for t in (_K, _P, _MP, _T))
    mask = _kept_mask(x, top_k=k, top_p=p, min_p=mp, temperature=T)
    before = [t.clone() for t in (x, labels, k, p, mp, T, mask)]
    leaf = x.clone().requires_grad_()
    lp, ent = log_probs_and_entropy_from_logits(
        leaf, labels, top_k=k, top_p=p, min_p=mp, temperature=T, chunk_size=2
    )
    (lp.sum() + ent.sum()).backward()
    log_probs_and_entropy_from_logits(x, labels, kept=mask, temperature=T)[0].sum()
    assert torch.equal(leaf.detach(), before[0])
    for t, b in zip((x, labels, k, p, mp, T, mask), before, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mass_exactly_p_above_a_token_splits_vllm_and_sglang(dtype):
    # Probabilities 1/2, 1/4, 1/4 exactly: the tied pair has mass 1/2 = p above it.
    x = torch.tensor([[0.0, -math.log(2), -math.log(2)]], dtype=dtype)
    assert torch.exp(x[0, 1:]).tolist() == [0.5, 0.5]
    want = {"vllm": [True, False, False], "hf": [True, False, False], "sglang": [True] * 3}
    for sampler, keep in want.items():
        assert _kept_mask(x, top_p=0.5, sampler=sampler)[0].tolist() == keep
        if dtype == torch.float64:  # the fp32 values are not exactly ln 2 apart in fp64
            ref = kept_row(x[0].tolist(), sampler, None, 0.5, None)
            assert sorted(ref) == [j for j in range(3) if keep[j]]


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("combo", ["k,p,min_p", "p=0.9", "p=0.3", "k=5", "k=200", "k=200,p"])
def test_many_logits_in_one_bucket_of_the_threshold_search(sampler, combo):
    # Logits within 1e-3 of each other (and a few tied): the cut falls inside a crowded bucket.
    # k = 200 is found by the histogram (small k: from the row's head, torch.topk).
    g = torch.Generator().manual_seed(12)
    x = 1.0 + 1e-3 * torch.randn(6, 400, generator=g, dtype=torch.float64)
    x[:, ::7] = 1.0
    x[1] = torch.randn(400, generator=g, dtype=torch.float64) * 3  # spread wide
    labels = torch.randint(0, 400, (6,), generator=g)
    out = log_probs_and_entropy_from_logits(
        x, labels, sampler=sampler, kept_stats=True, **COMBOS[combo]
    )
    logp, ent, outside, count, _ = reference(x, labels, sampler=sampler, **COMBOS[combo])
    assert torch.equal(out.kept_count, count)
    assert torch.equal(out.outside, outside)
    torch.testing.assert_close(out.log_probs, logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.entropy, ent, rtol=0, atol=1e-12)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("p", [0.5, 0.95, 1 - 1e-9])
def test_peaky_rows_whose_nucleus_may_fit_in_the_head(sampler, p):
    # A few large logits and a long tail: the nucleus of p = 0.5 lies among the 128 largest
    # (found there), that of p = 1 - 1e-9 reaches into the tail (found by the histogram).
    g = torch.Generator().manual_seed(13)
    x = torch.randn(5, 600, generator=g, dtype=torch.float64) - 12
    x[:, :40] += 14 + torch.randn(5, 40, generator=g, dtype=torch.float64)
    x[3, 100:400] = -12.0  # a long tied tail
    labels = torch.randint(0, 600, (5,), generator=g)
    out = log_probs_and_entropy_from_logits(x, labels, sampler=sampler, top_p=p, kept_stats=True)
    logp, ent, outside, count, _ = reference(x, labels, sampler=sampler, top_p=p)
    assert torch.equal(out.kept_count, count)
    assert torch.equal(out.outside, outside)
    torch.testing.assert_close(out.log_probs, logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.entropy, ent, rtol=0, atol=1e-12)


def _mixed_rows(n: int, v: int = 400, seed: int = 11):
    """Flat rows (a nucleus of hundreds of tokens) and peaky ones (a few tokens), interleaved:
    chunks then mix rows whose cut the head holds with rows that need the histogram."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 2
    x[1::2, :5] += 12
    labels = torch.randint(0, v, (n,), generator=g)
    return x, labels


INVARIANCE_CASES = {
    "p": dict(top_p=0.9),
    "k,p": dict(top_k=40, top_p=0.8),
    "k,p,min_p": dict(top_k=100, top_p=0.95, min_p=0.001),
    "per-row p,min_p": "per-row",
    "per-row k,p": "per-row-k",
}


def _invariance_kw(name: str, n: int):
    kw = INVARIANCE_CASES[name]
    if kw == "per-row":
        return dict(top_p=torch.linspace(0.3, 0.99, n), min_p=torch.linspace(0.0, 0.02, n))
    if kw == "per-row-k":
        return dict(top_k=torch.arange(n) % 90 + 3, top_p=torch.linspace(0.5, 0.95, n))
    return dict(kw)


@pytest.mark.parametrize("case", list(INVARIANCE_CASES))
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_a_rows_kept_set_log_probs_do_not_depend_on_the_batch_or_chunking(sampler, case):
    # Bitwise on these rows: the sums over a kept set depend on the row alone, and so do
    # the top-k and min-p thresholds. A top-p cut comes from the row's head or from the
    # histogram search, chosen per chunk; the two can disagree only where a token's excluded
    # mass ties p·S to fp32 rounding, which no row here comes near (docs/engine.md).
    n = 64
    x, labels = _mixed_rows(n)
    kw = _invariance_kw(case, n)

    def run(rows, chunk_size=None):
        leaf = x[rows].clone().requires_grad_()
        sub = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        out = log_probs_and_entropy_from_logits(
            leaf, labels[rows], temperature=0.8, sampler=sampler, kept_stats=True,
            chunk_size=chunk_size, **sub,
        )  # fmt: skip
        (out.log_probs * 1.5 + out.entropy * 0.5).sum().backward()
        return out, leaf.grad

    whole, whole_grad = run(torch.arange(n))
    for rows, chunk in ((torch.arange(7), None), (torch.tensor([5]), None), (torch.arange(n), 1),
                        (torch.arange(n), 3), (torch.arange(n - 1, -1, -1), 5)):  # fmt: skip
        got, grad = run(rows, chunk)
        for a, b in zip(got, whole, strict=True):
            assert torch.equal(a, b[rows]), (rows[:3], chunk)
        assert torch.equal(grad, whole_grad[rows])


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_entropy_from_logits_gradcheck_and_bad_input(sampler):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 11, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: rlmath.entropy_from_logits(
            x, top_k=6, top_p=0.8, min_p=0.02, sampler=sampler, temperature=0.9
        ),
        (x,),
    )
    with pytest.raises(ValueError, match="top_p"):
        rlmath.entropy_from_logits(x, top_p=0.0, sampler=sampler)
    with pytest.raises(ValueError, match="min_p"):
        rlmath.entropy_from_logits(x, min_p=1.5, sampler=sampler)


def test_kept_set_paths_keep_the_callers_state():
    # Inference mode and deterministic algorithms hold inside the kept-set paths (the
    # chunk workers and the fused head's blocks): the results are the plain mode's.
    from rlmath.fused_head import log_probs_and_entropy_from_hidden

    g = torch.Generator().manual_seed(9)
    x, labels = torch.randn(40, 300, generator=g), torch.randint(0, 300, (40,), generator=g)
    h, w = torch.randn(40, 16, generator=g), torch.randn(300, 16, generator=g)
    kw = dict(top_k=30, top_p=0.8, min_p=0.01)
    want = (
        log_probs_and_entropy_from_logits(x, labels, chunk_size=4, **kw),
        rlmath.entropy_from_logits(x, chunk_size=4, **kw),
        log_probs_and_entropy_from_hidden(h, w, labels, **kw),
    )
    with torch.inference_mode():
        got = (
            log_probs_and_entropy_from_logits(x, labels, chunk_size=4, **kw),
            rlmath.entropy_from_logits(x, chunk_size=4, **kw),
            log_probs_and_entropy_from_hidden(h, w, labels, **kw),
        )
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[2][0], want[2][0]) and torch.equal(got[2][1], want[2][1])
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        leaf = h.clone().requires_grad_()
        lp, ent = log_probs_and_entropy_from_hidden(leaf, w, labels, **kw)
        (lp.sum() + ent.sum()).backward()
        assert torch.equal(lp, want[2][0]) and torch.isfinite(leaf.grad).all()
    finally:
        torch.use_deterministic_algorithms(before)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 20000),
    st.integers(1, 140),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["ties", "normal", "-inf tail", "nan row"]),
)
def test_head_values_are_torch_topk_values(c, V, h, seed, kind):
    """The blocked search of each row's largest values gives ``torch.topk``'s values exactly:
    ties across and within blocks, ``-inf`` rows and tails, a NaN, widths not a multiple of
    the block."""
    from rlmath.engine.sampling import head_values

    h = min(h, V)
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        z = torch.randint(0, 4, (c, V), generator=g).float()
    else:
        z = torch.randn(c, V, generator=g)
    if kind == "-inf tail":
        z[:, V // 3 :] = float("-inf")
        z[0] = float("-inf")
    if kind == "nan row":
        z[0, V // 2] = float("nan")
    want = torch.topk(z, h, -1, sorted=True).values
    torch.testing.assert_close(head_values(z, h), want, rtol=0, atol=0, equal_nan=True)


def test_top_p_heads_of_every_size_and_the_histogram_give_the_reference_kept_sets():
    """Top-p tries a head of 32 values, then of 128, then the histogram search: rows whose
    nucleus fits each (a peaked row, about 90 tokens of equal weight under one large one, a
    flat row), alone and mixed in one chunk, keep exactly the reference's tokens."""
    Vw = 2000
    g = torch.Generator().manual_seed(9)
    base = torch.randn(3, Vw, generator=g, dtype=torch.float64) - 30.0  # negligible tail
    rows = base.clone()
    rows[0, :8] = torch.linspace(0.0, -2.0, 8, dtype=torch.float64)  # nucleus of a few tokens
    rows[1, 0] = 0.0
    rows[1, 1:101] = math.log(0.1) + torch.rand(100, generator=g, dtype=torch.float64) * 1e-3
    rows[2] = torch.randn(Vw, generator=g, dtype=torch.float64) * 0.1  # flat: ~1800 tokens
    for x in (rows, rows[[1, 0, 2, 1]], rows[:2]):
        labels = torch.zeros(x.shape[0], dtype=torch.long)
        want = reference(x, labels, top_p=0.9)
        got = log_probs_from_logits(x, labels, top_p=0.9, kept_stats=True)
        assert torch.equal(got.kept_count, want[3])
        torch.testing.assert_close(got.log_probs, want[0], rtol=0, atol=1e-12)
    counts = reference(rows, torch.zeros(3, dtype=torch.long), top_p=0.9)[3]
    assert counts[0] < 32 < counts[1] < 128 < counts[2]
