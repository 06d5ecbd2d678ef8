"""Loss aggregation that is exact under data parallelism and gradient accumulation.

A per-token loss matrix ``loss_mat`` of shape ``(*, T)`` (usually ``(B, T)``:
one row per sequence) is reduced to a scalar by one of these modes:

===========================  =============================================  =====================
mode                         loss                                           used by
===========================  =============================================  =====================
``token-mean``               Σ_{i,t} l_{it} / N_tokens                      PPO, DAPO
``token-sum``                Σ_{i,t} l_{it}                                 (verl's ``token-sum``)
``seq-mean-token-mean``      (1/S) Σ_i (Σ_t l_{it} / n_i)                   GRPO
``seq-mean-token-sum``       (1/S) Σ_i Σ_t l_{it}                           (sequence sums)
``seq-mean-token-sum-norm``  (1/(S·norm_length)) Σ_i Σ_t l_{it}             Dr.GRPO
``prompt-mean``              (1/P) Σ_p (Σ_{i∈p} Σ_t l_{it} / N_p)           SkyRL's ``prompt_mean``
===========================  =============================================  =====================

``n_i`` is the number of valid tokens of sequence i (the sum of its mask
weights), ``N_tokens = Σ_i n_i`` and ``S`` the number of sequences with at
least one valid token: a fully masked sequence never counts as a sequence.
``prompt-mean`` averages over the ``P`` prompts (groups of responses to one
prompt, with at least one valid token) the token mean within each prompt,
``N_p = Σ_{i∈p} n_i``: every prompt weighs the same whatever the length or
number of its responses. It needs each row's ``N_p`` as
``prompt_num_tokens`` (:func:`prompt_batch_info` computes it from the group
ids); ``P`` defaults to ``Σ_i n_i / N_{p(i)}``, exact when the call holds
whole prompts.

**Data parallelism.** With ``R = dp_size`` ranks, each running ``M`` gradient-
accumulation micro-batches, pass the counts of the *whole optimizer step*
(every rank, every micro-batch) as ``global_num_tokens`` / ``global_num_seqs``
(:func:`global_batch_info` computes them). Every micro-batch loss is then
``R · Σ_{micro} (...) / global_count`` (for ``prompt-mean``, ``N_p`` counts
the prompt's tokens over the whole step and ``global_num_prompts`` its
prompts). DDP/FSDP average gradients over the
``R`` ranks and the micro-batch gradients are summed, so the optimizer sees
``(1/R) Σ_r Σ_m ∇ loss_{r,m} = ∇ (full-batch loss)`` exactly, for every mode,
whatever the sequence lengths, padding widths or micro-batch sizes.

**The aggregation arguments travel together.** ``global_num_tokens``,
``global_num_seqs``, ``dp_size`` and ``norm_length`` are accepted by
:func:`agg_loss` and by every loss as keyword arguments
(:class:`AggregationKwargs`); :func:`global_batch_info` returns them as an
:class:`Aggregation`, which unpacks with ``**`` into any of those calls.
A loss checks them once (:meth:`Aggregation.of`) and hands the bundle to
:func:`aggregate`, the trusting core of :func:`agg_loss`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from rlmath._typing import Unpack
from rlmath._valid_select import where_valid
from rlmath._validation import (
    as_dtype,
    check_choice,
    check_finite_scalar,
    check_in_range,
    check_int,
    check_mask,
    check_tensor,
    result_dtype,
    valid_mask,
)

__all__ = [
    "LOSS_AGG_MODES",
    "Aggregation",
    "AggregationKwargs",
    "agg_loss",
    "aggregate",
    "global_batch_info",
    "prompt_batch_info",
]

#: Every ``loss_agg_mode`` accepted by :func:`agg_loss` and the losses.
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "prompt-mean",
)

Count = torch.Tensor | int | float | None


#: The fields of :class:`Aggregation`, in order (a tuple rather than ``dataclasses.fields``,
#: which ``torch.compile`` cannot trace on a class).
_FIELDS = (
    "global_num_tokens",
    "global_num_seqs",
    "dp_size",
    "norm_length",
    "prompt_num_tokens",
    "global_num_prompts",
)


class AggregationKwargs(TypedDict, total=False):
    """The keyword arguments every loss accepts for its aggregation (see :class:`Aggregation`)."""

    global_num_tokens: Count
    global_num_seqs: Count
    dp_size: int
    norm_length: float | None
    prompt_num_tokens: torch.Tensor | None
    global_num_prompts: Count


def _check_count(name: str, value: Count) -> Count:
    """A global count: a finite number > 0, or a one-element real tensor (not read: no sync).

    A Python (or numpy) number is checked here, on the host. A tensor is only
    checked for its shape and dtype; its value is checked on the device by
    :func:`_divide`, which turns a non-finite or negative count into a NaN loss.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real-valued tensor, got dtype {value.dtype}")
        return value
    try:
        count = check_finite_scalar(name, value)
    except TypeError:
        raise TypeError(
            f"{name} must be a number or a 0-d tensor, got {type(value).__name__}"
        ) from None
    if not count > 0:
        raise ValueError(
            f"{name} must be > 0 (the number of valid tokens or sequences of the whole "
            f"optimizer step), got {count:g}"
        )
    return count


