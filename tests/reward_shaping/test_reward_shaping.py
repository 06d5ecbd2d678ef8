"""Every registered reward shaping: fp64 loop oracles from the papers, the shared contract,
masked junk, low precision, empty batches; hand-worked DAPO numbers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rlmath as R
from rlmath.reward_shaping import registry

from ..host_sync import forbid_host_reads

NAMES = R.list_reward_shapings()
T = 12


def _batch(seed: int, b: int = 9, dtype=torch.float64):
    """Right-padded responses of lengths 0..T with a few masked tool spans, an outcome reward
    on the last valid token plus small dense rewards, and a truncation flag per row."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (b,), generator=gen)
    lengths[0], lengths[1] = T, 0
    mask = torch.arange(T) < lengths[:, None]
    mask &= ~((torch.arange(T) == 3) & (torch.rand(b, 1, generator=gen) < 0.3))
    rewards = torch.randn(b, T, generator=gen, dtype=torch.float64) * 0.1
    truncated = (lengths == T) | (torch.rand(b, generator=gen) < 0.3)
    return rewards.to(dtype), mask, truncated


def _kwargs(name: str, truncated: torch.Tensor) -> dict:
    return {
        "soft_overlong_punishment": {"max_response_length": T, "overlong_buffer_length": 4,
                                     "penalty_factor": 0.5},
        "overlong_filter": {"truncated": truncated},
        "stop_properly_penalty": {"stop_properly_penalty_coef": 0.25, "truncated": truncated},
    }[name]  # fmt: skip


# ----------------------------------------------------------------------------- oracles


def _rows(x):
    return x.tolist()


def soft_overlong_oracle(rewards, mask, *, max_response_length, overlong_buffer_length,
                         penalty_factor=1.0, **_):  # fmt: skip
    """DAPO eq. 13 case by case, times the factor, added on the last valid token."""
    out = torch.where(mask, rewards, 0).clone()
    start = max_response_length - overlong_buffer_length
    for i, row in enumerate(_rows(mask)):
        n = sum(row)
        if n == 0:
            continue
        if n <= start:
            penalty = 0.0
        elif n <= max_response_length:
            penalty = (start - n) / overlong_buffer_length
        else:
            penalty = -1.0
        last = max(j for j, v in enumerate(row) if v)
        out[i, last] += penalty_factor * penalty
    return out, mask


def overlong_filter_oracle(rewards, mask, *, truncated, **_):
    keep = mask & ~truncated[:, None]
    return torch.where(keep, rewards, 0), keep


def stop_properly_oracle(rewards, mask, *, stop_properly_penalty_coef, truncated, **_):
    out = torch.where(mask, rewards, 0).clone()
    for i, row in enumerate(_rows(mask)):
        if not truncated[i] or not any(row):
            continue
        if stop_properly_penalty_coef >= 0:
            out[i] = out[i] * stop_properly_penalty_coef
        else:
            out[i] = 0
            out[i, max(j for j, v in enumerate(row) if v)] = stop_properly_penalty_coef
    return out, mask


ORACLES = {
    "soft_overlong_punishment": soft_overlong_oracle,
    "overlong_filter": overlong_filter_oracle,
    "stop_properly_penalty": stop_properly_oracle,
}


def test_every_registered_shaping_has_an_oracle():
    assert sorted(ORACLES) == NAMES


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_its_oracle_and_the_contract(name, seed):
    rewards, mask, truncated = _batch(seed)
    kw = _kwargs(name, truncated)
    before = rewards.clone()
    out = R.get_reward_shaping(name)(rewards, mask, **kw)
    want_rewards, want_mask = ORACLES[name](rewards, mask, **kw)
    assert torch.equal(rewards, before)  # inputs untouched
    assert out.token_level_rewards.dtype == torch.float64
    torch.testing.assert_close(out.token_level_rewards, want_rewards, rtol=1e-15, atol=1e-15)
    assert torch.equal(out.response_mask, want_mask) and out.response_mask.dtype == mask.dtype
    assert torch.all(out.token_level_rewards[~out.response_mask] == 0)
    assert all(v.dim() == 0 and not v.requires_grad for v in out.metrics.values())
    with forbid_host_reads():
        R.get_reward_shaping(name)(rewards, mask, **kw)


