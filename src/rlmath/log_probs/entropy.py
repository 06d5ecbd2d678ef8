"""Per-row entropy of ``softmax(logits / temperature)``, in bounded memory."""

from __future__ import annotations

import torch

from rlmath.engine import api
from rlmath.engine.config import VocabParallel
from rlmath.log_probs.log_probs import KeptSetArg, Sampler

__all__ = ["entropy_from_logits"]


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
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
) -> torch.Tensor:
    """Shannon entropy ``H = -Σ_v p_v log p_v`` of ``p = softmax(logits / temperature)``.

    Computed per chunk of rows as ``log s - Σ exp(y)·y / s`` with
    ``y = z - max z`` and ``s = Σ exp(y)``, so no large terms cancel; ``-inf``
    logits (a padded or masked vocabulary) contribute exactly 0 to the value
    and to the gradient ``∂H/∂z = -p·(z - E_p[z])``. Saves only the logits
    and two numbers per row; backward recomputes each chunk.

    Args:
        logits: ``(..., V)`` float tensor (fp32, bf16, fp16 or fp64; any strides),
            or a DTensor (see :func:`rlmath.log_probs.log_probs_from_logits`).
        temperature: float > 0 or a tensor broadcastable to ``logits.shape[:-1]``;
            the result equals the call on ``logits / temperature``.
        vocab_size, vocab_parallel: the real tokens of the whole vocabulary and
            this rank's shard of it, as in :func:`log_probs_from_logits`.
        chunk_size: rows per chunk (``None``: chosen from V).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check a tensor temperature is positive (a host sync; with
            ``vocab_parallel``, that every rank passes the same rows).
        top_k, top_p, min_p, sampler, kept: the entropy of the distribution a
            truncating sampler drew from, its kept set renormalised, as in
            :func:`rlmath.log_probs.log_probs_from_logits` (``docs/sampling.md``).

    Returns:
        ``logits.shape[:-1]``, fp32 (fp64 for fp64 logits), differentiable
        w.r.t. ``logits``.
    """
    _, ent = api.log_probs_entropy(
        logits, None, temperature=temperature, want_entropy=True, ignore_index=None,
        chunk_size=chunk_size, backend=backend, validate=validate, vocab_size=vocab_size,
        vocab_parallel=vocab_parallel, top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler,
        kept=kept,
    )  # fmt: skip
    return ent