@dataclass(frozen=True)
class Aggregation(Mapping[str, Any]):
    """How a per-token loss is reduced across sequences, ranks and micro-batches.

    A mapping of the :class:`AggregationKwargs` it sets (``dp_size`` and every
    field that is not ``None``), so ``**aggregation`` passes them to
    :func:`agg_loss` or any loss, next to explicit keywords for the others;
    :func:`global_batch_info` returns one.

    Attributes:
        global_num_tokens: valid tokens (Σ mask) of the whole optimizer step over
            every rank and micro-batch, for ``token-mean``: a number, or a 0-d
            tensor kept on its device (never read on the host). ``None``: the
            local count (right only without data parallelism and gradient
            accumulation). A number must be finite and > 0; a tensor count of 0
            gives a loss of 0, a negative, inf or NaN one a NaN loss.
        global_num_seqs: sequences with at least one valid token in the whole
            step, for the ``seq-mean-*`` modes; same rules.
        dp_size: data-parallel ranks whose gradients DDP/FSDP average; with
            ``dp_size > 1`` the mode's global count is required and the loss is
            multiplied by ``dp_size`` to undo the averaging.
        norm_length: the constant Dr.GRPO divides by, required for
            ``seq-mean-token-sum-norm`` (the maximum response length of the run).
        prompt_num_tokens: for ``prompt-mean`` (required there): a ``(*,)``
            tensor with, for each row of the loss, the number of valid tokens
            (mask weights) of all the responses to its prompt in the whole
            step (:func:`prompt_batch_info`); never read on the host.
        global_num_prompts: prompts with a valid token in the whole step, for
            ``prompt-mean``; same rules as the other counts.
    """

    global_num_tokens: Count = None
    global_num_seqs: Count = None
    dp_size: int = 1
    norm_length: float | None = None
    prompt_num_tokens: torch.Tensor | None = None
    global_num_prompts: Count = None

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Aggregation:
        """A checked :class:`Aggregation` from keyword arguments (unknown names raise)."""
        if not kwargs:
            return _LOCAL
        unknown = sorted(set(kwargs) - set(_FIELDS))
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the aggregation "
                "arguments are global_num_tokens, global_num_seqs, dp_size, norm_length, "
                "prompt_num_tokens, global_num_prompts"
            )
        norm_length = kwargs.get("norm_length")
        if norm_length is not None:
            norm_length = check_in_range("norm_length", norm_length, 0.0, None, low_inclusive=False)
        prompt_tokens = kwargs.get("prompt_num_tokens")
        if prompt_tokens is not None:
            check_tensor("prompt_num_tokens", prompt_tokens, real=True)
            if prompt_tokens.dtype == torch.bool:
                raise TypeError("prompt_num_tokens must hold counts, got a bool tensor")
        return cls(
            global_num_tokens=_check_count("global_num_tokens", kwargs.get("global_num_tokens")),
            global_num_seqs=_check_count("global_num_seqs", kwargs.get("global_num_seqs")),
            dp_size=check_int("dp_size", kwargs.get("dp_size", 1), 1),
            norm_length=norm_length,
            prompt_num_tokens=prompt_tokens,
            global_num_prompts=_check_count("global_num_prompts", kwargs.get("global_num_prompts")),
        )

    # As a mapping it holds the fields that are set (``dp_size`` always), so that
    # ``**aggregation`` combines with explicit keywords for the others.
    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def _keys(self) -> tuple[str, ...]:
        return tuple(k for k in _FIELDS if k == "dp_size" or getattr(self, k) is not None)


#: The aggregation of a call without aggregation arguments: local counts, one rank.
_LOCAL = Aggregation()


