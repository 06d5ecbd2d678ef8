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

These functions and the single-process ones of :mod:`rlmath.logprobs` and
:mod:`rlmath.fused_head` are the same operations of :mod:`rlmath.engine`
(one autograd function each, given this rank's :class:`~rlmath.engine.VocabShard`),
so they share every kernel, backend (``backend=``) and chunking rule.

Never modifies an input (verl's tensor-parallel entropy subtracts from and adds
back to the caller's logits in place in its backward, which breaks a later
backward through them; verl's engine clones the whole logits to cope).
"""

from __future__ import annotations

import math

import torch

from rlmath._validation import check_labels, check_logits, check_optional_int
from rlmath.distributed._collectives import ProcessGroup
from rlmath.distributed.vocab_parallel_layout import validate_layout
from rlmath.engine import VocabShard, api
from rlmath.logprobs.response import check_ids_and_mask, check_packed_logits

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


def _shard(
    x: torch.Tensor,
    width: int,
    labels: torch.Tensor | None,
    *,
    vocab_start_index: object,
    vocab_size: object,
    ignore_index: object,
    group: ProcessGroup | None,
    validate: bool,
    batch: tuple[int, ...],
    device_of: str,
) -> VocabShard:
    """This rank's shard from the keyword arguments; with ``validate``, the cross-rank check."""
    ig = check_optional_int("ignore_index", ignore_index)
    shard = api.vocab_shard(
        width, vocab_start_index=vocab_start_index, vocab_size=vocab_size, ignore_index=ig,
        group=group,
    )  # fmt: skip
    if validate:
        lab2d = None
        if labels is not None:
            lab2d, _ = check_labels("labels", labels, batch, x.device, device_of=device_of)
        validate_layout(shard, width, math.prod(batch), lab2d, ig, x.device, group)
    return shard


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
    backend: str,
    validate: bool,
    want_entropy: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x = check_logits("logits_shard", logits_shard)
    shard = _shard(
        x, x.shape[-1], labels, vocab_start_index=vocab_start_index, vocab_size=vocab_size,
        ignore_index=ignore_index, group=group, validate=validate,
        batch=tuple(x.shape[:-1]), device_of="logits_shard",
    )  # fmt: skip
    return api.log_probs_entropy(  # type: ignore[no-any-return]
        x, labels, temperature=temperature, want_entropy=want_entropy,
        ignore_index=ignore_index, chunk_size=chunk_size, backend=backend, validate=validate,
        shard=shard, logits_name="logits_shard",
    )  # fmt: skip


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
    backend: str = "auto",
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
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (as in one process).
        validate: check the shard layout and labels across ranks (collective +
            host sync), and that a tensor temperature is positive.

    Returns:
        ``labels.shape``, fp32 (fp64 for fp64 logits), identical on every rank;
        differentiable w.r.t. ``logits_shard``.
    """
    logp, _ = _log_probs_entropy(
        logits_shard, labels, temperature=temperature, ignore_index=ignore_index,
        vocab_start_index=vocab_start_index, vocab_size=vocab_size, group=group,
        chunk_size=chunk_size, backend=backend, validate=validate, want_entropy=False,
    )  # fmt: skip
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
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the full vocabulary, per row.

    Equals :func:`rlmath.logprobs.entropy_from_logits` on the concatenated
    logits; ``-inf`` logits (padding) contribute 0 to value and gradient
    (``∂H/∂z = -p·(z - E_p[z]) / T``). Unlike verl's ``vocab_parallel_entropy``,
    the input is never modified and memory is bounded by chunking.

    Args:
        logits_shard: ``(..., V/tp)`` this rank's columns, any floating dtype. Not modified.
        temperature, vocab_start_index, vocab_size, group, chunk_size, backend, validate:
            as in :func:`vocab_parallel_log_probs_from_logits`.

    Returns:
        ``logits_shard.shape[:-1]``, fp32 (fp64 for fp64 logits), identical on every rank.
    """
    _, ent = _log_probs_entropy(
        logits_shard, None, temperature=temperature, ignore_index=None,
        vocab_start_index=vocab_start_index, vocab_size=vocab_size, group=group,
        chunk_size=chunk_size, backend=backend, validate=validate, want_entropy=True,
    )  # fmt: skip
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
    backend: str = "auto",
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Label log-probs and entropy in one pass over the local logits (and one backward pass).

    Args: as in :func:`vocab_parallel_log_probs_from_logits`.

    Returns:
        ``(log_probs, entropy)`` of shapes ``labels.shape`` and
        ``logits_shard.shape[:-1]``, fp32 (fp64 for fp64 logits). A row whose
        labels are all ``ignore_index`` gets entropy 0 too (it is not computed),
        as in :func:`rlmath.logprobs.log_probs_and_entropy_from_logits`.
    """
    logp, ent = _log_probs_entropy(
        logits_shard, labels, temperature=temperature, ignore_index=ignore_index,
        vocab_start_index=vocab_start_index, vocab_size=vocab_size, group=group,
        chunk_size=chunk_size, backend=backend, validate=validate, want_entropy=True,
    )  # fmt: skip
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
    backend: str = "auto",
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
        temperature, vocab_start_index, vocab_size, group, chunk_size, backend, validate:
            as in :func:`vocab_parallel_log_probs_from_logits`.

    Returns:
        ``logits_shard.shape[:-1]``, fp32 (fp64 if an input is fp64), ≥ 0,
        identical on every rank; differentiable w.r.t. both inputs.
    """
    x = check_logits("logits_shard", logits_shard)
    shard = _shard(
        x, x.shape[-1], None, vocab_start_index=vocab_start_index, vocab_size=vocab_size,
        ignore_index=None, group=group, validate=validate, batch=tuple(x.shape[:-1]),
        device_of="logits_shard",
    )  # fmt: skip
    return api.kl(  # type: ignore[no-any-return]
        x, ref_logits_shard, temperature=temperature, chunk_size=chunk_size, backend=backend,
        validate=validate, shard=shard, names=("logits_shard", "ref_logits_shard"),
    )  # fmt: skip


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
    backend: str = "auto",
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
        temperature, ignore_index, vocab_start_index, vocab_size, group, backend, validate:
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
        chunk_size: rows (tokens) per chunk (``None``: as in one process, 2048 on
            a CPU and 4096 on an accelerator, fewer for short inputs).
        vocab_chunk_size: local vocabulary columns per tile (``None``: blocks as
            in one process, :func:`rlmath.engine.policy.auto_tile_sizes` of the
            local vocabulary). Chunk sizes change speed and memory only (results
            agree to rounding).

    Returns:
        ``(log_probs, entropy)``: ``labels.shape`` and ``hidden.shape[:-1]``
        (or ``None``), fp32 (fp64 for fp64 inputs), identical on every rank.
    """
    x = check_logits("hidden", hidden)
    wt = check_logits("weight_shard", weight_shard)
    if wt.dim() != 2:
        raise ValueError(f"weight_shard must have shape (V/tp, H), got {tuple(wt.shape)}")
    shard = _shard(
        x, wt.shape[0], labels, vocab_start_index=vocab_start_index, vocab_size=vocab_size,
        ignore_index=ignore_index, group=group, validate=validate, batch=tuple(x.shape[:-1]),
        device_of="hidden",
    )  # fmt: skip
    return api.fused_head(  # type: ignore[no-any-return]
        x, wt, labels, bias=bias_shard, temperature=temperature,
        want_entropy=bool(return_entropy), ignore_index=ignore_index, chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size, backend=backend, validate=validate, allow_k=True,
        shard=shard, reduce_grad_hidden=reduce_grad_hidden,
        names=("hidden", "weight_shard", "bias_shard"),
    )  # fmt: skip


def vocab_parallel_log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """Response log-probs from packed, vocabulary-sharded logits, shifting within each sequence.

    Equals :func:`rlmath.logprobs.log_probs_from_logits_response_rmpad` on the
    packed logits concatenated over the ranks (the same computation on this
    rank's columns). The response token at column ``s`` of sequence ``b`` is
    scored by the logits of the previous valid token *of the same sequence*
    (verl's version rolls the packed ids globally, so the last token of one
    sequence is scored against the first of the next). No data-dependent
    shapes and no host sync.

    Args:
        input_ids: ``(B, S)`` integer token ids (padded), the same on every rank.
        attention_mask: ``(B, S)`` bool or 0/1, 1 = valid token (any layout).
        logits_rmpad: ``(nnz, V/tp)`` (or ``(1, nnz, V/tp)``) this rank's columns
            of the packed logits, one row per valid token in row-major order.
        response_length: ``R``: the response is the last ``R`` columns, ``1 ≤ R ≤ S``.
        temperature: float > 0 or a tensor broadcastable to ``(B, S)``, taken at
            the predicting position.
        vocab_start_index, vocab_size, group, chunk_size, backend: as in
            :func:`vocab_parallel_log_probs_from_logits`.
        validate: also check that ``nnz`` equals the number of valid tokens and
            the shard layout across ranks (host syncs and a collective).

    Returns:
        ``(B, R)`` fp32 log-probs (fp64 for fp64 logits), 0 where the token is
        padding or has no earlier valid token in its sequence; differentiable
        w.r.t. ``logits_rmpad``.
    """
    ids, mask = check_ids_and_mask(input_ids, attention_mask)
    R = api.check_response_length(response_length, ids.shape[1], allow_full=True)
    x = check_packed_logits(logits_rmpad)
    shard = _shard(
        x, x.shape[-1], None, vocab_start_index=vocab_start_index, vocab_size=vocab_size,
        ignore_index=None, group=group, validate=validate, batch=tuple(x.shape[:-1]),
        device_of="logits_rmpad",
    )  # fmt: skip
    return api.packed_response_log_probs(
        ids, api.packed_rows_from_mask(mask), x, R, temperature=temperature,
        chunk_size=chunk_size, backend=backend, validate=validate, shard=shard,
    )  # fmt: skip


def vocab_parallel_sum_pi_squared(
    logits_shard: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    vocab_start_index: int | None = None,
    vocab_size: int | None = None,
    group: ProcessGroup | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """``Σ_v π_v²`` of ``π = softmax(logits / T)`` over the full sharded vocabulary, per row.

    Equals :func:`rlmath.logprobs.sum_pi_squared_from_logits` on the
    concatenated logits: each rank sums ``exp(2(z - m_k))`` over its columns
    and two collectives combine the shards. Not differentiable (a statistic
    for advantages, like verl's); the input is never modified.

    Args:
        logits_shard: ``(..., V/tp)`` this rank's columns, any floating dtype.
        temperature, vocab_start_index, vocab_size, group, chunk_size, backend, validate:
            as in :func:`vocab_parallel_entropy`.

    Returns:
        ``logits_shard.shape[:-1]``, fp32 (fp64 for fp64 logits), in ``(0, 1]``,
        identical on every rank.
    """
    x = check_logits("logits_shard", logits_shard)
    shard = _shard(
        x, x.shape[-1], None, vocab_start_index=vocab_start_index, vocab_size=vocab_size,
        ignore_index=None, group=group, validate=validate, batch=tuple(x.shape[:-1]),
        device_of="logits_shard",
    )  # fmt: skip
    return api.sum_pi_squared(
        x,
        temperature=temperature,
        chunk_size=chunk_size,
        backend=backend,
        validate=validate,
        shard=shard,
        logits_name="logits_shard",
    )
