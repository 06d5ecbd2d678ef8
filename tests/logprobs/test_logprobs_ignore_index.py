"""``ignore_index`` on the logits functions: ignored positions are 0, never read, and get no gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

from rlmath import log_probs_and_entropy_from_logits, log_probs_from_logits

IGNORE = -100
JUNK = [float("nan"), float("inf"), -float("inf"), 1e30, 100.0]


@given(
    n=st.integers(1, 10),
    v=st.integers(1, 40),
    k=st.one_of(st.none(), st.integers(1, 3)),
    chunk=st.one_of(st.none(), st.integers(1, 6)),
    junk=st.sampled_from(JUNK),
    seed=st.integers(0, 2**16),
)
def test_junk_on_ignored_rows_changes_nothing(n, v, k, chunk, junk, seed):
    """Ignored rows hold junk logits and temperatures; every other value and gradient is bitwise
    that of the same rows with clean data, and the ignored rows give exact zeros."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 3
    shape = (n,) if k is None else (n, k)
    labels = torch.randint(0, v, shape, generator=g)
    dead = torch.rand(n, generator=g) < 0.4
    labels[dead] = IGNORE
    temp = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    dirty = logits.clone()
    dirty[dead] = junk
    dirty_temp = torch.where(dead, torch.tensor(0.0 if junk != 100.0 else junk), temp)

    def run(x, t):
        leaf = x.clone().requires_grad_()
        lp, ent = log_probs_and_entropy_from_logits(
            leaf, labels, temperature=t, ignore_index=IGNORE, chunk_size=chunk
        )
        (lp.sum() + 0.5 * ent.sum()).backward()
        return lp, ent, leaf.grad

    clean = run(logits, temp)
    got = run(dirty, dirty_temp)
    for a, b in zip(got, clean, strict=True):
        assert torch.equal(a[~dead], b[~dead])
        assert (a[dead] == 0).all()


@pytest.mark.parametrize("k", [None, 3])
def test_live_rows_equal_the_call_without_ignore_index(k):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 31, generator=g, dtype=torch.float64)
    shape = (9,) if k is None else (9, k)
    labels = torch.randint(0, 31, shape, generator=g)
    labels[2] = IGNORE
    if k is not None:
        labels[5, 1] = IGNORE  # one ignored candidate in a live row
    got = log_probs_from_logits(logits, labels, ignore_index=IGNORE)
    want = log_probs_from_logits(logits, labels.clamp_min(0))
    keep = labels != IGNORE
    assert torch.equal(got[keep], want[keep]) and (got[~keep] == 0).all()
    _, ent = log_probs_and_entropy_from_logits(logits, labels, ignore_index=IGNORE)
    _, ent_all = log_probs_and_entropy_from_logits(logits, labels.clamp_min(0))
    live = keep if k is None else keep.any(-1)
    assert torch.equal(ent[live], ent_all[live]) and (ent[~live] == 0).all()


@pytest.mark.parametrize("k", [None, 2])
def test_gradcheck_with_ignored_labels(k):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64, requires_grad=True)
    shape = (6,) if k is None else (6, k)
    labels = torch.randint(0, 9, shape, generator=g)
    labels[1] = IGNORE
    labels[4, ...] = IGNORE if k is None else torch.tensor([3, IGNORE])
    t = torch.rand(6, generator=g, dtype=torch.float64) + 0.5
    assert gradcheck(
        lambda x: log_probs_and_entropy_from_logits(
            x, labels, temperature=t, ignore_index=IGNORE, chunk_size=4
        ),
        (x,),
    )
    assert gradcheck(
        lambda x: log_probs_from_logits(x, labels, ignore_index=IGNORE, chunk_size=4), (x,)
    )


def test_validate_accepts_ignore_index_and_rejects_other_negatives():
    logits = torch.randn(3, 5)
    labels = torch.tensor([1, IGNORE, 4])
    log_probs_from_logits(logits, labels, ignore_index=IGNORE, validate=True)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\).*ignore_index = -100"):
        log_probs_from_logits(logits, torch.tensor([1, -1, 4]), ignore_index=IGNORE, validate=True)
    with pytest.raises(TypeError, match="ignore_index"):
        log_probs_from_logits(logits, labels, ignore_index=1.5)  # type: ignore[arg-type]