def _divide(num: torch.Tensor, den: torch.Tensor | int | float) -> torch.Tensor:
    """num / den, and num·0 where den == 0 (num is 0 there when den counts num's terms).

    A tensor ``den`` that is negative, inf or NaN gives NaN (computed on the
    device, so a bad count is visible in the loss without a host sync).
    """
    if isinstance(den, torch.Tensor):
        den = den.reshape(()).to(device=num.device, dtype=num.dtype)
        positive = den > 0
        out = torch.where(positive, num / torch.where(positive, den, 1.0), num * 0)
        # × NaN rather than torch.where: the gradient must turn NaN too.
        poison = torch.where(torch.isfinite(den) & (den >= 0), 1.0, torch.nan).to(out.dtype)
        return out * poison
    den = float(den)  # numpy scalars
    return num / den if den > 0 else num * 0


def _divide_local(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den for a count of this call's own weights (>= 0), and num (0 there) where den == 0."""
    if den.dtype == torch.bool or not den.is_floating_point():
        return num / den.clamp_min(1)  # an exact count of valid positions
    return num / torch.where(den > 0, den, 1)


def _scale(x: torch.Tensor, dp_size: int) -> torch.Tensor:
    return x if dp_size == 1 else x * dp_size


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    **aggregation: Unpack[AggregationKwargs],
) -> torch.Tensor:
    """Reduce a per-token loss matrix to the scalar to backpropagate.

    Args:
        loss_mat: per-token losses. Shape ``(*, T)``: the last dimension is
            tokens, every leading index is one sequence. Any float dtype.
        loss_mask: bool or 0/1 (or non-negative weights) of ``loss_mat``'s
            shape. Positions with mask 0 never influence the result or the
            gradient, even when ``loss_mat`` holds NaN or inf there.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (module docstring).
        **aggregation: ``global_num_tokens``, ``global_num_seqs``, ``dp_size``,
            ``norm_length`` (:class:`AggregationKwargs`, documented on
            :class:`Aggregation`), or ``**global_batch_info(...)``. verl
            silently falls back to the padded width of each micro-batch for
            ``norm_length``; rlmath requires it for ``seq-mean-token-sum-norm``.

    Returns:
        0-d tensor, fp32 (fp64 for fp64 ``loss_mat``). A batch with no valid
        token gives 0.
    """
    check_tensor("loss_mat", loss_mat, floating=True)
    check_mask("loss_mask", loss_mask, "loss_mat", loss_mat)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    agg = Aggregation.of(aggregation)
    if loss_mat.dim() == 0:
        raise ValueError("loss_mat must have at least one dimension (tokens), got a 0-d tensor")
    dtype = result_dtype(loss_mat)
    if loss_mask.dtype == torch.bool:
        return aggregate(as_dtype(loss_mat, dtype), loss_mask, None, loss_agg_mode, agg)
    valid = loss_mask != 0
    return aggregate(
        as_dtype(loss_mat, dtype),
        valid,
        torch.where(valid, loss_mask.to(dtype), 0),
        loss_agg_mode,
        agg,
    )


