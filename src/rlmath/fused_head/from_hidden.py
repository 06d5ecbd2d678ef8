"""Label log-probs and entropies straight from the hidden states, never holding the logits."""

from __future__ import annotations

from typing import Literal, overload

import torch

from rlmath.engine import api
from rlmath.engine.config import VocabParallel
from rlmath.engine.truncation import SampledLogProbs
from rlmath.log_probs.log_probs import Sampler

__all__ = ["log_probs_and_entropy_from_hidden"]


@overload
def log_probs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: bool = ...,
    ignore_index: int | None = ...,
    logit_scale: float = ...,
    softcap: float | None = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    vocab_chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept_stats: Literal[False] = ...,
) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@overload
def log_probs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = ...,
    temperature: float | torch.Tensor = ...,
    return_entropy: bool = ...,
    ignore_index: int | None = ...,
    logit_scale: float = ...,
    softcap: float | None = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    vocab_chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept_stats: Literal[True],
) -> SampledLogProbs: ...


def log_probs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = True,
    ignore_index: int | None = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    sampler: Sampler = "vllm",
    kept_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | SampledLogProbs:
    """Label log-probabilities and entropies of the LM head's softmax, without the logits.

    Computes the same values as ``log_probs_and_entropy_from_logits(hidden @
    weight.T + bias, labels, temperature=temperature)`` but never holds the
    ``(N, V)`` logits (16k tokens × 152k vocabulary is 9.3 GiB in fp32): it
    works on one block of ``chunk_size`` tokens by ``vocab_chunk_size``
    vocabulary entries at a time, saves only an fp32 log-sum-exp and entropy
    per token, and recomputes each block in backward (the approach of verl's
    ``FusedLinearForPPO`` and Liger-Kernel's fused linear cross-entropy).
    Nothing is modified in place.

    The logits block is computed in the inputs' dtype, as ``hidden @
    weight.T`` would be (a bf16 head gives bf16 logits), then reduced in fp32.
    Inputs of different dtypes (bf16 hidden states with an fp32 master weight)
    are promoted to the widest; under ``torch.autocast`` all are cast to the
    autocast dtype, as ``F.linear`` would be. Either way the gradients reach
    the original tensors in their own dtypes.
    Gradients flow to ``hidden``, ``weight`` and ``bias`` from whichever outputs
    are used; the weight and bias gradients accumulate in fp32 over all
    tokens (for bf16/fp16 weights in one fp32 buffer of the weight's shape,
    rounded once at the end).

    Args:
        hidden: ``(..., H)`` float tensor, the last hidden states (fp32, bf16,
            fp16 or fp64). ``hidden[..., i, :]`` scores ``labels[..., i]``: there
            is no shift inside. A DTensor runs on each rank's rows (see
            ``docs/fused_head.md``; with a ``Shard(0)`` DTensor ``weight`` the
            head is vocabulary-parallel over that mesh dimension).
        weight: ``(V, H)`` LM-head (or tied embedding) weight, any floating dtype;
            with ``vocab_parallel``, this rank's ``(V/tp, H)`` rows.
        labels: ``(...)`` = ``hidden.shape[:-1]`` integer tensor, or
            ``hidden.shape[:-1] + (K,)`` for K candidate labels per row; values in
            ``[0, V)`` or ``ignore_index`` (global token ids with ``vocab_parallel``).
        bias: ``(V,)`` bias of the head, or ``None``.
        temperature: float > 0, or a tensor broadcastable to ``hidden.shape[:-1]``
            (e.g. one per sequence); the logits are divided by it in fp32. A tensor
            temperature receives no gradient.
        return_entropy: also compute the entropy of each row (otherwise one
            pass per block fewer, and ``None`` is returned in its place).
        ignore_index: label value marking positions to skip (-100, as in HF):
            they get log-prob and entropy 0 and contribute no gradient (their
            hidden states and temperature are not read by the math, so NaN or 0
            there is harmless). A row with K labels stays live while one of them
            is not ignored. ``None``: no label is skipped.
        logit_scale: the head's logits are multiplied by it before the softmax
            (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``). A float > 0.
        softcap: ``c > 0`` caps the (scaled) logits to ``c·tanh(z / c)`` (Gemma 2/3's
            ``final_logit_softcapping``), in fp32, forward and backward; ``None``: no cap.
            The temperature divides the capped logits.
        vocab_size: the number of real tokens of the whole vocabulary: rows of
            the weight from ``vocab_size`` on (a vocabulary padded beyond the
            tokenizer) are left out of the softmax, as if their logits were
            ``-inf``, and get a zero gradient. ``None``: every row is a token.
        vocab_parallel: ``weight`` (and ``bias``) hold this rank's rows of a head
            split over the vocabulary across a process group
            (:class:`~rlmath.VocabParallel`): every rank gets the results over the
            whole vocabulary; ``hidden`` (the same on every rank) receives the
            whole gradient, all-reduced over the group (unless
            ``vocab_parallel.reduce_grad_hidden`` is false), the weight and bias
            this rank's rows of it. ``None``: the whole head is here.
        chunk_size: tokens per block; ``None`` picks 2048 on a CPU and 4096 on an
            accelerator (fewer for short inputs). On a CPU each worker thread
            works on pieces of at most 512 of them at a time.
        vocab_chunk_size: vocabulary entries per block (the pure-torch backend
            rounds it up to a multiple of 128); ``None``: 2048 on a CPU, enough
            to fill a block of 32M entries on an accelerator (at most 1/48 of
            the logits). Both change speed and memory only
            (:mod:`rlmath.engine.policy`), results agree to rounding (on a CPU
            the log-probs and entropy are the same bits whatever the blocks
            where the matmul library allows, ``docs/engine.md``, "Invariance").
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check that every label lies in ``[0, V)`` or equals
            ``ignore_index`` (and that a tensor temperature is positive) with a
            clear ``ValueError``; off by default because it reads tensor data.
            Without it, a label that is neither a token id nor ``ignore_index``
            gives a NaN log-prob (and a NaN gradient where the loss uses it).
        top_k, top_p, min_p, sampler, kept_stats: the log-probs and entropy of
            the distribution a truncating sampler drew from, its kept set
            renormalised, as in :func:`rlmath.log_probs.log_probs_from_logits`
            (``docs/sampling.md``). The kept set needs each row's whole logits:
            this path takes blocks of rows whole (at most 2²³ logits at a time,
            recomputed in backward) instead of vocabulary tiles, on the
            pure-torch backend (with ``vocab_parallel``, the kept set of the
            whole vocabulary). With ``kept_stats``, a
            :class:`~rlmath.log_probs.SampledLogProbs`.

    Returns:
        ``(log_probs, entropy)`` of shapes ``labels.shape`` and
        ``hidden.shape[:-1]``, fp32 (fp64 for fp64 inputs); ``log_probs <= 0`` and
        ``0 <= entropy <= log V``. ``entropy`` is ``None`` when ``return_entropy``
        is false.

    Raises:
        TypeError: a non-tensor, non-floating ``hidden``/``weight``/``bias``,
            non-integer ``labels``.
        ValueError: mismatched shapes or devices, temperature <= 0, chunk sizes < 1,
            a sampler argument out of range.
        NotImplementedError: a sampler argument with DTensor inputs or
            ``backend="triton"``.
    """
    return api.fused_head(  # type: ignore[no-any-return]
        hidden, weight, labels, bias=bias, temperature=temperature,
        want_entropy=bool(return_entropy), ignore_index=ignore_index, chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size, logit_scale=logit_scale, softcap=softcap,
        vocab_size=vocab_size, vocab_parallel=vocab_parallel, backend=backend,
        validate=validate, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
        kept_stats=kept_stats,
    )  # fmt: skip
