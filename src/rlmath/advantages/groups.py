"""Group ids and per-group statistics by segment reductions.

Outcome estimators (GRPO, RLOO, OPO, …) compare each response with the other
responses to the same prompt. The prompt is identified by a group ``index``:
a tensor, a numpy array or a list of any hashable ids, in any order, with
groups of any size. Ids are mapped to dense integers ``0 … G−1`` once (for a
tensor index by a sort on its device, never read on the host; on a CPU,
integer ids that already lie within ``B`` consecutive values are used as
they are, see :func:`segment_ids`), then every statistic is a
scatter/segment reduction over the batch (``index_add``, ``scatter_reduce``):
no Python loop over samples or groups, and no host sync.

Per-group buffers are sized ``B`` (there are at most ``B`` groups), so no
statistic needs the number of groups on the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlmath import _device
from rlmath._validation import check_tensor, result_dtype

__all__ = ["GroupStats", "group_ids", "group_stats"]


def group_ids(
    index: Any, batch_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Map group ids of any hashable type to dense ``int64`` ids in ``[0, G)``.

    Args:
        index: The group of each sample, length ``batch_size``: a 1-D tensor
            (integer, bool or floating), a 1-D numpy array (numeric, string or
            object), or a sequence of hashable ids (strings, ints, tuples, …).
            Numeric tensors and arrays take a vectorized path (a sort on the
            tensor's device: no host read, so a CUDA index causes no sync);
            other ids are hashed once each by a dict (C-level, no Python loop
            body per sample). Numpy arrays and lists are host data by nature.
        batch_size: ``B``; the length ``index`` must have.
        device: Where the result goes (default: the tensor's device, else CPU).

    Returns:
        Shape ``(B,)``, ``int64``. Equal ids map to equal integers; the order of
        the integers carries no meaning.
    """
    if isinstance(index, torch.Tensor):
        ids = _ids_from_tensor(index)
    elif type(index).__module__ == "numpy" and hasattr(index, "dtype"):
        ids = _ids_from_numpy(index)
    elif isinstance(index, (str, bytes)) or not isinstance(index, Sequence):
        raise TypeError(
            "index must be a torch.Tensor, a numpy array or a sequence of hashable ids, "
            f"got {type(index).__name__}"
        )
    else:
        ids = _ids_from_sequence(index)
    if ids.shape != (batch_size,):
        raise ValueError(
            f"index must hold one group id per sample ({batch_size}), got shape {tuple(ids.shape)}"
        )
    return ids.to(device) if device is not None else ids


