"""LR schedules: pinned values, a reference written from verl's formulas, resume, edge cases."""

import math
import pickle

import pytest
import torch

from rlmath import (
    constant_schedule_lambda,
    cosine_schedule_lambda,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_wsd_schedule_with_warmup,
    wsd_schedule_lambda,
)

# ---------------------------------------------------------------- references (verl's formulas)


def ref_cosine(step, warmup, total, min_lr=0.0, cycles=0.5, init=0.0, hold=True):
    """verl: linear warmup from init, then min + (1 − min)(1 + cos(2π·cycles·p))/2.

    ``hold=False`` is verl's own behaviour past ``total`` (the cosine keeps going)."""
    if hold and step > total:
        step = total
    if step < warmup:
        return init + (1 - init) * step / max(1, warmup)
    p = (step - warmup) / max(1, total - warmup)
    return min_lr + (1 - min_lr) * (1 + math.cos(2 * math.pi * cycles * p)) / 2


def ref_wsd(step, warmup, total, min_lr=0.0, cycles=0.5, stable_ratio=0.9):
    rest = max(0, total - warmup)
    stable = int(rest * stable_ratio)
    decay = rest - stable
    if step < warmup:
        return step / max(1, warmup)
    if step < warmup + stable:
        return 1.0
    if step >= total:
        return min_lr
    p = (step - warmup - stable) / max(1, decay)
    return min_lr + (1 - min_lr) * max(0.0, (1 + math.cos(2 * math.pi * cycles * p)) / 2)


def ref_constant(step, warmup):
    return step / warmup if step < warmup else 1.0