def aggregate(
    loss_mat: torch.Tensor,
    valid: torch.Tensor,
    weight: torch.Tensor | None,
    loss_agg_mode: str,
    agg: Aggregation,
) -> torch.Tensor:
    """The core of :func:`agg_loss`, for inputs a caller has already checked.

    Args:
        loss_mat: ``(*, T)`` per-token losses in the result dtype (any value
            where ``valid`` is False: they are selected out).
        valid: ``(*, T)`` bool mask.
        weight: ``(*, T)`` mask weights in the result dtype, 0 where not valid;
            ``None``: 1 where ``valid`` (a bool mask).
        loss_agg_mode: a member of :data:`LOSS_AGG_MODES`.
        agg: the checked aggregation arguments.
    """
    weighted = where_valid(valid, loss_mat)
    if weight is not None:
        weighted = weighted * weight
    dp_size = agg.dp_size
    if loss_agg_mode == "token-sum":
        return _scale(weighted.sum(), dp_size)
    if loss_agg_mode == "token-mean":
        tokens = agg.global_num_tokens
        if tokens is None:
            if dp_size > 1:
                raise ValueError(
                    "global_num_tokens is required for loss_agg_mode 'token-mean' when "
                    f"dp_size > 1 (got dp_size={dp_size}); compute it with global_batch_info"
                )
            count = valid.sum() if weight is None else weight.sum()
            return _divide_local(weighted.sum(), count)
        return _scale(_divide(weighted.sum(), tokens), dp_size)
    if loss_agg_mode == "prompt-mean":
        if weight is None:
            weight = valid.to(loss_mat.dtype)
        return _prompt_mean(weighted, weight, agg)
    if loss_agg_mode == "seq-mean-token-sum-norm" and agg.norm_length is None:
        raise ValueError(
            "norm_length is required for loss_agg_mode 'seq-mean-token-sum-norm' "
            "(Dr.GRPO divides by a constant: pass the maximum response length; "
            "verl's fallback to the padded width varies between micro-batches)"
        )
    seq_total = weighted.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_tokens = valid.sum(dim=-1) if weight is None else weight.sum(dim=-1)
        seq_valid = seq_tokens > 0
        per_seq = seq_total / _nonzero(seq_tokens, seq_valid)
    else:
        # A row without weight sums to 0: it adds nothing to the total, only the count
        # of sequences skips it.
        seq_valid = valid.any(dim=-1) if weight is None else weight.sum(dim=-1) > 0
        per_seq = seq_total
        if loss_agg_mode == "seq-mean-token-sum-norm":
            assert agg.norm_length is not None
            per_seq = seq_total / float(agg.norm_length)
    total = per_seq.sum()
    seqs = agg.global_num_seqs
    if seqs is None:
        if dp_size > 1:
            raise ValueError(
                f"global_num_seqs is required for loss_agg_mode {loss_agg_mode!r} when "
                f"dp_size > 1 (got dp_size={dp_size}); compute it with global_batch_info"
            )
        return _divide_local(total, seq_valid.sum())
    return _scale(_divide(total, seqs), dp_size)


