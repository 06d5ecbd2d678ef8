"""Log-probs, entropy, exact KL and the fused LM head with the vocabulary split over ranks.

Tensor (Megatron-style vocabulary) parallelism: rank ``k`` of ``group`` holds
columns ``[start_k, start_k + V_k)`` of the logits (or rows of the LM-head
weight) for the *same* tokens as every other rank. Each function here returns,
on every rank, exactly what the single-process function of
:mod:`rlmath.logprobs` returns on the concatenated vocabulary, and its backward
gives each rank its own columns of the single-process gradient.

Layout of the shards:

- By default rank ``k`` (its rank in ``group``) holds columns
  ``[k·V_k, (k+1)·V_k)``: equal widths in rank order, Megatron's layout (which
  pads the vocabulary to a multiple of the group size).
- Shards of unequal width (say 50257 split 25128 + 25129): pass each rank's
  ``vocab_start_index``.
- Padding columns: either fill them with ``-inf`` (they then have probability 0
  and a zero gradient), or pass ``vocab_size``, the number of real tokens; local
  columns whose global id is ``≥ vocab_size`` are left out of the softmax (no
  copy of the logits is made) and receive a zero gradient.

``validate=True`` checks the layout across ranks (the shards tile the
vocabulary without gaps or overlap, every rank has the same number of rows and
the same labels) and that every label is a token id or ``ignore_index``; it
costs a collective and a host sync, so it is off by default.

Gradients: the outputs are replicated, so each rank is expected to compute the
same loss from them and run backward on it (as in Megatron). The gradient of
the logits needs no collective; the fused head all-reduces the gradient of
``hidden`` so that it is identical on every rank and equal to the unsharded one.
Every rank must make the same calls in the same order (each call runs 2-3
collectives over ``group``).

Never modifies an input (verl's tensor-parallel entropy subtracts from and adds
back to the caller's logits in place in its backward, which breaks a later
backward through them; verl's engine clones the whole logits to cope).
"""

from __future__ import annotations

import math

import torch

from rlmath._validation import check_same_shape
from rlmath.distributed._collectives import ProcessGroup
from rlmath.distributed.vocab_parallel_head import VocabParallelHeadFn, head_tile_sizes
from rlmath.distributed.vocab_parallel_layout import positive, shard_spec, validate_layout
from rlmath.distributed.vocab_parallel_logits import (
    VocabParallelKLFn,
    VocabParallelLogProbsEntropyFn,
    compute_dtype,
)
from rlmath.distributed.vocab_parallel_response import (
    vocab_parallel_log_probs_from_logits_response_rmpad,
    vocab_parallel_sum_pi_squared,
)
from rlmath.logprobs._inputs import check_logits, flatten_labels, normalize_temperature
from rlmath.logprobs.chunking import resolve_chunk_size

__all__ = [
    "vocab_parallel_entropy",
    "vocab_parallel_kl_from_logits",
    "vocab_parallel_log_probs_and_entropy",
    "vocab_parallel_log_probs_and_entropy_from_hidden",
    "vocab_parallel_log_probs_from_logits",
    "vocab_parallel_log_probs_from_logits_response_rmpad",
    "vocab_parallel_sum_pi_squared",
]

Temp = float | torch.Tensor


def _log_probs_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    temperature: Temp,
    ignore_index: int | None,
    vocab_start_index: int | None,
    vocab_size: int | None,
    group: ProcessGroup | None,
    chunk_size: int | None,
    validate: bool,
    want_entropy: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    logits = check_logits("logits_shard", logits_shard)
    batch = tuple(logits.shape[:-1])
    width, rows = logits.shape[-1], math.prod(batch)
    shard = shard_spec(
        width,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        group=group,
    )
    lab2d, out_shape = (
        flatten_labels(labels, logits, validate=False) if labels is not None else (None, ())
    )
    temp = normalize_temperature(
        temperature, batch, compute_dtype(logits), logits.device, validate=validate
    )
    if validate:
        validate_layout(shard, width, rows, lab2d, logits.device, group)
    chunk = resolve_chunk_size(chunk_size, width, rows, device=logits.device)
    logp, ent = VocabParallelLogProbsEntropyFn.apply(
        logits, lab2d, temp, want_entropy, chunk, shard, group
    )
    return (
        logp.view(out_shape) if lab2d is not None else None,
        ent.view(batch) if want_entropy else None,
    )


