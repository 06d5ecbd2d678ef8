"""Per-token log-probabilities of labels (and entropies) from logits, in bounded memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import torch

from rlmath.engine import api
from rlmath.engine.config import VocabParallel
from rlmath.engine.truncation import SampledLogProbs

__all__ = [
    "SampledLogProbs",
    "VocabParallel",
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
]

Sampler = Literal["vllm", "sglang", "hf"]
KeptSetArg = torch.Tensor | Sequence[Sequence[int]] | None


@overload
def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = ...,
    ignore_index: int | None = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = ...,
    ignore_index: int | None = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[True],
) -> SampledLogProbs: ...


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int | None = -100,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    sampler: Sampler = "vllm",
    kept: KeptSetArg = None,
    kept_stats: bool = False,
) -> torch.Tensor | SampledLogProbs:
    """Log-probability of each label under ``softmax(logits / temperature)``.

    With ``top_k``, ``top_p``, ``min_p`` or ``kept``: under the distribution a
    rollout engine samples from, ``softmax`` restricted to each row's kept set
    and renormalised (``docs/sampling.md``).

    ``logits[..., i, :]`` scores ``labels[..., i]``: there is no shift inside
    (see :func:`log_probs_from_logits_response` for next-token alignment).
    Equivalent to ``log_softmax(logits.float() / temperature, -1).gather(-1, labels)``
    but never materializes an fp32 copy of the logits: rows are processed in
    chunks (upcast to fp32 chunk by chunk), only an fp32 log-sum-exp per row is
    saved, and backward recomputes each chunk and writes its gradient straight
    into the gradient buffer. Nothing is modified in place.

    Args:
        logits: ``(..., V)`` float tensor (fp32, bf16, fp16 or fp64; any strides),
            or a DTensor: sharded over the vocabulary (``Shard(-1)``) it runs
            vocabulary-parallel over that mesh dimension's group; replicated or
            sharded over batch dims it runs on each rank's block. The result is
            then a DTensor (see ``docs/logprobs.md``).
        labels: ``(...)`` integer tensor with one label per row, or ``(..., K)``
            for K candidate labels per row; values in ``[0, V)`` or ``ignore_index``
            (any other value gives a NaN log-prob; ``validate=True`` raises).
        temperature: float > 0, or a tensor broadcastable to ``logits.shape[:-1]``
            (e.g. one temperature per sequence). The result equals the call on
            ``logits / temperature`` with temperature 1 (the division is done in
            fp32). A tensor temperature receives no gradient.
        ignore_index: label value of positions to skip (-100, as in HF and
            ``torch.nn.functional.cross_entropy``): they get log-prob 0 and no
            gradient; a row whose labels are all ignored is never read (NaN
            logits or a zero temperature there are harmless). ``None``: no label
            is skipped.
        vocab_size: the number of real tokens of the whole vocabulary: columns
            from it on are padding (a vocabulary padded to a multiple of 128,
            say), left out of the softmax without a copy and given a zero
            gradient. ``None``: every column is a token.
        vocab_parallel: ``logits`` holds this rank's columns of a vocabulary
            split over a process group (:class:`VocabParallel`: the group, this
            rank's first token id); the result is over the whole vocabulary,
            the same on every rank, and the gradient is this rank's columns of
            the whole gradient. ``None``: ``logits`` holds the whole vocabulary.
        chunk_size: rows per chunk; ``None`` picks one from ``V``, the number of rows
            and the device (:func:`rlmath.engine.policy.auto_chunk_size`). Changes
            speed and memory only, never the result.
        backend: ``"auto"`` (the best available for the input), ``"torch"`` (pure
            PyTorch, every device) or ``"triton"`` (CUDA kernels, when installed).
        validate: check that every label lies in ``[0, V)`` or is ``ignore_index``
            (and that a tensor temperature is positive; with ``vocab_parallel``,
            that every rank passes the same rows and labels) with a clear
            ``ValueError``; off by default because it reads tensor data (a host
            sync).
        top_k: keep each row's ``k`` largest (temperature-scaled) logits before
            renormalising, as the rollout's sampler did: an int ``>= 1`` or an
            integer tensor broadcastable to ``logits.shape[:-1]`` (one per row,
            like ``temperature``). ``None`` or ``k >= V``: no top-k. With
            ``vocab_parallel`` the kept set is that of the whole vocabulary
            (``docs/sampling.md``, "Vocabulary parallelism").
        top_p: keep the smallest head of the distribution whose mass reaches
            ``top_p`` (nucleus sampling): a float in ``(0, 1]`` or a tensor of
            them per row. ``None`` or 1: no top-p.
        min_p: keep the tokens whose probability is at least ``min_p`` times
            the largest one: a float in ``[0, 1]`` or a tensor per row. ``None``
            or 0: no min-p.
        sampler: whose rules define the kept set: ``"vllm"`` (the default),
            ``"sglang"`` or ``"hf"`` (transformers' ``generate``); they differ in
            the order of the filters and the mass top-p measures
            (``docs/sampling.md``). Ties at the threshold are all kept. The
            kept set receives no gradient; the gradient is that of the log-softmax
            over it.
        kept: replay the kept set the rollout engine returned instead of
            recomputing it: a bool mask ``logits.shape[:-1] + (V,)``, integer token
            ids ``logits.shape[:-1] + (K,)`` padded with -1, or a list of one
            sequence of token ids per row (rows in ``logits.shape[:-1]`` order,
            flattened). Not with ``top_k``, ``top_p`` or ``min_p``. With
            ``vocab_parallel``: global token ids, or a mask over the whole
            vocabulary (only when the shards' layout follows from the shapes).
        kept_stats: return a :class:`SampledLogProbs` with, besides the
            result, which labels fell outside the kept set and the size of each
            row's kept set. A label outside the kept set is always scored as if
            the sampler had kept it (its row's kept set is extended by its
            labels): a finite log-prob, never NaN.
    Returns:
        Log-probabilities of shape ``labels.shape``, fp32 (fp64 for fp64 logits).
        Differentiable w.r.t. ``logits`` (first order). With ``kept_stats``, a
        :class:`SampledLogProbs` (``entropy`` ``None``).

    Raises:
        ValueError: a bad argument, named in the message (``top_p`` outside
            ``(0, 1]``, ``top_k < 1``, ``min_p`` outside ``[0, 1]``, a per-row
            tensor or ``kept`` of the wrong shape, ...).
        NotImplementedError: ``top_k``, ``top_p``, ``min_p``, ``kept`` or
            ``kept_stats`` with DTensor inputs or ``backend="triton"``.
    """
    out = api.log_probs_entropy(
        logits, labels, temperature=temperature, want_entropy=False, ignore_index=ignore_index,
        chunk_size=chunk_size, backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
        kept=kept, kept_stats=kept_stats,
    )  # fmt: skip
    if kept_stats:
        return out  # type: ignore[no-any-return]
    return out[0]  # type: ignore[no-any-return]


@overload
def log_probs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = ...,
    ignore_index: int | None = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[False] = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def log_probs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = ...,
    ignore_index: int | None = ...,
    vocab_size: int | None = ...,
    vocab_parallel: VocabParallel | None = ...,
    chunk_size: int | None = ...,
    backend: str = ...,
    validate: bool = ...,
    top_k: int | torch.Tensor | None = ...,
    top_p: float | torch.Tensor | None = ...,
    min_p: float | torch.Tensor | None = ...,
    sampler: Sampler = ...,
    kept: KeptSetArg = ...,
    kept_stats: Literal[True],
) -> SampledLogProbs: ...


def log_probs_and_entropy_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int | None = -100,
    vocab_size: int | None = None,
    vocab_parallel: VocabParallel | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    validate: bool = False,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    sampler: Sampler = "vllm",
    kept: KeptSetArg = None,
    kept_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | SampledLogProbs:
    """Label log-probabilities and the entropy of each row, in one pass over the logits.

    Same as ``(log_probs_from_logits(...), entropy_from_logits(...))`` with the
    same arguments, at the cost of one chunked pass in forward and one in
    backward; both outputs are differentiable and their gradients are summed
    in a single backward pass. A row whose labels are all ``ignore_index`` has
    entropy 0 as well (it is not computed at all).

    Args:
        logits: ``(..., V)`` float tensor (any floating dtype and strides) or a
            DTensor (as in :func:`log_probs_from_logits`).
        labels: ``(...)`` or ``(..., K)`` integer tensor, values in ``[0, V)``
            or ``ignore_index``.
        temperature, ignore_index, vocab_size, vocab_parallel, chunk_size, backend, validate:
            as in :func:`log_probs_from_logits`.
        top_k, top_p, min_p, sampler, kept, kept_stats: restrict each row to the
            kept set of the rollout's sampler, as in :func:`log_probs_from_logits`;
            the entropy is then that of the renormalised kept distribution.

    Returns:
        ``(log_probs, entropy)``: ``labels.shape`` and ``logits.shape[:-1]``,
        fp32 (fp64 for fp64 logits); with ``kept_stats``, a :class:`SampledLogProbs`.
    """
    return api.log_probs_entropy(  # type: ignore[no-any-return]
        logits, labels, temperature=temperature, want_entropy=True, ignore_index=ignore_index,
        chunk_size=chunk_size, backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
        kept=kept, kept_stats=kept_stats,
    )  # fmt: skip
