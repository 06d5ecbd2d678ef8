"""Differential tests, foundation: rlmath vs verl 0.9.1 on random inputs.

Same values wherever docs/design.md does not pin a difference; where it does
(its table "Deliberate differences from verl"), the difference is asserted.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.peers.peer_helpers import assert_close, import_verl, randn, random_mask

verl_F = import_verl("verl.utils.torch_functional")
verl_core = import_verl("verl.trainer.ppo.core_algos")
verl_attn = import_verl("verl.utils.attention_utils")

import rlmath  # noqa: E402

SHAPES = [(1, 1), (3, 7), (8, 33)]
DTYPES = [torch.float32, torch.float64]


# --------------------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 1)])
def test_masked_sum_and_mean(shape, dtype, axis, gen):
    b, t = shape
    for trial in range(5):
        values = randn(b, t, gen=gen, dtype=dtype, scale=3.0)
        mask = random_mask(b, t, gen, layout=["right", "left", "gaps"][trial % 3])
        for m in (mask, mask.float(), mask.long()):
            assert_close(
                rlmath.masked_sum(values, m, axis=axis),
                verl_F.masked_sum(values, m, axis=axis),
                rtol=1e-6 if dtype == torch.float32 else 1e-12,
                atol=1e-6 if dtype == torch.float32 else 1e-12,
            )
            # verl divides by (n + 1e-8): a relative difference of 1e-8/n (docs/design.md
            # pins "empty mask -> 0"; verl's epsilon is not part of the contract).
            assert_close(
                rlmath.masked_mean(values, m, axis=axis),
                verl_F.masked_mean(values, m, axis=axis),
                rtol=2e-6 if dtype == torch.float32 else 1e-7,
                atol=1e-7,
            )


def test_masked_mean_float_weights(gen):
    values = randn(4, 9, gen=gen)
    weights = torch.rand(4, 9, generator=gen) * (torch.rand(4, 9, generator=gen) > 0.3)
    for axis in (None, -1):
        assert_close(
            rlmath.masked_mean(values, weights, axis=axis),
            verl_F.masked_mean(values, weights, axis=axis),
            rtol=2e-6,
        )


def test_masked_mean_empty_mask_is_zero_like_verl():
    values = torch.randn(2, 5)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    assert rlmath.masked_mean(values, mask) == 0
    assert verl_F.masked_mean(values, mask) == 0  # 0 / 1e-8


@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var(shape, dtype, unbiased, gen):
    b, t = shape
    for trial in range(6):
        values = randn(b, t, gen=gen, dtype=dtype, scale=2.0) + 5.0
        mask = random_mask(b, t, gen, layout=["right", "left", "gaps"][trial % 3])
        if int(mask.sum()) < 2:
            mask[0, :2] = True
        for m in (mask, mask.float()):
            assert_close(
                rlmath.masked_var(values, m, unbiased=unbiased),
                verl_F.masked_var(values, m, unbiased=unbiased),
                rtol=1e-5 if dtype == torch.float32 else 1e-7,
                atol=1e-6,
            )


def test_masked_var_float_weights(gen):
    values = randn(3, 11, gen=gen)
    weights = 0.5 + torch.rand(3, 11, generator=gen)
    assert_close(rlmath.masked_var(values, weights), verl_F.masked_var(values, weights), rtol=1e-5)


def test_masked_var_small_n_documented_difference():
    # docs/design.md: masked_var(values, mask, unbiased=True) returns 0 for n <= 1
    # instead of raising. verl raises ValueError for n == 0 and n == 1.
    values = torch.randn(2, 4)
    for n in (0, 1):
        mask = torch.zeros(2, 4, dtype=torch.bool)
        mask.view(-1)[:n] = True
        with pytest.raises(ValueError):
            verl_F.masked_var(values, mask)
        assert rlmath.masked_var(values, mask) == 0


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_whiten(shift_mean, dtype, gen):
    for trial in range(6):
        b, t = 4, 13
        values = randn(b, t, gen=gen, dtype=dtype, scale=4.0) - 1.0
        mask = random_mask(b, t, gen, min_valid=2, layout=["right", "left", "gaps"][trial % 3])
        ours = rlmath.masked_whiten(values, mask, shift_mean=shift_mean)
        theirs = verl_F.masked_whiten(values, mask, shift_mean=shift_mean)
        tol = 1e-5 if dtype == torch.float32 else 1e-7
        assert_close(ours[mask], theirs[mask], rtol=tol, atol=tol)
        # Documented difference (rlmath.masked_whiten docstring; docs/design.md, masks: a
        # masked position never influences a value): rlmath is exactly 0 under mask=0,
        # verl whitens the padding too.
        assert torch.all(ours[~mask] == 0)


# --------------------------------------------------------------------------- small utilities


@pytest.mark.parametrize("eos", [2, [1, 2], [7], (3, 5, 0)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float32])
def test_get_response_mask(eos, dtype, gen):
    ids = torch.randint(0, 9, (6, 12), generator=gen)
    ids[0] = 4  # no EOS at all
    ids[1, 0] = 2  # EOS first
    ids[2, -1] = 2  # EOS last
    ours = rlmath.get_response_mask(ids, eos_token=eos, dtype=dtype)
    theirs = verl_F.get_response_mask(
        ids, eos_token=list(eos) if isinstance(eos, tuple) else eos, dtype=dtype
    )
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)


def test_get_response_mask_default_eos(gen):
    ids = torch.randint(0, 5, (5, 9), generator=gen)
    assert torch.equal(rlmath.get_response_mask(ids), verl_F.get_response_mask(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_clip_by_value(dtype, gen):
    x = (torch.randn(5, 7, generator=gen) * 3).to(dtype)
    lo = (torch.randn(5, 7, generator=gen) - 1).to(dtype)
    hi = lo + (torch.rand(5, 7, generator=gen) * 2).to(dtype)
    for a, b in ((lo, hi), (lo[0], hi[0]), (torch.tensor(-1, dtype=dtype), hi)):
        assert torch.equal(rlmath.clip_by_value(x, a, b), verl_F.clip_by_value(x, a, b))


@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("max_len", [3, 9, 12])
def test_pad_sequence_to_length(left_pad, max_len, gen):
    for x in (torch.randint(0, 50, (3, 9), generator=gen), torch.randn(2, 9, generator=gen)):
        ours = rlmath.pad_sequence_to_length(x, max_len, 7, left_pad=left_pad)
        theirs = verl_F.pad_sequence_to_length(x, max_len, 7, left_pad=left_pad)
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("max_length", [None, 2, 6, 10])
def test_pad_2d_list_to_length(max_length):
    ints = [[1, 2, 3], [4], [5, 6, 7, 8, 9], []]
    floats = [[0.5, -1.25], [3.0], [1.0, 2.0, 3.0]]
    for rows, pad in ((ints, 0), (ints, -100), (floats, 0.0)):
        ours = rlmath.pad_2d_list_to_length(rows, pad, max_length=max_length)
        theirs = verl_F.pad_2d_list_to_length(rows, pad, max_length=max_length)
        assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
        assert torch.equal(ours, theirs)


# --------------------------------------------------------------------------- padding utilities


@pytest.mark.parametrize("layout", ["right", "left", "gaps"])
def test_unpad_pad_index_first_axis(layout, gen):
    b, t, h = 5, 11, 3
    mask = random_mask(b, t, gen, layout=layout).long()
    mask[2] = 0  # an empty row
    hidden = randn(b, t, h, gen=gen)
    ours = rlmath.unpad_input(hidden, mask)
    theirs = verl_attn._fallback_unpad_input(hidden, mask)
    assert len(ours) == len(theirs) == 5
    assert torch.equal(ours[0], theirs[0])  # packed
    assert torch.equal(ours[1], theirs[1])  # indices
    assert ours[2].dtype == theirs[2].dtype == torch.int32
    assert torch.equal(ours[2], theirs[2])  # cu_seqlens
    assert int(ours[3]) == int(theirs[3])  # max_seqlen
    assert torch.equal(ours[4], theirs[4])  # seqused
    assert torch.equal(rlmath.cu_seqlens(mask), theirs[2])
    # pad_input: values and gradients.
    packed = ours[0].clone().requires_grad_(True)
    packed_v = ours[0].clone().requires_grad_(True)
    out = rlmath.pad_input(packed, ours[1], b, t)
    out_v = verl_attn._fallback_pad_input(packed_v, theirs[1], b, t)
    assert torch.equal(out, out_v)
    w = torch.randn(out.shape, generator=gen)
    (out * w).sum().backward()
    (out_v * w).sum().backward()
    assert torch.equal(packed.grad, packed_v.grad)
    flat = hidden.reshape(b * t, h)
    assert torch.equal(
        rlmath.index_first_axis(flat, ours[1]),
        verl_attn._fallback_index_first_axis(flat, theirs[1]),
    )


def test_unpad_input_unused_mask(gen):
    b, t = 4, 8
    mask = random_mask(b, t, gen, layout="right").long()
    unused = (~mask.bool() & (torch.rand(b, t, generator=gen) < 0.5)).long()
    hidden = randn(b, t, 2, gen=gen)
    ours = rlmath.unpad_input(hidden, mask, unused)
    theirs = verl_attn._fallback_unpad_input(hidden, mask, unused)
    for i in (0, 1, 2, 4):
        assert torch.equal(ours[i], theirs[i]), i
    assert int(ours[3]) == int(theirs[3])


# --------------------------------------------------------------------------- KL estimators

VERL_KL_NAMES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
VERL_KL_NAMES += [n + "+" for n in VERL_KL_NAMES]


@pytest.mark.parametrize("name", VERL_KL_NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_penalty_values_and_gradients(name, dtype, gen):
    # Log-ratios up to |x| ~ 15 reach verl's k3 value clamp at 10 (x > 2.6 or x < -11)
    # and, for the +20 exponent clamp, nothing beyond it.
    logp = (randn(6, 40, gen=gen, dtype=torch.float64, scale=2.0) - 3.0).to(dtype)
    ref = (logp.double() + randn(6, 40, gen=gen, dtype=torch.float64, scale=4.0)).to(dtype)
    lp1, rf1 = logp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    lp2, rf2 = logp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    ours = rlmath.kl_penalty(lp1, rf1, name)
    theirs = verl_core.kl_penalty(lp2, rf2, name)
    base = name.removesuffix("+")
    # k3 is expm1(x) - x in rlmath (docs/design.md) and exp(x) - x - 1 in verl: same value up to
    # rounding of the exp near 0 (absolute error ~ eps * exp(x)).
    tol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-12, 1e-12)
    if base in ("k3", "low_var_kl"):
        tol = (1e-5, 2e-6) if dtype == torch.float32 else (1e-12, 1e-13)
    assert_close(ours, theirs, rtol=tol[0], atol=tol[1], msg=name)
    w = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(dtype)
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    assert_close(lp1.grad, lp2.grad, rtol=tol[0], atol=tol[1], msg=f"{name} d/dlogprob")
    assert_close(rf1.grad, rf2.grad, rtol=tol[0], atol=tol[1], msg=f"{name} d/dref")


def test_kl_penalty_verl_keyword_spelling(gen):
    from rlmath.compat.verl import kl_penalty as compat_kl_penalty

    logp, ref = randn(3, 5, gen=gen), randn(3, 5, gen=gen)
    assert_close(
        compat_kl_penalty(logp, ref, kl_penalty="low_var_kl"),
        verl_core.kl_penalty(logp, ref, kl_penalty="low_var_kl"),
        rtol=1e-5,
        atol=2e-6,
    )


# --------------------------------------------------------------------------- rewards, controllers


@pytest.mark.parametrize("kl_coef", [0.0, 0.05, 1.3])
def test_compute_rewards(kl_coef, gen):
    scores, old, ref = (randn(4, 10, gen=gen) for _ in range(3))
    theirs = verl_core.compute_rewards(scores, old, ref, kl_coef)
    assert_close(rlmath.compute_rewards(scores, old, ref, kl_coef), theirs, rtol=1e-6)
    # With a mask: equal on valid positions; docs/design.md: compute_rewards returns
    # scores - kl_coef*kl, masked positions 0 (verl has no mask argument).
    mask = random_mask(4, 10, gen)
    ours = rlmath.compute_rewards(scores, old, ref, kl_coef, response_mask=mask)
    assert_close(ours[mask], theirs[mask], rtol=1e-6)
    assert torch.all(ours[~mask] == 0)


def test_kl_controllers_step_by_step(gen):
    # Updates that cover at most one horizon (a batch per update): verl's values exactly.
    for init, target, horizon in ((0.1, 6.0, 10000), (0.2, 0.05, 500), (1.0, 1.0, 300)):
        ours = rlmath.AdaptiveKLController(init, target, horizon)
        theirs = verl_core.AdaptiveKLController(init, target, horizon)
        for _ in range(50):
            kl = float(torch.rand((), generator=gen)) * 3 * target
            n = int(torch.randint(1, 300, (), generator=gen))
            ours.update(kl, n)
            theirs.update(kl, n)
            assert ours.value == pytest.approx(float(theirs.value), rel=1e-12)
    fixed, fixed_v = rlmath.FixedKLController(0.3), verl_core.FixedKLController(0.3)
    fixed.update(5.0, 100)
    fixed_v.update(5.0, 100)
    assert fixed.value == fixed_v.value


def test_adaptive_kl_controller_long_update_documented_difference():
    # docs/design.md, "KL estimators, controllers and rewards": an update covering more
    # than one horizon is applied one horizon at a time, so beta keeps its sign. verl
    # takes one Euler step: at 5 horizons with the KL far below target its beta is 0.
    ours = rlmath.AdaptiveKLController(0.1, 1.0, 100)
    theirs = verl_core.AdaptiveKLController(0.1, 1.0, 100)
    ours.update(0.0, 500)
    theirs.update(0.0, 500)
    assert float(theirs.value) == 0.0
    assert ours.value == pytest.approx(0.1 * 0.8**5, rel=1e-12)


# --------------------------------------------------------------------------- LR schedules


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def _lrs(sched, steps: int) -> list[float]:
    out = []
    opt = sched.optimizer
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


COSINE_CASES = list(
    itertools.product(
        [(0, 10), (1, 10), (3, 17), (10, 10), (12, 10), (5, 6)],  # (warmup, total)
        [0.0, 0.1, None],  # min_lr_ratio
        [0.5, 1.0, 0.25],  # num_cycles
        [None, 0.2],  # init_lr_ratio
        [True, False],  # zero_indexed_step
    )
)


@pytest.mark.parametrize(("wt", "min_lr", "cycles", "init", "zero_idx"), COSINE_CASES)
def test_cosine_schedule_inside_the_schedule(wt, min_lr, cycles, init, zero_idx):
    warmup, total = wt
    kw = dict(min_lr_ratio=min_lr, num_cycles=cycles, init_lr_ratio=init)
    ours = rlmath.get_cosine_schedule_with_warmup(
        _optimizer(), warmup, total, zero_indexed_step=zero_idx, **kw
    )
    theirs = verl_F.get_cosine_schedule_with_warmup(
        _optimizer(), warmup, total, zero_indexed_step=zero_idx, **kw
    )
    # "Inside" = the steps whose verl multiplier is evaluated at a step <= total.
    inside = total + (0 if zero_idx else -1) + 1
    a, b = _lrs(ours, total + 8), _lrs(theirs, total + 8)
    assert a[:inside] == pytest.approx(b[:inside], rel=1e-12, abs=1e-15)
    # docs/design.md: unlike verl, past num_training_steps the cosine stays at its end
    # value instead of climbing back. (Only visible where verl's cosine has not ended flat.)
    for lr in a[inside:]:
        assert lr == pytest.approx(a[inside - 1], abs=1e-12)
    # The pure multiplier gives the same numbers (resume-safe).
    lam = [
        rlmath.cosine_schedule_lambda(
            s, num_warmup_steps=warmup, num_training_steps=total, zero_indexed_step=zero_idx, **kw
        )
        for s in range(len(a))
    ]
    assert lam == pytest.approx(a, rel=1e-12, abs=1e-15)


def test_cosine_schedule_past_the_end_documented_difference():
    ours = _lrs(rlmath.get_cosine_schedule_with_warmup(_optimizer(), 2, 10), 16)
    theirs = _lrs(verl_F.get_cosine_schedule_with_warmup(_optimizer(), 2, 10), 16)
    assert ours[:11] == pytest.approx(theirs[:11])
    assert theirs[15] > theirs[10] + 0.05  # verl climbs back up
    assert ours[15] == pytest.approx(ours[10])  # docs/design.md: rlmath holds the end value


@pytest.mark.parametrize("wt", [(0, 10), (1, 10), (4, 25), (10, 10), (12, 10), (0, 1)])
@pytest.mark.parametrize("min_lr", [0.0, 0.3])
@pytest.mark.parametrize("cycles", [0.5, 1.0])
@pytest.mark.parametrize("stable", [0.0, 0.5, 0.9, 1.0])
def test_wsd_schedule(wt, min_lr, cycles, stable):
    warmup, total = wt
    kw = dict(min_lr_ratio=min_lr, num_cycles=cycles, stable_ratio=stable)
    a = _lrs(rlmath.get_wsd_schedule_with_warmup(_optimizer(), warmup, total, **kw), total + 6)
    b = _lrs(verl_F.get_wsd_schedule_with_warmup(_optimizer(), warmup, total, **kw), total + 6)
    # verl's WSD already holds min_lr_ratio past the end: equal everywhere.
    assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
    lam = [
        rlmath.wsd_schedule_lambda(s, num_warmup_steps=warmup, num_training_steps=total, **kw)
        for s in range(len(a))
    ]
    assert lam == pytest.approx(a, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("warmup", [0, 1, 5, 20])
def test_constant_schedule(warmup):
    a = _lrs(rlmath.get_constant_schedule_with_warmup(_optimizer(), warmup), 30)
    b = _lrs(verl_F.get_constant_schedule_with_warmup(_optimizer(), warmup), 30)
    assert a == pytest.approx(b, rel=1e-12, abs=1e-15)
    lam = [rlmath.constant_schedule_lambda(s, num_warmup_steps=warmup) for s in range(30)]
    assert lam == pytest.approx(a, rel=1e-12, abs=1e-15)


def test_schedules_resume_with_last_epoch():
    def resumed(factory, **kw):
        opt = _optimizer()
        opt.param_groups[0]["initial_lr"] = 1.0
        return _lrs(factory(opt, last_epoch=6, **kw), 8)

    for ours_f, theirs_f, kw in (
        (
            rlmath.get_cosine_schedule_with_warmup,
            verl_F.get_cosine_schedule_with_warmup,
            dict(num_warmup_steps=3, num_training_steps=14, min_lr_ratio=0.1),
        ),
        (
            rlmath.get_wsd_schedule_with_warmup,
            verl_F.get_wsd_schedule_with_warmup,
            dict(num_warmup_steps=3, num_training_steps=14, stable_ratio=0.5),
        ),
        (
            rlmath.get_constant_schedule_with_warmup,
            verl_F.get_constant_schedule_with_warmup,
            dict(num_warmup_steps=9),
        ),
    ):
        assert resumed(ours_f, **kw) == pytest.approx(resumed(theirs_f, **kw), rel=1e-12)
