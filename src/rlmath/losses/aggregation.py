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
===========================  =============================================  =====================

``n_i`` is the number of valid tokens of sequence i (the sum of its mask
weights), ``N_tokens = Σ_i n_i`` and ``S`` the number of sequences with at
least one valid token: a fully masked sequence never counts as a sequence.

**Data parallelism.** With ``R = dp_size`` ranks, each running ``M`` gradient-
accumulation micro-batches, pass the counts of the *whole optimizer step*
(every rank, every micro-batch) as ``global_num_tokens`` / ``global_num_seqs``
(:func:`global_batch_info` computes them). Every micro-batch loss is then
``R · Σ_{micro} (...) / global_count``. DDP/FSDP average gradients over the
``R`` ranks and the micro-batch gradients are summed, so the optimizer sees
``(1/R) Σ_r Σ_m ∇ loss_{r,m} = ∇ (full-batch loss)`` exactly, for every mode,
whatever the sequence lengths, padding widths or micro-batch sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlmath._validation import (
    check_choice,
    check_finite_scalar,
    check_in_range,
    check_int,
    check_mask,
    check_tensor,
    result_dtype,
)

__all__ = ["LOSS_AGG_MODES", "agg_loss", "global_batch_info"]

#: Every ``loss_agg_mode`` accepted by :func:`agg_loss` and the losses.
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

Count = torch.Tensor | int | float | None


def check_dp_size(dp_size: object) -> int:
    return check_int("dp_size", dp_size, 1)


