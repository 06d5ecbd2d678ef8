"""Train on the high-entropy "forking" tokens only (Wang et al. 2025, "Beyond the 80/20 Rule",
https://arxiv.org/abs/2506.01939).

Most tokens of a chain of thought are near-deterministic; the policy gradient
of the top-ρ fraction of tokens by entropy (the paper keeps ρ = 20 %) carries
the learning. TRL's ``top_entropy_quantile=ρ`` keeps the valid tokens whose
entropy is at least the ``(1 − ρ)`` quantile of the valid tokens' entropies,
gathered over every process of the step (``torch.quantile``'s linear
interpolation), and multiplies the per-token loss by that mask.

:func:`masked_quantile` computes that quantile exactly, over the valid
entries of every rank of a process group, without gathering the values and
without a host sync: the two order statistics the interpolation needs are
found by a radix selection on the values' bits (a 256-bin histogram of the
candidates per byte, all-reduced), a fixed number of passes (4 for fp32, 8
for fp64) whatever the data. The result is the one ``torch.quantile`` gives
on the concatenated valid values, bit for bit.

The mask is a statistic of the batch it is computed on (like Clip-Cov's
selection): per micro-batch, as TRL does, or once per optimizer step when
the whole step's entropies are at hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from rlmath._validation import check_in_range, check_mask, check_tensor, result_dtype, valid_mask

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HighEntropyMask", "high_entropy_token_mask", "masked_quantile"]

_BINS = 256


class HighEntropyMask(NamedTuple):
    """What :func:`high_entropy_token_mask` returns.

    ``keep``: bool ``(*, T)``, True on the valid tokens whose entropy is at
    least ``threshold``. ``threshold``: the 0-d quantile (fp32, fp64 for fp64
    entropies; 0 when no token is valid anywhere). ``metrics``: detached 0-d
    ``entropy_threshold`` and ``high_entropy_frac`` (the kept share of this
    call's valid tokens).
    """

    keep: torch.Tensor
    threshold: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if group is None:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _ordered_keys(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int64 keys whose unsigned order is the order of the float values, and their width in bits."""
    if x.dtype == torch.float64:
        bits = x.view(torch.int64)
        signed = torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
        return signed ^ -(2**63), 64  # flip the sign bit: unsigned order
    bits = x.view(torch.int32).to(torch.int64)
    signed = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return signed + 2**31, 32


def _values_of(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_ordered_keys`."""
    if dtype == torch.float64:
        signed = keys ^ -(2**63)
        return torch.where(signed < 0, signed ^ 0x7FFFFFFFFFFFFFFF, signed).view(torch.float64)
    signed = keys - 2**31
    bits = torch.where(signed < 0, signed ^ 0x7FFFFFFF, signed).to(torch.int32)
    return bits.view(torch.float32)


def _select(
    keys: torch.Tensor,
    valid: torch.Tensor,
    ranks: torch.Tensor,
    width: int,
    group: ProcessGroup | None,
) -> torch.Tensor:
    """The keys of the given 0-based ``ranks`` (``(R,)`` int64) among the valid keys of every rank."""
    flat_keys, flat_valid = keys.reshape(-1), valid.reshape(-1)
    n_targets = ranks.shape[0]
    candidate = flat_valid.expand(n_targets, -1)
    remaining = ranks.clone()
    prefix = torch.zeros_like(ranks)
    for shift in range(width - 8, -1, -8):
        digit = (flat_keys >> shift) & (_BINS - 1)
        hist = torch.zeros(n_targets, _BINS, dtype=torch.int64, device=keys.device)
        hist.scatter_add_(1, digit.expand(n_targets, -1), candidate.to(torch.int64))
        hist = _all_reduce(hist, group)
        below = hist.cumsum(1)
        # The target's byte: the first bin whose running count exceeds its rank.
        chosen = (below <= remaining.unsqueeze(1)).sum(1).clamp(max=_BINS - 1)
        before = torch.where(
            chosen > 0, below.gather(1, (chosen - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0
        )
        remaining = remaining - before
        # The byte's place value, by a product that cannot overflow: the top byte of a
        # 64-bit key is taken as signed (two's complement), as the key itself is.
        place = torch.where(chosen >= 128, chosen - _BINS, chosen) if shift == 56 else chosen
        prefix = prefix + place * 2**shift
        candidate = candidate & (digit.unsqueeze(0) == chosen.unsqueeze(1))
    return prefix


def masked_quantile(
    values: torch.Tensor,
    mask: torch.Tensor,
    q: float,
    *,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.quantile(values[mask], q)`` (linear interpolation), over every rank of ``group``.

    Args:
        values: any shape, float (computed in fp32, or fp64 for fp64 input).
        mask: bool or 0/1 of ``values``' shape; only the valid entries count.
        q: the quantile level in ``[0, 1]``.
        group: a ``torch.distributed`` process group: the quantile of the
            valid entries of all its ranks (every rank must call, each with
            its own tensors; the shapes may differ). None: this process only.

    Returns:
        0-d tensor: the quantile; NaN if a valid entry is NaN (as
        ``torch.quantile``); 0 when no entry is valid anywhere. Nothing is
        read on the host and no value leaves its rank (only histograms).
    """
    check_tensor("values", values, floating=True)
    check_mask("mask", mask, "values", values)
    q = check_in_range("q", q, 0.0, 1.0)
    dtype = result_dtype(values)
    valid = valid_mask(mask)
    x = torch.where(valid, values.to(dtype), 0)
    stats = torch.stack([valid.sum(), (valid & torch.isnan(x)).sum()]).to(torch.int64)
    stats = _all_reduce(stats, group)
    count, nans = stats[0], stats[1]
    # torch.quantile's ranks: q·(n − 1) in the values' dtype, then floor/ceil and lerp.
    pos = torch.tensor(q, dtype=dtype, device=x.device) * (count - 1).clamp(min=0).to(dtype)
    low, high = pos.floor().to(torch.int64), pos.ceil().to(torch.int64)
    keys, width = _ordered_keys(x)
    # NaN keys sort above +inf; a NaN result is chosen below anyway.
    found = _values_of(_select(keys, valid, torch.stack([low, high]), width, group), dtype)
    result = torch.lerp(found[0], found[1], pos - low.to(dtype))
    result = torch.where(nans > 0, torch.full_like(result, torch.nan), result)
    return torch.where(count > 0, result, torch.zeros_like(result))


def high_entropy_token_mask(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    top_entropy_quantile: float = 0.2,
    group: ProcessGroup | None = None,
) -> HighEntropyMask:
    """The valid tokens whose entropy is in the top ``top_entropy_quantile`` fraction.

    Args:
        entropy: per-token entropies, ``(*, T)`` (e.g. from
            :func:`rlmath.log_probs_and_entropy_from_logits`), float.
        response_mask: bool or 0/1 of ``entropy``'s shape.
        top_entropy_quantile: ρ in ``[0, 1]`` (TRL's name; the paper's 0.2):
            the threshold is the ``1 − ρ`` quantile, so ρ = 1 keeps every
            valid token and ρ = 0 the ones at the maximum.
        group: process group over which the quantile is taken (TRL gathers
            over every process); every rank must call.

    Returns:
        :class:`HighEntropyMask`. Multiply ``keep`` into the loss through
        ``rollout_is_weights`` to keep the normalisers (TRL), or into the
        response mask to drop the other tokens from the counts too.
    """
    top = check_in_range("top_entropy_quantile", top_entropy_quantile, 0.0, 1.0)
    check_tensor("entropy", entropy, floating=True)
    check_mask("response_mask", response_mask, "entropy", entropy)
    threshold = masked_quantile(entropy, response_mask, 1.0 - top, group=group)
    valid = valid_mask(response_mask)
    keep = valid & (entropy.detach().to(threshold.dtype) >= threshold)
    dtype = threshold.dtype
    n = valid.sum().to(dtype)
    metrics = {
        "entropy_threshold": threshold.detach(),
        "high_entropy_frac": keep.sum().to(dtype) / n.clamp(min=1),
    }
    return HighEntropyMask(keep, threshold.detach(), metrics)
