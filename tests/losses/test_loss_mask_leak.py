"""NaN, inf or huge values under mask = 0 never change a loss, its metrics or its gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import (
    compute_entropy_loss,
    compute_value_loss,
    get_policy_loss,
    list_policy_losses,
    rollout_correction,
)

from .helpers import LOSS_KWARGS, MODES, agg_extra, ragged_mask

GARBAGE = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 100.0, -100.0])


def _dirty(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


def _batch(seed: int, b: int, t: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(b, t, gen, empty_rows=(seed % (b + 1),))
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2 - 0.05
    logp = (old + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.4).clamp(max=-1e-3)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    w = torch.rand(b, t, generator=gen, dtype=torch.float64) + 0.5
    return [x.to(dtype) for x in (old, logp, adv, w)], mask


def _assert_same(a, b):
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("name", list_policy_losses())
@given(
    mode=st.sampled_from(MODES),
    garbage=GARBAGE,
    which=st.sets(st.sampled_from(["old", "logp", "adv", "w"]), min_size=1),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 6)),
)
def test_policy_losses(name, mode, garbage, which, seed, dtype, shape):
    (old, logp, adv, w), mask = _batch(seed, *shape, dtype)
    clean = {"old": old, "logp": logp, "adv": adv, "w": w}
    dirty = {k: _dirty(v, mask, garbage) if k in which else v for k, v in clean.items()}
    results = []
    for inputs in (clean, dirty):
        leaf = inputs["logp"].clone().requires_grad_()
        kw = dict(LOSS_KWARGS[name])
        if name == "clip_cov":
            kw["generator"] = torch.Generator().manual_seed(seed)
        loss, metrics = get_policy_loss(name)(
            inputs["old"], leaf, inputs["adv"], mask, loss_agg_mode=mode,
            rollout_is_weights=inputs["w"], **agg_extra(mask), **kw,
        )  # fmt: skip
        loss.backward()
        results.append((loss.detach(), metrics, leaf.grad))
    (l1, m1, g1), (l2, m2, g2) = results
    _assert_same(l1, l2)
    _assert_same(g1, g2)
    assert m1.keys() == m2.keys()
    for k in m1:
        _assert_same(m1[k], m2[k])
    assert torch.isfinite(l1) and torch.isfinite(g1).all()


@given(mode=st.sampled_from(MODES), garbage=GARBAGE, seed=st.integers(0, 10_000))
def test_value_loss(mode, garbage, seed):
    (vp, ret, val, _), mask = _batch(seed, 3, 5, torch.float64)
    out = []
    for dirty in (False, True):
        args = [_dirty(x, mask, garbage) if dirty else x for x in (vp, ret, val)]
        leaf = args[0].clone().requires_grad_()
        loss, frac = compute_value_loss(
            leaf, args[1], args[2], mask, cliprange_value=0.2, loss_agg_mode=mode, **agg_extra(mask)
        )
        frac = frac["vf_clipfrac"]
        loss.backward()
        out.append((loss.detach(), frac, leaf.grad))
    for a, b in zip(*out):
        _assert_same(a, b)


@given(mode=st.sampled_from(MODES), garbage=GARBAGE, seed=st.integers(0, 10_000))
def test_entropy_loss(mode, garbage, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(3, 4, gen)
    logits = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64)
    out = []
    for dirty in (False, True):
        x = torch.where(mask[..., None], logits, garbage) if dirty else logits
        leaf = x.clone().requires_grad_()
        loss = compute_entropy_loss(leaf, mask, loss_agg_mode=mode, **agg_extra(mask))[0]
        loss.backward()
        out.append((loss.detach(), leaf.grad))
    for a, b in zip(*out):
        _assert_same(a, b)


@given(
    level=st.sampled_from(["token", "sequence", "geometric", "segment"]),
    mode=st.sampled_from(["truncate", "mask"]),
    garbage=GARBAGE,
    seed=st.integers(0, 10_000),
    batch_normalize=st.booleans(),
)
def test_rollout_correction(level, mode, garbage, seed, batch_normalize):
    (old, _, _, _), mask = _batch(seed, 4, 5, torch.float64)
    rollout = (
        old
        + torch.randn(4, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        * 0.5
    )
    kw = {"level": level, "mode": mode, "batch_normalize": batch_normalize}
    a = rollout_correction(old, rollout, mask, **kw)
    b = rollout_correction(_dirty(old, mask, garbage), _dirty(rollout, mask, -garbage), mask, **kw)
    _assert_same(a.weights, b.weights)
    _assert_same(a.response_mask, b.response_mask)
    for k in a.metrics:
        _assert_same(a.metrics[k], b.metrics[k])
