"""Top-ρ high-entropy token mask: the exact masked quantile, on one process and two gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from rlmath import high_entropy_token_mask, masked_quantile
from rlmath.distributed import run_distributed

from ..host_sync import forbid_host_reads


def test_worked_example():
    # Valid entropies 0.1, 0.5, 0.9, 1.3, 2.0 (a masked 5.0 never counts). ρ = 0.5: the
    # 0.5 quantile sits at rank 0.5·(5 − 1) = 2, the value 0.9: 0.9, 1.3, 2.0 are kept.
    entropy = torch.tensor([[0.1, 5.0, 0.9], [2.0, 0.5, 1.3]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    out = high_entropy_token_mask(entropy, mask, top_entropy_quantile=0.5)
    assert out.threshold.item() == 0.9
    assert out.keep.tolist() == [[False, False, True], [True, False, True]]
    assert out.metrics["high_entropy_frac"].item() == pytest.approx(3 / 5)
    # ρ = 0.2 (the paper's): rank 0.8·4 = 3.2, between 1.3 and 2.0: 1.3 + 0.2·0.7 = 1.44.
    out = high_entropy_token_mask(entropy, mask)
    assert out.threshold.item() == pytest.approx(1.44, rel=1e-15)
    assert out.keep.tolist() == [[False, False, False], [True, False, False]]
    # ρ = 1 keeps every valid token, ρ = 0 the maximum only.
    assert torch.equal(high_entropy_token_mask(entropy, mask, top_entropy_quantile=1.0).keep, mask)
    assert high_entropy_token_mask(entropy, mask, top_entropy_quantile=0.0).keep.sum() == 1


SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, 1.0, 1.0, 1.0]


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 60),
    q=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, 0.5])),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    special=st.booleans(),
)
def test_masked_quantile_is_torch_quantile_bit_for_bit(seed, n, q, dtype, special):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 10 ** (seed % 5)
    if special:
        picks = torch.randint(0, len(SPECIAL), (n,), generator=gen)
        x = torch.where(
            torch.rand(n, generator=gen) < 0.5, torch.tensor(SPECIAL)[picks].double(), x
        )
    x = x.to(dtype)
    mask = torch.rand(n, generator=gen) < 0.7
    mask[0] = True
    got = masked_quantile(x, mask, q)
    want = torch.quantile(x[mask], q)
    assert got.dtype == want.dtype
    # Bit for bit (NaN only if both are; the lerp of ±inf endpoints may be NaN in both).
    assert torch.equal(got, want) or (got.isnan() and want.isnan())


def test_masked_quantile_nan_and_empty():
    x = torch.tensor([1.0, float("nan"), 3.0])
    assert masked_quantile(x, torch.tensor([True, True, True]), 0.5).isnan()
    assert masked_quantile(x, torch.tensor([True, False, True]), 0.5).item() == 2.0
    assert masked_quantile(x, torch.zeros(3, dtype=torch.bool), 0.5).item() == 0.0
    assert masked_quantile(torch.zeros(0, 4), torch.zeros(0, 4), 0.3).item() == 0.0


def _two_rank_worker(seed):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.rand(3, 7, generator=gen, dtype=torch.float64) * 4 for _ in range(2)]
    masks = [torch.rand(3, 7, generator=gen) < 0.6 for _ in range(2)]
    shards[1], masks[1] = shards[1][:2, :5], masks[1][:2, :5]  # ranks of different shapes
    group = dist.group.WORLD
    out = high_entropy_token_mask(shards[rank], masks[rank], top_entropy_quantile=0.3, group=group)
    q32 = masked_quantile(shards[rank].float(), masks[rank], 0.25, group=group)
    return out.keep, out.threshold, q32


@pytest.mark.integration
def test_two_gloo_ranks_equal_one_process_on_the_concatenation():
    seed = 3
    results = run_distributed(_two_rank_worker, 2, seed)
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.rand(3, 7, generator=gen, dtype=torch.float64) * 4 for _ in range(2)]
    masks = [torch.rand(3, 7, generator=gen) < 0.6 for _ in range(2)]
    shards[1], masks[1] = shards[1][:2, :5], masks[1][:2, :5]
    values = torch.cat([s[m] for s, m in zip(shards, masks)])
    want = torch.quantile(values, 1.0 - 0.3)
    want32 = torch.quantile(values.float(), 0.25)
    for rank, (keep, threshold, q32) in enumerate(results):
        assert torch.equal(threshold, want) and torch.equal(q32, want32)
        assert torch.equal(keep, masks[rank] & (shards[rank] >= want))


@given(
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30]),
    seed=st.integers(0, 1000),
)
def test_masked_values_never_leak(garbage, seed):
    gen = torch.Generator().manual_seed(seed)
    entropy = torch.rand(4, 6, generator=gen) * 3
    mask = torch.rand(4, 6, generator=gen) < 0.5
    a = high_entropy_token_mask(entropy, mask)
    b = high_entropy_token_mask(torch.where(mask, entropy, garbage), mask)
    assert torch.equal(a.keep, b.keep) and torch.equal(a.threshold, b.threshold)


def test_bf16_entropies_no_sync_and_bad_input():
    gen = torch.Generator().manual_seed(0)
    entropy = (torch.rand(6, 16, generator=gen) * 3).to(torch.bfloat16)
    mask = torch.rand(6, 16, generator=gen) < 0.8
    out = high_entropy_token_mask(entropy, mask)
    # TRL's rule on the same (rounded) inputs: the fp32 quantile, ``entropy >= threshold``.
    want = torch.quantile(entropy[mask].float(), 0.8)
    assert out.threshold.dtype == torch.float32 and torch.equal(out.threshold, want)
    assert torch.equal(out.keep, mask & (entropy.float() >= want))
    with forbid_host_reads():
        high_entropy_token_mask(entropy, mask)
        masked_quantile(entropy.double(), mask, 0.3)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        high_entropy_token_mask(entropy, mask, top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="response_mask"):
        high_entropy_token_mask(entropy, mask[:, :3])
    with pytest.raises(TypeError, match="entropy"):
        high_entropy_token_mask(entropy.long(), mask)
    with pytest.raises(ValueError, match="q"):
        masked_quantile(entropy, mask, -0.1)