def vocab_parallel_log_probs_from_logits(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Temp = 1.0,
    ignore_index: int | None = -100,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Log-probability of each label under ``softmax(logits / temperature)`` over the full vocabulary.

    Equals :func:`rlmath.logprobs.log_probs_from_logits` on the logits
    concatenated over the ranks of ``group`` (``-`` Megatron's
    ``vocab_parallel_cross_entropy``), on every rank. ``logits[..., i, :]``
    scores ``labels[..., i]`` (no shift). Chunked over tokens: saves only the
    inputs and one fp32 log-sum-exp per row.

    Args:
        logits_shard: ``(..., V/tp)`` this rank's columns of the logits, any
            floating dtype and strides. Not modified.
        labels: ``(...)`` global token ids (``logits_shard.shape[:-1]``) or
            ``(..., K)`` for K candidates per row, any integer dtype; the same on
            every rank. A label owned by another rank is fine.
        temperature: float > 0 or a tensor broadcastable to ``logits_shard.shape[:-1]``
            (no gradient flows into it); the result equals the call on ``logits / T``.
        ignore_index: labels equal to it get log-prob 0 and no gradient; must
            not be a token id. ``None``: no label is ignored.
        vocab_start_index: global id of local column 0 (default
            ``rank · V/tp``; required for shards of unequal width).
        vocab_size: number of real tokens of the whole vocabulary; local columns
            with global id ``≥ vocab_size`` are padding, left out. ``None``: every
            column is real.
        group: tensor-parallel process group (``None``: the world; a single
            process when torch.distributed is not initialized).
        chunk_size: rows per chunk (``None``: from ``V/tp``); speed and memory only.
        validate: check the shard layout and labels across ranks (collective +
            host sync), and that a tensor temperature is positive.

    Returns:
        ``labels.shape``, fp32 (fp64 for fp64 logits), identical on every rank;
        differentiable w.r.t. ``logits_shard``.
    """
    logp, _ = _log_probs_entropy(
        logits_shard,
        labels,
        temperature=temperature,
        ignore_index=ignore_index,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        group=group,
        chunk_size=chunk_size,
        validate=validate,
        want_entropy=False,
    )
    assert logp is not None
    return logp


def vocab_parallel_entropy(
    logits_shard: torch.Tensor,
    *,
    temperature: Temp = 1.0,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the full vocabulary, per row.

    Equals :func:`rlmath.logprobs.entropy_from_logits` on the concatenated
    logits; ``-inf`` logits (padding) contribute 0 to value and gradient
    (``∂H/∂z = -p·(z - E_p[z]) / T``). Unlike verl's ``vocab_parallel_entropy``,
    the input is never modified and memory is bounded by chunking.

    Args:
        logits_shard: ``(..., V/tp)`` this rank's columns, any floating dtype. Not modified.
        temperature, vocab_start_index, vocab_size, group, chunk_size, validate:
            as in :func:`vocab_parallel_log_probs_from_logits`.

    Returns:
        ``logits_shard.shape[:-1]``, fp32 (fp64 for fp64 logits), identical on every rank.
    """
    _, ent = _log_probs_entropy(
        logits_shard,
        None,
        temperature=temperature,
        ignore_index=None,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        group=group,
        chunk_size=chunk_size,
        validate=validate,
        want_entropy=True,
    )
    assert ent is not None
    return ent


def vocab_parallel_log_probs_and_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: Temp = 1.0,
    ignore_index: int | None = -100,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Label log-probs and entropy in one pass over the local logits (and one backward pass).

    Args: as in :func:`vocab_parallel_log_probs_from_logits`.

    Returns:
        ``(log_probs, entropy)`` of shapes ``labels.shape`` and
        ``logits_shard.shape[:-1]``, fp32 (fp64 for fp64 logits). The entropy
        of a row does not depend on whether its label is ignored.
    """
    logp, ent = _log_probs_entropy(
        logits_shard,
        labels,
        temperature=temperature,
        ignore_index=ignore_index,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        group=group,
        chunk_size=chunk_size,
        validate=validate,
        want_entropy=True,
    )
    assert logp is not None and ent is not None
    return logp, ent


def vocab_parallel_kl_from_logits(
    logits_shard: torch.Tensor,
    ref_logits_shard: torch.Tensor,
    *,
    temperature: Temp = 1.0,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Exact ``KL(π ‖ π_ref)`` over the full vocabulary, per row.

    Equals :func:`rlmath.logprobs.kl_from_logits` on the concatenated logits.
    One pass over the local columns computes the KL restricted to the shard
    and the shard's probability mass under both models; the chain rule of the
    KL combines them (``Σ_k π_k·KL_k + KL(π‖ρ)`` over shards), so a small KL is
    not lost to cancellation. Three small collectives.

    Args:
        logits_shard: ``(..., V/tp)`` this rank's columns of the policy logits. Not modified.
        ref_logits_shard: the reference logits' columns, same shape (dtype may differ).
        temperature, vocab_start_index, vocab_size, group, chunk_size, validate:
            as in :func:`vocab_parallel_log_probs_from_logits`.

    Returns:
        ``logits_shard.shape[:-1]``, fp32 (fp64 if an input is fp64), ≥ 0,
        identical on every rank; differentiable w.r.t. both inputs.
    """
    logits = check_logits("logits_shard", logits_shard)
    ref = check_logits("ref_logits_shard", ref_logits_shard)
    check_same_shape("ref_logits_shard", ref, "logits_shard", logits)
    if ref.device != logits.device:
        raise ValueError(
            f"ref_logits_shard is on {ref.device} but logits_shard is on {logits.device}"
        )
    batch = tuple(logits.shape[:-1])
    width, rows = logits.shape[-1], math.prod(batch)
    shard = shard_spec(
        width,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        ignore_index=None,
        group=group,
    )
    temp = normalize_temperature(
        temperature, batch, compute_dtype(logits, ref), logits.device, validate=validate
    )
    if validate:
        validate_layout(shard, width, rows, None, logits.device, group)
    chunk = resolve_chunk_size(chunk_size, width, rows, device=logits.device)
    kl = VocabParallelKLFn.apply(logits, ref, temp, chunk, shard, group)
    return kl.view(batch)


def vocab_parallel_log_probs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias_shard: torch.Tensor | None = None,
    temperature: Temp = 1.0,
    ignore_index: int | None = -100,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    return_entropy: bool = True,
    reduce_grad_hidden: bool = True,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Label log-probs and entropy of ``hidden @ W.T (+ b)`` with ``W`` split over the vocabulary.

    Equals :func:`rlmath.fused_head.log_probs_and_entropy_from_hidden` with the
    whole weight (the full logits ``hidden @ W.T + b`` followed by
    :func:`rlmath.logprobs.log_probs_and_entropy_from_logits`), without ever
    holding ``(N, V)`` or even ``(N, V/tp)`` logits: blocks of rows × local
    vocabulary are computed, reduced and (in backward) recomputed. As there, a
    position whose label is ``ignore_index`` gets log-prob *and entropy* 0 and
    no gradient, and its hidden state is never read (NaN there is harmless). Gradients: ``hidden``
    receives the full (unsharded) gradient, all-reduced over ``group`` so it
    is identical on every rank (the adjoint of Megatron's column-parallel
    head, whose input is replicated); ``weight_shard`` and ``bias_shard``
    receive this rank's rows of the full gradient (zero on padding rows),
    accumulated in fp32 over chunks.

    Args:
        hidden: ``(..., H)`` floating (fp32, bf16, fp16 or fp64), the same on every rank.
        weight_shard: ``(V/tp, H)`` this rank's rows of the head, dtype of ``hidden``.
        labels: ``hidden.shape[:-1]`` or ``hidden.shape[:-1] + (K,)`` global token ids.
        bias_shard: ``(V/tp,)`` or ``None``, dtype of ``hidden``.
        temperature, ignore_index, vocab_start_index, vocab_size, group, validate:
            as in :func:`vocab_parallel_log_probs_from_logits` (the local
            vocabulary is the rows of ``weight_shard``).
        return_entropy: also compute the entropy (skipped otherwise: ``None``).
        reduce_grad_hidden: all-reduce the gradient of ``hidden`` over ``group``
            (the default: the full gradient on every rank). ``False`` returns
            each rank's own part ``g_k @ W_k``, for a caller whose graph already
            sums over the group in backward: Megatron's
            ``gather_from_sequence_parallel_region`` (sequence parallelism) or
            ``copy_to_tensor_model_parallel_region``; summing twice would scale
            the gradient by the group size.
        chunk_size: rows (tokens) per chunk (``None``: up to 512).
        vocab_chunk_size: local vocabulary columns per tile (``None``: a block
            of about 2M entries). Chunk sizes change speed and memory only
            (results agree to rounding).

    Returns:
        ``(log_probs, entropy)``: ``labels.shape`` and ``hidden.shape[:-1]``
        (or ``None``), fp32 (fp64 for fp64 inputs), identical on every rank.
    """
    x = check_logits("hidden", hidden)
    wt = check_logits("weight_shard", weight_shard)
    if wt.dim() != 2 or wt.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight_shard must have shape (V/tp, H) with H = hidden.shape[-1] = {x.shape[-1]}, "
            f"got {tuple(wt.shape)}"
        )
    tensors = [("weight_shard", wt)]
    if bias_shard is not None:
        bias_shard = check_logits("bias_shard", bias_shard)
        if tuple(bias_shard.shape) != (wt.shape[0],):
            raise ValueError(
                f"bias_shard must have shape ({wt.shape[0]},) (the rows of weight_shard), "
                f"got {tuple(bias_shard.shape)}"
            )
        tensors.append(("bias_shard", bias_shard))
    for name, other in tensors:
        if other.dtype != x.dtype:
            raise TypeError(f"{name} must have the dtype of hidden ({x.dtype}), got {other.dtype}")
        if other.device != x.device:
            raise ValueError(f"{name} is on {other.device} but hidden is on {x.device}")
    batch = tuple(x.shape[:-1])
    width, rows = wt.shape[0], math.prod(batch)
    shard = shard_spec(
        width,
        vocab_start_index=vocab_start_index,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        group=group,
    )
    # flatten_labels only needs the batch shape: hand it a (..., 1) stand-in for the logits.
    lab2d, out_shape = flatten_labels(labels, x[..., :1], validate=False)
    temp = normalize_temperature(temperature, batch, compute_dtype(x), x.device, validate=validate)
    if validate:
        validate_layout(shard, width, rows, lab2d, x.device, group)
    tiles = head_tile_sizes(
        rows,
        width,
        positive("chunk_size", chunk_size),
        positive("vocab_chunk_size", vocab_chunk_size),
    )
    logp, ent = VocabParallelHeadFn.apply(
        x.reshape(rows, x.shape[-1]),
        wt,
        bias_shard,
        lab2d,
        temp,
        return_entropy,
        tiles,
        shard,
        group,
        reduce_grad_hidden,
    )
    return logp.view(out_shape), ent.view(batch) if return_entropy else None
