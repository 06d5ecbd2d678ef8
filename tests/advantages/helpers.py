"""Shared inputs for the advantage-estimator tests.

Batches have masks with interior gaps (multi-turn tool spans), ragged lengths,
empty rows, and shuffled groups of unequal sizes with singletons and all-equal
groups, because those are the cases where implementations disagree.
"""

from __future__ import annotations

import torch


def gap_mask(b: int, t: int, gen: torch.Generator, *, p_gap: float = 0.2) -> torch.Tensor:
    """``[b, t]`` bool: a valid prefix of random length with random interior holes."""
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    mask = torch.arange(t).expand(b, t) < lengths[:, None]
    return mask & (torch.rand(b, t, generator=gen) >= p_gap)


def span_mask(b: int, t: int, gen: torch.Generator, *, spans: int = 3) -> torch.Tensor:
    """``[b, t]`` bool: prefix of length ≥ t/2 with ``spans`` masked interior spans (tool outputs)."""
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    pos = torch.arange(t).expand(b, t)
    mask = pos < lengths[:, None]
    for _ in range(spans):
        start = torch.randint(0, t, (b, 1), generator=gen)
        width = torch.randint(1, max(2, t // 16), (b, 1), generator=gen)
        mask &= ~((pos >= start) & (pos < start + width))
    return mask


def grouped_batch(seed: int, *, t: int = 9, dtype: torch.dtype = torch.float64):
    """A shuffled batch with groups of sizes 1..5, an all-equal group and two empty rows.

    Returns ``(rewards [B, T], mask [B, T] bool, index LongTensor [B])``; the
    outcome reward sits on the last valid token, plus small dense rewards on
    some rows so that token-level estimators see more than one nonzero.
    """
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 1, 2, 3, 4, 5, 3, 2]
    index = torch.cat([torch.full((n,), 10 * g + 7) for g, n in enumerate(sizes)])
    b = index.numel()
    mask = gap_mask(b, t, gen)
    # At least one valid token per row, except two explicitly empty rows.
    mask[torch.arange(b), torch.randint(0, t, (b,), generator=gen)] = True
    rewards = torch.zeros(b, t, dtype=torch.float64)
    last = (torch.arange(t) * mask).argmax(-1)
    rewards[torch.arange(b), last] = torch.randint(0, 3, (b,), generator=gen).double()
    dense = torch.rand(b, generator=gen) < 0.5
    rewards += torch.where(
        dense[:, None] & mask, 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64), 0
    )
    # Group of size 3 (index 37): all-equal scores, one reward each on a valid token.
    flat = index == 37
    rewards[flat] = 0.0
    rewards[flat, last[flat]] = 1.5
    # Two empty rows inside groups of size 4 and 5.
    empty = torch.nonzero(index == 27)[0, 0], torch.nonzero(index == 47)[0, 0]
    for i in empty:
        mask[i] = False
        rewards[i] = 0.0
    perm = torch.randperm(b, generator=gen)
    return rewards[perm].to(dtype), mask[perm], index[perm]


def junk_under_mask(x: torch.Tensor, mask: torch.Tensor, junk: float) -> torch.Tensor:
    """``x`` with every masked position replaced by ``junk`` (NaN, inf, 1e30, …)."""
    return torch.where(mask, x, torch.full_like(x, junk))


#: Unit roundoff of fp64.
U64 = torch.finfo(torch.float64).eps / 2


def reordered_sum_atol(n_terms: int, abs_sum: float) -> float:
    """Largest difference between two fp64 evaluations of a sum of ``n_terms`` terms.

    Computed in any order (any summation tree: sequential, pairwise, a scan), a
    sum of n terms is within (n − 1)·u·Σ|terms| of the exact value (Higham,
    "Accuracy and Stability of Numerical Algorithms", §4.2), so two orders are
    within twice that; the factor 4 also covers the products that build the
    terms (each a few roundings, ≤ n·u relative for powers of γλ up to n).
    """
    return 4 * n_terms * U64 * abs_sum
