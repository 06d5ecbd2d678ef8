"""On-device token selection for Clip-Cov / KL-Cov: no host sync, no data-dependent shapes.

A selection of a data-dependent number ``k`` of tokens is expressed as a rank
comparison: sort a key over all positions, give each position its rank, and
keep ``rank < k`` where ``k`` is a 0-d tensor. Nothing is read back to the host.
"""

from __future__ import annotations

import torch


def selection_count(valid: torch.Tensor, fraction: float) -> torch.Tensor:
    """``max(floor(fraction · n_valid), 1)`` as a 0-d tensor (fp64 where the device has it)."""
    dtype = torch.float32 if valid.device.type == "mps" else torch.float64
    n = valid.sum().to(dtype)
    return torch.clamp(torch.floor(n * fraction), min=1)


def _ranks(order: torch.Tensor) -> torch.Tensor:
    """Inverse permutation: ``ranks[order[j]] = j``."""
    ranks = torch.empty_like(order)
    return ranks.scatter(0, order, torch.arange(order.numel(), device=order.device))


def random_subset(
    candidate: torch.Tensor, k: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """A uniformly random subset of ``min(k, #candidates)`` of the ``True`` positions."""
    if generator is None:  # no ``generator=None``: that overload of rand needs concrete sizes
        keys = torch.rand(candidate.shape, device=candidate.device)
    else:
        keys = torch.rand(candidate.shape, generator=generator, device=candidate.device)
    keys = torch.where(candidate, keys, -1.0).reshape(-1)
    ranks = _ranks(torch.argsort(keys, descending=True))
    return candidate & (ranks.reshape(candidate.shape) < k)


def top_k(
    score: torch.Tensor, valid: torch.Tensor, k: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """The ``min(k, #valid)`` valid positions of largest ``score``.

    Ties are broken uniformly at random with ``generator``, or by position
    when it is None.
    """
    flat = torch.where(valid, score, -torch.inf).reshape(-1)
    if generator is None:
        order = torch.sort(flat, descending=True, stable=True).indices
    else:
        perm = torch.randperm(flat.numel(), generator=generator, device=flat.device)
        order = perm[torch.sort(flat[perm], descending=True, stable=True).indices]
    return valid & (_ranks(order).reshape(valid.shape) < k)