@pytest.mark.parametrize("name", NAMES)
@given(
    junk=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    seed=st.integers(0, 1000),
)
def test_masked_junk_never_leaks(name, junk, seed):
    rewards, mask, truncated = _batch(seed)
    kw = _kwargs(name, truncated)
    a = R.get_reward_shaping(name)(rewards, mask, **kw)
    b = R.get_reward_shaping(name)(torch.where(mask, rewards, junk), mask, **kw)
    assert torch.equal(a.token_level_rewards, b.token_level_rewards)
    for k in a.metrics:
        assert torch.equal(a.metrics[k], b.metrics[k])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_against_fp64_of_the_same_inputs(name, dtype):
    rewards, mask, truncated = _batch(3, dtype=dtype)
    kw = _kwargs(name, truncated)
    low = R.get_reward_shaping(name)(rewards, mask, **kw)
    wide = R.get_reward_shaping(name)(rewards.double(), mask, **kw)
    assert low.token_level_rewards.dtype == torch.float32
    # One fp32 rounding of a reward (< 2) plus a penalty (<= 0.5): 2^-23 relative.
    torch.testing.assert_close(low.token_level_rewards.double(), wide.token_level_rewards,
                               rtol=0, atol=3e-7)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(0, T), (3, 0)])
def test_empty_batches(name, shape):
    rewards = torch.zeros(shape, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    out = R.get_reward_shaping(name)(rewards, mask, **_kwargs(name, torch.zeros(shape[0]) > 0))
    assert out.token_level_rewards.shape == shape
    assert all(v.item() == 0 for v in out.metrics.values())


def test_dapo_by_hand():
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, then −1/4 per token, −1 at 20.
    lengths = [10, 16, 17, 18, 20]
    mask = torch.arange(20) < torch.tensor(lengths)[:, None]
    rewards = torch.zeros(5, 20, dtype=torch.float64)
    out = R.soft_overlong_punishment(rewards, mask, max_response_length=20,
                                     overlong_buffer_length=4)  # fmt: skip
    assert out.token_level_rewards.sum(-1).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert out.token_level_rewards[2, 16].item() == -0.25  # on the last valid token
    assert out.metrics["overlong_frac"].item() == pytest.approx(3 / 5)
    # A response counted longer than the limit (tool outputs included) stays at −factor.
    long = R.soft_overlong_punishment(rewards, mask, max_response_length=20,
                                      overlong_buffer_length=4, penalty_factor=2.0,
                                      response_length=torch.tensor([25, 0, 0, 0, 18]))  # fmt: skip
    assert long.token_level_rewards.sum(-1).tolist() == [-2.0, 0.0, 0.0, 0.0, -1.0]


def test_stop_properly_by_hand():
    rewards = torch.tensor([[0.0, 2.0], [0.5, 1.0], [0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    truncated = torch.tensor([True, False, True])
    out = R.stop_properly_penalty(rewards, mask, stop_properly_penalty_coef=0.5,
                                  truncated=truncated)  # fmt: skip
    assert out.token_level_rewards.tolist() == [[0.0, 1.0], [0.5, 1.0], [0.0, 0.0]]
    # OpenRLHF's negative coefficient replaces the reward.
    out = R.stop_properly_penalty(rewards, mask, stop_properly_penalty_coef=-0.5,
                                  truncated=truncated)  # fmt: skip
    assert out.token_level_rewards.tolist() == [[0.0, -0.5], [0.5, 1.0], [-0.5, 0.0]]
    assert out.metrics["truncated_frac"].item() == pytest.approx(2 / 3)


def test_registry_and_bad_input():
    assert R.get_reward_shaping("overlong_filter") is R.overlong_filter
    with pytest.raises(ValueError, match="valid values are"):
        R.get_reward_shaping("overlong")
    with pytest.raises(ValueError, match="already registered"):
        R.register_reward_shaping("overlong_filter")(lambda *a, **k: None)
    try:
        R.register_reward_shaping("test_only_shaping")(R.overlong_filter)
        assert "test_only_shaping" in R.list_reward_shapings()
    finally:
        registry._REGISTRY.pop("test_only_shaping", None)
    r, m = torch.zeros(2, 5), torch.ones(2, 5)
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        R.soft_overlong_punishment(r, m, max_response_length=5, overlong_buffer_length=6)
    with pytest.raises(ValueError, match="max_response_length"):
        R.soft_overlong_punishment(r, m, max_response_length=0, overlong_buffer_length=1)
    with pytest.raises(ValueError, match="penalty_factor"):
        R.soft_overlong_punishment(r, m, max_response_length=5, overlong_buffer_length=1,
                                   penalty_factor=-1.0)  # fmt: skip
    with pytest.raises(ValueError, match="response_length"):
        R.soft_overlong_punishment(r, m, max_response_length=5, overlong_buffer_length=1,
                                   response_length=torch.ones(3))  # fmt: skip
    with pytest.raises(ValueError, match="truncated is required"):
        R.overlong_filter(r, m)
    with pytest.raises(ValueError, match="truncated"):
        R.overlong_filter(r, m, truncated=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="stop_properly_penalty_coef"):
        R.stop_properly_penalty(r, m, stop_properly_penalty_coef=1.5, truncated=torch.ones(2))
    with pytest.raises(ValueError, match="token_level_rewards"):
        R.overlong_filter(torch.zeros(5), torch.ones(5), truncated=torch.ones(5))
