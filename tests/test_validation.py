"""Scalar arguments: numpy scalars and one-element tensors are numbers, bools never are.

The helpers of ``rlmath._validation`` first, then every public function that
takes a float or an int scalar, called with ``np.float32``/``np.int64`` and
0-d tensors: each gives exactly the result of the Python number.
"""

import math

import numpy as np
import pytest
import torch

import rlmath
from rlmath._validation import check_finite_scalar, check_in_range, check_int

REALS = [0.5, np.float32(0.5), np.float64(0.5), np.float16(0.5), np.array(0.5), torch.tensor(0.5)]
INTS = [3, np.int64(3), np.int32(3), np.uint8(3), np.array(3), torch.tensor(3)]


@pytest.mark.parametrize("value", REALS + INTS, ids=repr)
def test_finite_scalar_accepts_numpy_and_tensors(value):
    got = check_finite_scalar("x", value)
    assert type(got) is float and got in (0.5, 3.0)


@pytest.mark.parametrize("value", INTS, ids=repr)
def test_check_int_accepts_numpy_and_tensors(value):
    got = check_int("n", value, 0)
    assert type(got) is int and got == 3


@pytest.mark.parametrize(
    "value",
    [True, np.bool_(False), torch.tensor(True), torch.tensor(1 + 1j), "0.5", None, [0.5]],
    ids=repr,
)
def test_finite_scalar_rejects_non_numbers(value):
    with pytest.raises(TypeError, match="x must be a real number"):
        check_finite_scalar("x", value)


@pytest.mark.parametrize(
    "value", [2.0, np.float32(2.0), torch.tensor(2.0), True, np.bool_(True)], ids=repr
)
def test_check_int_rejects_floats_and_bools(value):
    with pytest.raises(TypeError, match="n must be an int"):
        check_int("n", value)


def test_bad_values_name_the_argument():
    with pytest.raises(ValueError, match=r"x must be finite, got inf"):
        check_finite_scalar("x", np.float32("inf"))
    with pytest.raises(ValueError, match=r"x must be finite, got nan"):
        check_finite_scalar("x", torch.tensor(float("nan")))
    with pytest.raises(ValueError, match=r"one-element tensor, got a tensor of shape \(2,\)"):
        check_finite_scalar("x", torch.zeros(2))
    with pytest.raises(ValueError, match=r"x must be in \[0, 1\], got 2"):
        check_in_range("x", np.float32(2.0), 0.0, 1.0)
    with pytest.raises(ValueError, match=r"n must be >= 1, got 0"):
        check_int("n", np.int64(0), 1)
    with pytest.raises(ValueError, match=r"n must be in \[0, 5\], got 6"):
        check_int("n", 6, 0, 5)
    with pytest.raises(ValueError, match=r"n must be <= 5, got 6"):
        check_int("n", torch.tensor(6), high=5)


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    logp = old + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) < 0.8
    mask[:, 0] = True
    return old, logp, adv, mask


def _calls():
    """(name, f(scalar) → result) for each scalar argument; the scalar's Python value is given."""
    old, logp, adv, mask = _batch()
    rewards = torch.zeros_like(adv)
    rewards[:, -1] = adv[:, 0]
    values = adv.flip(-1)
    index = [0, 0, 1]
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    vanilla = rlmath.get_policy_loss("vanilla")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    yield "gamma", 0.5, lambda s: rlmath.compute_gae_advantage_return(rewards, values, mask, s, 0.9)
    yield "lam", 0.5, lambda s: rlmath.compute_gae_advantage_return(rewards, values, mask, 1.0, s)
    yield (
        "gamma (reinforce++)",
        0.5,
        lambda s: rlmath.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=s),
    )
    yield "epsilon", 0.5, lambda s: rlmath.compute_grpo_outcome_advantage(rewards, mask, index, s)
    yield "clip_ratio", 0.5, lambda s: vanilla(old, logp, adv, mask, clip_ratio=s)
    yield "clip_ratio_high", 0.5, lambda s: vanilla(old, logp, adv, mask, clip_ratio_high=s)
    yield "clip_ratio_c", 3, lambda s: vanilla(old, logp, adv, mask, clip_ratio_c=s)
    yield (
        "norm_length",
        3,
        lambda s: rlmath.agg_loss(
            adv, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=s
        ),
    )
    yield "dp_size", 3, lambda s: rlmath.agg_loss(adv, mask, loss_agg_mode="token-sum", dp_size=s)
    yield "temperature", 0.5, lambda s: rlmath.compute_entropy_loss(logits, mask, temperature=s)[0]
    yield (
        "kl_coef",
        0.5,
        lambda s: rlmath.compute_rewards(rewards, old, logp, s, response_mask=mask),
    )
    yield "kl_coef (fixed)", 0.5, lambda s: rlmath.FixedKLController(s).value
    yield "init_kl_coef", 0.5, lambda s: rlmath.AdaptiveKLController(s, 0.1, 10).value

    def adaptive(s):
        c = rlmath.AdaptiveKLController(0.1, 0.2, 10)
        c.update(s, 4)
        return c.value

    yield "current_kl", 0.5, adaptive

    def adaptive_steps(s):
        c = rlmath.AdaptiveKLController(0.1, 0.2, 10)
        c.update(0.5, s)
        return c.value

    yield "n_steps", 3, adaptive_steps
    yield "eps", 0.5, lambda s: rlmath.masked_whiten(adv, mask, eps=s)
    yield (
        "min_lr_ratio",
        0.5,
        lambda s: rlmath.cosine_schedule_lambda(
            7, num_warmup_steps=2, num_training_steps=10, min_lr_ratio=s
        ),
    )
    yield (
        "num_training_steps",
        3,
        lambda s: rlmath.cosine_schedule_lambda(2, num_warmup_steps=1, num_training_steps=s),
    )
    yield (
        "schedule min_lr_ratio",
        0.5,
        lambda s: rlmath.get_cosine_schedule_with_warmup(opt, 1, 10, min_lr_ratio=s).lr_lambdas[0](
            5
        ),
    )
    yield "max_seq_len", 3, lambda s: rlmath.pad_sequence_to_length(torch.ones(2, 1), s, 0)
    yield (
        "threshold_high",
        3,
        lambda s: rlmath.rollout_correction(old, logp, mask, threshold_high=s),
    )


CALLS = list(_calls())


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [v for k, v in sorted(out.items())]
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flat(o)]
    return [torch.tensor(out)]


@pytest.mark.parametrize(("name", "python", "call"), CALLS, ids=[c[0] for c in CALLS])
def test_every_scalar_argument_takes_numpy_scalars_and_tensors(name, python, call):
    want = _flat(call(python))
    kinds = (
        [np.float32(python), np.float64(python), np.array(python), torch.tensor(float(python))]
        if isinstance(python, float)
        else [np.int64(python), np.int32(python), torch.tensor(python)]
    )
    for scalar in kinds:
        got = _flat(call(scalar))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "python", "call"), CALLS, ids=[c[0] for c in CALLS])
def test_every_scalar_argument_rejects_bool(name, python, call):
    with pytest.raises(TypeError):
        call(True)
    assert not math.isnan(python)