#: Integer index dtypes that :func:`segment_ids` may use as labels directly.
_LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def segment_ids(
    index: Any, batch_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Group labels in ``[0, B)`` for the segment reductions: :func:`group_ids`, or the index itself.

    On a CPU an integer tensor (or numpy array) whose values lie within ``B``
    consecutive integers is a valid labelling already: shifted to start at 0,
    it is used without the sort (8192 ids: 0.4–0.6 ms of an outcome
    estimator's 3 ms). Its minimum and maximum are read on the host, which
    costs nothing there (:func:`rlmath._device.reads_host`); elsewhere, for
    ids spread wider, or while ``torch.compile`` traces (where the values are
    not known), :func:`group_ids` numbers them densely. The labels need
    not be dense: per-group buffers have ``B`` rows, and a segment reduction
    combines a group's members in batch order whatever its label, so the
    statistics are the same bits either way.
    """
    if type(index).__module__ == "numpy" and getattr(index, "dtype", None) is not None:
        if index.dtype.kind in "iu":
            index = torch.as_tensor(index)
    if (
        isinstance(index, torch.Tensor)
        and index.dim() == 1
        and index.numel() == batch_size > 0
        and index.dtype in _LABEL_DTYPES
        and _device.reads_host(index.device)
        and not torch.compiler.is_compiling()  # the shortcut reads values: data-dependent
    ):
        low, high = (int(v) for v in torch.aminmax(index))
        if high - low < batch_size:
            ids = index.to(torch.int64)
            if low != 0:
                ids = ids - low
            return ids.to(device) if device is not None else ids
    return group_ids(index, batch_size, device)


def _ids_from_tensor(index: torch.Tensor) -> torch.Tensor:
    """Dense ids by a sort, on the index's device, without a host read.

    ``torch.unique`` would give the same partition, but its output size
    depends on the data, which on CUDA is a device sync. Here: sort the ids
    (stable), mark where a sorted value differs from its predecessor, and
    number the runs with a cumulative sum; then scatter the run numbers back
    to the original positions. Every shape is ``(B,)``, known on the host.
    Equal values share an id; NaN ids are each their own group (NaN ≠ NaN).
    """
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    if index.is_complex():
        raise TypeError(f"index must be an integer, bool or floating tensor, got {index.dtype}")
    if index.dtype == torch.bool:
        index = index.to(torch.uint8)
    values, order = torch.sort(index, stable=True)
    starts = torch.ones(values.shape, dtype=torch.int64, device=values.device)
    if values.numel() > 1:
        starts = torch.cat([starts[:1], (values[1:] != values[:-1]).long()])
    run = starts.cumsum(0) - 1
    return torch.empty_like(run).scatter_(0, order, run)


def _ids_from_numpy(index: Any) -> torch.Tensor:
    if index.ndim != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype.kind in "biuf":
        return _ids_from_tensor(torch.as_tensor(index))
    return _ids_from_sequence(index.tolist())


def _ids_from_sequence(index: Sequence[Any]) -> torch.Tensor:
    items = list(index)
    if items and isinstance(items[0], torch.Tensor):
        # 0-d tensors hash by identity; compare their values instead.
        return _ids_from_tensor(torch.stack([torch.as_tensor(x).reshape(()) for x in items]))
    try:
        first_seen = dict.fromkeys(items)
    except TypeError as err:
        raise TypeError(f"index must hold hashable group ids: {err}") from None
    dense = dict(zip(first_seen, range(len(first_seen))))
    return torch.tensor(list(map(dense.__getitem__, items)), dtype=torch.long)


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's group, broadcast to the sample.

    Each field has the shape of the scores. Unpacks like a tuple:
    ``mean, std, count, zero_std = group_stats(scores, index)``.
    """

    mean: torch.Tensor
    """Group mean of the scores; fp32 (fp64 for fp64 scores)."""
    std: torch.Tensor
    """Unbiased group standard deviation; 0 for singletons and all-equal groups."""
    count: torch.Tensor
    """Group size, ``int64``."""
    zero_std: torch.Tensor
    """``bool``: the group is a singleton or all its scores are equal (no signal)."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.mean, self.std, self.count, self.zero_std))


def group_stats(scores: torch.Tensor, index: Any) -> GroupStats:
    """Per-group mean, std, size and a zero-std flag, broadcast per sample.

    Lets a trainer log or filter degenerate groups (all responses to a prompt
    right, or all wrong) without changing the ``(advantages, returns)``
    contract of the estimators. The mean of an all-equal group is exactly the
    common score, and its std is exactly 0.

    Args:
        scores: Shape ``(B,)`` or ``(B, K)`` (``K`` independent score columns),
            floating.
        index: Group id per sample, see :func:`group_ids`.

    Returns:
        :class:`GroupStats` with fields of shape ``scores.shape``.
    """
    check_tensor("scores", scores, floating=True)
    if scores.dim() not in (1, 2) or scores.shape[0] == 0:
        raise ValueError(
            f"scores must have shape (B,) or (B, K) with B >= 1, got {tuple(scores.shape)}"
        )
    ids = group_ids(index, scores.shape[0], scores.device)
    m = group_moments(scores.to(result_dtype(scores)), ids)
    size = m.size.round().long()
    return GroupStats(mean=m.mean, std=m.std, count=size, zero_std=m.zero_std)


class Moments(NamedTuple):
    """Per-sample group moments used by the estimators (each of the scores' shape)."""

    mean: torch.Tensor
    centered: torch.Tensor
    std: torch.Tensor
    size: torch.Tensor
    zero_std: torch.Tensor


def segment_sum(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-group sums of ``x`` along dim 0; row ``g`` of the result is group ``g``."""
    return x.new_zeros(x.shape).index_add_(0, ids, x)


def segment_reduce(x: torch.Tensor, ids: torch.Tensor, reduce: str) -> torch.Tensor:
    """Per-group ``amax`` / ``amin`` of floating ``x`` along dim 0.

    The buffer starts at the reduction's identity (−inf for ``amax``, +inf for
    ``amin``; absent groups keep it), so every group reduces its own values
    only: the same result as ``include_self=False``, at a third of its cost
    on a CPU (it skips a pass that marks the rows written).
    """
    if reduce not in ("amax", "amin"):
        raise ValueError(f"reduce must be 'amax' or 'amin', got {reduce!r}")
    if not x.is_floating_point():
        raise TypeError(f"segment_reduce takes floating values, got {x.dtype}")
    index = ids.view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    identity = -torch.inf if reduce == "amax" else torch.inf
    return x.new_full(x.shape, identity).scatter_reduce_(0, index, x, reduce)


def to_samples(per_group: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row ``ids[i]`` of ``per_group`` for each sample ``i``.

    An ``index_select``: on a CPU a quarter of the time of ``per_group[ids]``
    (5 vs 20 µs for 8192 samples), which goes through advanced indexing.
    """
    return per_group.index_select(0, ids)


def group_moments(scores: torch.Tensor, ids: torch.Tensor) -> Moments:
    """Mean, centered scores, unbiased std, size and zero-std flag of each sample's group.

    Two-pass (mean, then squared deviations) for accuracy. A group whose
    scores are all equal (singletons included) gets its common value as the
    mean, centered scores of exactly 0 and std exactly 0, so every estimator
    built on ``centered`` returns exactly 0 there, never NaN. NaN scores
    propagate to their group.

    Shape: ``scores`` ``(B,)`` or ``(B, K)``, fp32/fp64; ``ids`` ``(B,)`` labels in ``[0, B)``.
    """
    count_g = segment_sum(torch.ones_like(scores), ids)
    mean_g = segment_sum(scores, ids) / count_g.clamp(min=1)
    high = segment_reduce(scores, ids, "amax")
    flat_g = high == segment_reduce(scores, ids, "amin")
    mean_g = torch.where(flat_g, high, mean_g)
    mean, flat, size = (to_samples(g, ids) for g in (mean_g, flat_g, count_g))
    centered = torch.where(flat, 0, scores - mean)
    square_g = segment_sum(centered * centered, ids)
    var_g = torch.where(count_g > 1, square_g / (count_g - 1).clamp(min=1), 0)
    std = to_samples(var_g.sqrt(), ids)
    return Moments(mean=mean, centered=centered, std=std, size=size, zero_std=flat)