def lrs_of(make, steps, base_lr=2.0):
    """The learning rate seen by optimizer step 0, 1, ..., steps − 1."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base_lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"] / base_lr)
        opt.step()
        sched.step()
    return out


# ---------------------------------------------------------------- pinned values


def test_cosine_pinned_points():
    kw = dict(num_warmup_steps=10, num_training_steps=110, min_lr_ratio=0.1)
    f = lambda s: cosine_schedule_lambda(s, **kw)  # noqa: E731
    assert f(0) == 0.0  # step 0
    assert f(5) == 0.5  # halfway through warmup
    assert f(10) == 1.0  # end of warmup
    assert f(60) == pytest.approx(0.55)  # middle of the decay: halfway between 1 and 0.1
    assert f(110) == pytest.approx(0.1)  # end of decay
    assert f(111) == f(500) == f(110)  # past the end: held (verl climbs back)
    assert ref_cosine(200, 10, 110, 0.1, hold=False) == pytest.approx(
        0.1 + 0.9 * (1 + math.cos(1.9 * math.pi)) / 2
    )
    assert cosine_schedule_lambda(0, init_lr_ratio=0.2, **kw) == 0.2
    assert cosine_schedule_lambda(5, init_lr_ratio=0.2, **kw) == pytest.approx(0.6)
    # zero_indexed_step=False evaluates at step + 1.
    assert cosine_schedule_lambda(9, zero_indexed_step=False, **kw) == 1.0


def test_wsd_pinned_points():
    kw = dict(num_warmup_steps=10, num_training_steps=110, min_lr_ratio=0.2)
    f = lambda s: wsd_schedule_lambda(s, **kw)  # noqa: E731
    # 100 post-warmup steps: 90 stable, 10 decay.
    assert f(0) == 0.0 and f(5) == 0.5 and f(10) == 1.0
    assert f(50) == 1.0 and f(99) == 1.0  # stable phase
    assert f(100) == 1.0  # decay starts at its top
    assert f(105) == pytest.approx(0.2 + 0.8 * 0.5)  # middle of the decay
    assert f(109) == pytest.approx(0.2 + 0.8 * (1 + math.cos(0.9 * math.pi)) / 2)
    assert f(110) == 0.2 and f(1000) == 0.2  # end of decay and past it
    assert wsd_schedule_lambda(50, stable_ratio=0.0, **kw) == pytest.approx(
        cosine_schedule_lambda(50, **kw)
    )


def test_constant_pinned_points():
    values = [constant_schedule_lambda(s, num_warmup_steps=4) for s in range(7)]
    assert values == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert constant_schedule_lambda(0, num_warmup_steps=0) == 1.0


# ---------------------------------------------------------------- step by step vs the reference

GRID = [(0, 0), (0, 1), (0, 20), (1, 1), (1, 2), (1, 20), (3, 3), (5, 20), (8, 5), (20, 7), (4, 41)]


@pytest.mark.parametrize("warmup,total", GRID)
@pytest.mark.parametrize(
    "min_lr,cycles,init", [(0.0, 0.5, None), (0.1, 0.5, 0.3), (0.05, 1.5, 0.0)]
)
def test_cosine_step_by_step(warmup, total, min_lr, cycles, init):
    def make(opt):
        return get_cosine_schedule_with_warmup(
            opt, warmup, total, min_lr, cycles, init_lr_ratio=init
        )

    got = lrs_of(make, total + 6)
    expected = [ref_cosine(s, warmup, total, min_lr, cycles, init or 0.0) for s in range(total + 6)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # Inside [0, num_training_steps] that is exactly verl's curve.
    verl = [
        ref_cosine(s, warmup, total, min_lr, cycles, init or 0.0, hold=False)
        for s in range(total + 1)
    ]
    assert got[: total + 1] == pytest.approx(verl, rel=1e-12, abs=1e-15)
    assert all(math.isfinite(v) and 0.0 <= v <= 1.0 + 1e-12 for v in got)


@pytest.mark.parametrize("warmup,total", GRID)
@pytest.mark.parametrize(
    "min_lr,cycles,stable", [(0.0, 0.5, 0.9), (0.1, 0.5, 0.0), (0.3, 1.0, 0.5)]
)
def test_wsd_step_by_step(warmup, total, min_lr, cycles, stable):
    def make(opt):
        return get_wsd_schedule_with_warmup(opt, warmup, total, min_lr, cycles, stable_ratio=stable)

    got = lrs_of(make, total + 6)
    expected = [ref_wsd(s, warmup, total, min_lr, cycles, stable) for s in range(total + 6)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("warmup", [0, 1, 2, 7])
def test_constant_step_by_step(warmup):
    got = lrs_of(lambda opt: get_constant_schedule_with_warmup(opt, warmup), 12)
    assert got == pytest.approx([ref_constant(s, warmup) for s in range(12)])


def test_param_groups_scale_independently():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-5}])
    sched = get_cosine_schedule_with_warmup(opt, 3, 10, min_lr_ratio=0.1)
    for step in range(14):
        f = ref_cosine(step, 3, 10, 0.1)
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * f)
        assert opt.param_groups[1]["lr"] == pytest.approx(1e-5 * f)
        opt.step()
        sched.step()


# ---------------------------------------------------------------- resume


MAKERS = {
    "cosine": lambda opt, last_epoch=-1: get_cosine_schedule_with_warmup(
        opt, 5, 30, min_lr_ratio=0.1, last_epoch=last_epoch
    ),
    "wsd": lambda opt, last_epoch=-1: get_wsd_schedule_with_warmup(
        opt, 5, 30, min_lr_ratio=0.1, last_epoch=last_epoch, stable_ratio=0.5
    ),
    "constant": lambda opt, last_epoch=-1: get_constant_schedule_with_warmup(
        opt, 5, last_epoch=last_epoch
    ),
}
REFS = {
    "cosine": lambda s: ref_cosine(s, 5, 30, 0.1),
    "wsd": lambda s: ref_wsd(s, 5, 30, 0.1, 0.5, 0.5),
    "constant": lambda s: ref_constant(s, 5),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("resume_at", [1, 5, 17, 30, 33])
def test_resume_with_last_epoch(kind, resume_at):
    """A scheduler rebuilt with last_epoch=k−1 (torch's convention: it steps once on
    construction) continues exactly where one that ran k steps is, before and after stepping."""
    base = 0.5
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    running_opt = torch.optim.SGD([p1], lr=base)
    running = MAKERS[kind](running_opt)
    for _ in range(resume_at):
        running_opt.step()
        running.step()
    resumed_opt = torch.optim.SGD([p2], lr=123.0)  # lr is overwritten from initial_lr
    resumed_opt.param_groups[0]["initial_lr"] = base
    resumed = MAKERS[kind](resumed_opt, last_epoch=resume_at - 1)
    for step in range(resume_at, resume_at + 8):
        expected = base * REFS[kind](step)
        assert running_opt.param_groups[0]["lr"] == pytest.approx(expected)
        assert resumed_opt.param_groups[0]["lr"] == pytest.approx(expected)
        for opt, sched in ((running_opt, running), (resumed_opt, resumed)):
            opt.step()
            sched.step()


def test_state_dict_round_trip_and_pickle():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = MAKERS["cosine"](opt)
    for _ in range(12):
        opt.step()
        sched.step()
    state = sched.state_dict()
    fresh_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = MAKERS["cosine"](fresh_opt)
    fresh.load_state_dict(state)
    opt.step()
    sched.step()
    fresh_opt.step()
    fresh.step()
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(REFS["cosine"](13))
    fn = pickle.loads(pickle.dumps(sched.lr_lambdas[0]))
    assert fn(13) == sched.lr_lambdas[0](13)


# ---------------------------------------------------------------- bad input


def test_bad_input_messages():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        get_cosine_schedule_with_warmup(opt, 1, 10, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        get_wsd_schedule_with_warmup(opt, 1, 10, min_lr_ratio=-0.1)
    with pytest.raises(ValueError, match="init_lr_ratio"):
        get_cosine_schedule_with_warmup(opt, 1, 10, init_lr_ratio=2.0)
    with pytest.raises(ValueError, match="stable_ratio"):
        get_wsd_schedule_with_warmup(opt, 1, 10, stable_ratio=1.2)
    with pytest.raises(ValueError, match="num_cycles"):
        get_cosine_schedule_with_warmup(opt, 1, 10, num_cycles=-0.5)
    with pytest.raises(ValueError, match="num_warmup_steps"):
        get_constant_schedule_with_warmup(opt, -1)
    with pytest.raises(TypeError, match="num_warmup_steps"):
        get_cosine_schedule_with_warmup(opt, 1.5, 10)
    with pytest.raises(ValueError, match="num_training_steps"):
        get_wsd_schedule_with_warmup(opt, 0, -10)
    with pytest.raises(TypeError, match="optimizer"):
        get_cosine_schedule_with_warmup(None, 1, 10)
    with pytest.raises(ValueError, match="last_epoch"):
        get_constant_schedule_with_warmup(opt, 1, last_epoch=-2)
    with pytest.raises(TypeError, match="zero_indexed_step"):
        get_cosine_schedule_with_warmup(opt, 1, 10, zero_indexed_step=1)
    with pytest.raises(ValueError, match="step"):
        cosine_schedule_lambda(-1, num_warmup_steps=1, num_training_steps=10)
    with pytest.raises(TypeError, match="step"):
        wsd_schedule_lambda(1.0, num_warmup_steps=1, num_training_steps=10)
    with pytest.raises(ValueError, match="num_warmup_steps"):
        constant_schedule_lambda(0, num_warmup_steps=-3)