def _check_count(name: str, value: Count) -> None:
    """A global count: a finite number > 0, or a one-element real tensor (not read: no sync).

    A Python (or numpy) number is checked here, on the host. A tensor is only
    checked for its shape and dtype; its value is checked on the device by
    :func:`_divide`, which turns a non-finite or negative count into a NaN loss.
    """
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real-valued tensor, got dtype {value.dtype}")
        return
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


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    global_num_tokens: Count = None,
    global_num_seqs: Count = None,
    dp_size: int = 1,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to the scalar to backpropagate.

    Args:
        loss_mat: per-token losses. Shape ``(*, T)``: the last dimension is
            tokens, every leading index is one sequence. Any float dtype.
        loss_mask: bool or 0/1 (or non-negative weights) of ``loss_mat``'s
            shape. Positions with mask 0 never influence the result or the
            gradient, even when ``loss_mat`` holds NaN or inf there.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES` (module docstring).
        global_num_tokens: number of valid tokens (Σ mask) of the whole
            optimizer step over every rank and micro-batch, for ``token-mean``.
            A 0-d tensor (kept on device: no host sync) or a number. ``None``
            uses the local count, which is only right without data
            parallelism and without gradient accumulation. A number (Python
            or numpy) must be finite and ``> 0``, else ``ValueError``. A
            tensor is never read on the host: a count of 0 (no valid token in
            the whole step, as :func:`global_batch_info` returns then) gives
            a loss of 0, and a negative, inf or NaN count gives a NaN loss
            (and NaN gradients), so that it cannot pass silently as 0.
        global_num_seqs: number of sequences with at least one valid token in
            the whole optimizer step, for the ``seq-mean-*`` modes; same rules
            as ``global_num_tokens``.
        dp_size: number of data-parallel ranks whose gradients DDP/FSDP
            average. With ``dp_size > 1`` the global count of the mode is
            required and the loss is multiplied by ``dp_size`` to undo the
            averaging.
        norm_length: the constant Dr.GRPO divides by, required for
            ``seq-mean-token-sum-norm`` (use the maximum response length of
            the run). verl silently falls back to the padded width of each
            micro-batch, which changes with the batch; rlmath raises instead.

    Returns:
        0-d tensor, fp32 (fp64 for fp64 ``loss_mat``). A batch with no valid
        token gives 0.
    """
    check_tensor("loss_mat", loss_mat, floating=True)
    check_mask("loss_mask", loss_mask, "loss_mat", loss_mat)
    check_choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    dp_size = check_dp_size(dp_size)
    _check_count("global_num_tokens", global_num_tokens)
    _check_count("global_num_seqs", global_num_seqs)
    if loss_mat.dim() == 0:
        raise ValueError("loss_mat must have at least one dimension (tokens), got a 0-d tensor")

    dtype = result_dtype(loss_mat)
    valid = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    weight = torch.where(valid, loss_mask.to(dtype), 0)
    weighted = torch.where(valid, loss_mat.to(dtype), 0) * weight

    if loss_agg_mode == "token-sum":
        return weighted.sum() * dp_size

    if loss_agg_mode == "token-mean":
        if global_num_tokens is None:
            if dp_size > 1:
                raise ValueError(
                    "global_num_tokens is required for loss_agg_mode 'token-mean' when "
                    f"dp_size > 1 (got dp_size={dp_size}); compute it with global_batch_info"
                )
            global_num_tokens = weight.sum()
        return _divide(weighted.sum(), global_num_tokens) * dp_size

    if loss_agg_mode == "seq-mean-token-sum-norm":
        if norm_length is None:
            raise ValueError(
                "norm_length is required for loss_agg_mode 'seq-mean-token-sum-norm' "
                "(Dr.GRPO divides by a constant: pass the maximum response length; "
                "verl's fallback to the padded width varies between micro-batches)"
            )
        norm_length = check_in_range("norm_length", norm_length, 0.0, None, low_inclusive=False)

    seq_total = weighted.sum(dim=-1)
    seq_tokens = weight.sum(dim=-1)
    seq_valid = seq_tokens > 0
    if loss_agg_mode == "seq-mean-token-mean":
        per_seq = seq_total / torch.where(seq_valid, seq_tokens, torch.ones_like(seq_tokens))
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        assert norm_length is not None
        per_seq = seq_total / float(norm_length)
    else:
        per_seq = seq_total
    if global_num_seqs is None:
        if dp_size > 1:
            raise ValueError(
                f"global_num_seqs is required for loss_agg_mode {loss_agg_mode!r} when "
                f"dp_size > 1 (got dp_size={dp_size}); compute it with global_batch_info"
            )
        global_num_seqs = seq_valid.sum().to(dtype)
    total = torch.where(seq_valid, per_seq, 0).sum()
    return _divide(total, global_num_seqs) * dp_size


def global_batch_info(
    loss_mask: torch.Tensor | Sequence[torch.Tensor],
    group: Any = None,
) -> dict[str, Any]:
    """Token and sequence counts of a whole optimizer step, for :func:`agg_loss`.

    Args:
        loss_mask: this rank's mask for the whole optimizer step: one tensor
            ``(*, T)`` or a sequence of micro-batch masks (their widths may
            differ). Bool, 0/1 or non-negative weights.
        group: a ``torch.distributed`` process group. When given, the counts
            are summed over it with one all-reduce (the tensor stays on the
            mask's device: no host sync) and ``dp_size`` is its size. ``None``
            means no communication: the counts are local and ``dp_size`` is 1
            (pass ``torch.distributed.group.WORLD`` to use the default group).

    Returns:
        ``{"global_num_tokens": t, "global_num_seqs": s, "dp_size": R}`` where
        ``t`` and ``s`` are 0-d fp64 tensors (fp32 on devices without fp64),
        ready to be passed as ``**info`` to :func:`agg_loss` and every loss.
        A fully masked sequence does not count in ``s``.
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
        valid = m if m.dtype == torch.bool else m != 0
        weight = torch.where(valid, m.to(dtype), 0)
        counts = counts + torch.stack([weight.sum(), (weight.sum(dim=-1) > 0).sum().to(dtype)])
    dp_size = 1
    if group is not None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("group was given but torch.distributed is not initialized")
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        dp_size = dist.get_world_size(group)
    return {"global_num_tokens": counts[0], "global_num_seqs": counts[1], "dp_size": dp_size}