def _nonzero(count: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """``count`` with 1 where it is not positive (a divisor for rows without weight)."""
    if not count.is_floating_point():
        return count.clamp_min(1)  # an exact count: positive == (count >= 1)
    return torch.where(positive, count, torch.ones_like(count))


def _prompt_mean(weighted: torch.Tensor, weight: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """``(1/P) Σ_i (Σ_t w·l)_i / N_{p(i)}`` times ``dp_size`` (see the module docstring)."""
    tokens = agg.prompt_num_tokens
    if tokens is None:
        raise ValueError(
            "prompt_num_tokens is required for loss_agg_mode 'prompt-mean' (each row's "
            "prompt-group token count over the step); compute it with prompt_batch_info"
        )
    rows = weighted.shape[:-1]
    if tokens.shape != rows:
        raise ValueError(
            f"prompt_num_tokens must have one count per row of the loss {tuple(rows)}, "
            f"got shape {tuple(tokens.shape)}"
        )
    counts = tokens.to(device=weighted.device, dtype=weighted.dtype)
    row_tokens = weight.sum(dim=-1)
    live = row_tokens > 0
    # A live row's prompt count is > 0; if it is not, the 0 division shows up as inf/NaN.
    share = torch.where(live, 1 / torch.where(live, counts, torch.ones_like(counts)), 0)
    total = (weighted.sum(dim=-1) * share).sum()
    prompts = agg.global_num_prompts
    if prompts is None:
        if agg.dp_size > 1:
            raise ValueError(
                "global_num_prompts is required for loss_agg_mode 'prompt-mean' when "
                f"dp_size > 1 (got dp_size={agg.dp_size}); compute it with prompt_batch_info"
            )
        prompts = (row_tokens * share).sum()  # Σ_i n_i / N_p(i) = P for whole prompts
    return _divide(total, prompts) * agg.dp_size


def prompt_batch_info(
    loss_mask: torch.Tensor,
    index: Any,
    *,
    group: Any = None,
    num_prompt_ids: int | None = None,
) -> dict[str, torch.Tensor]:
    """The counts ``prompt-mean`` needs, for a whole optimizer step.

    Args:
        loss_mask: this rank's mask for the whole step, ``(B, T)`` (bool, 0/1
            or weights).
        index: the prompt (group) id of each of the ``B`` rows: a tensor,
            numpy array or list of hashable ids (as the advantage estimators).
        group: the ``torch.distributed`` process group the batch is split
            over; every rank must call. Without ``num_prompt_ids`` each
            prompt's rows must all be on one rank (only the number of prompts
            is summed over the ranks).
        num_prompt_ids: when the ids are integers in ``[0, num_prompt_ids)``
            meaning the same prompt on every rank, the per-prompt counts are
            all-reduced as a dense vector of that size, so a prompt's rows may
            be spread over ranks and micro-batches.

    Returns:
        ``{"prompt_num_tokens": (B,), "global_num_prompts": 0-d}`` (fp64; fp32
        on devices without fp64), to pass with ``**`` to a loss or
        :func:`agg_loss` (slice ``prompt_num_tokens`` with the rows of each
        micro-batch).
    """
    check_tensor("loss_mask", loss_mask)
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must have shape (B, T), got {tuple(loss_mask.shape)}")
    batch, device = loss_mask.shape[0], loss_mask.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    valid = valid_mask(loss_mask)
    row_tokens = torch.where(valid, loss_mask.to(dtype), 0).sum(-1)
    import torch.distributed as dist

    from rlmath.engine.groups import is_distributed

    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialized")
    reduce = group is not None and is_distributed(group)
    if num_prompt_ids is not None:
        size = check_int("num_prompt_ids", num_prompt_ids, 1)
        ids = (
            torch.as_tensor(index, device=device) if not isinstance(index, torch.Tensor) else index
        )
        if ids.shape != (batch,) or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(
                f"index must be {batch} integer ids in [0, num_prompt_ids) when num_prompt_ids "
                f"is given, got shape {tuple(ids.shape)} and dtype {ids.dtype}"
            )
        ids = ids.to(device=device, dtype=torch.int64)
        per_id = torch.zeros(size, dtype=dtype, device=device).index_add_(0, ids, row_tokens)
        if reduce:
            dist.all_reduce(per_id, op=dist.ReduceOp.SUM, group=group)
        return {
            "prompt_num_tokens": per_id.index_select(0, ids),
            "global_num_prompts": (per_id > 0).sum().to(dtype),
        }
    from rlmath.advantages.groups import segment_ids, segment_sum, to_samples

    labels = segment_ids(index, batch, device)
    per_group = segment_sum(row_tokens, labels)
    prompts = (per_group > 0).sum().to(dtype)
    if reduce:
        dist.all_reduce(prompts, op=dist.ReduceOp.SUM, group=group)
    return {"prompt_num_tokens": to_samples(per_group, labels), "global_num_prompts": prompts}


def global_batch_info(
    loss_mask: torch.Tensor | Sequence[torch.Tensor],
    *,
    group: Any = None,
) -> Aggregation:
    """Token and sequence counts of a whole optimizer step, for :func:`agg_loss` and the losses.

    Args:
        loss_mask: this rank's mask for the whole optimizer step: one tensor
            ``(*, T)`` or a sequence of micro-batch masks (their widths may
            differ). Bool, 0/1 or non-negative weights.
        group: the ``torch.distributed`` process group over which the batch is
            split (``torch.distributed.group.WORLD`` for every rank), as the
            ``group`` of every function: ``None`` is this process alone. The
            counts are summed over it with one all-reduce (on the mask's
            device: no host sync) and ``dp_size`` is its size.

    Returns:
        An :class:`Aggregation` with ``global_num_tokens`` and
        ``global_num_seqs`` as 0-d fp64 tensors (fp32 on devices without
        fp64) and ``dp_size``; pass it as ``**info`` to :func:`agg_loss` and
        every loss. A fully masked sequence does not count in
        ``global_num_seqs``.
    """
    masks = [loss_mask] if isinstance(loss_mask, torch.Tensor) else list(loss_mask)
    if not masks:
        raise ValueError("loss_mask must be a tensor or a non-empty sequence of tensors")
    for i, m in enumerate(masks):
        check_tensor(f"loss_mask[{i}]", m)
        if m.dim() == 0:
            raise ValueError(f"loss_mask[{i}] must have at least one dimension, got a 0-d tensor")
        if m.device != masks[0].device:
            raise ValueError(
                f"loss_mask[{i}] is on {m.device} but loss_mask[0] is on {masks[0].device}"
            )
    device = masks[0].device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    counts = torch.zeros(2, dtype=dtype, device=device)
    for m in masks:
        valid = valid_mask(m)
        weight = torch.where(valid, m.to(dtype), 0)
        counts = counts + torch.stack([weight.sum(), (weight.sum(dim=-1) > 0).sum().to(dtype)])
    # Imported here: single-process callers never load torch.distributed code.
    import torch.distributed as dist

    from rlmath.engine.groups import group_size, is_distributed

    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialized")
    dp_size = 1
    if group is not None and is_distributed(group):
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dp_size = group_size(group)
    return Aggregation(global_num_tokens=counts[0], global_num_seqs=counts[1], dp_size=dp_size)
