"""Label log-probs and entropies straight from the hidden states, never holding the logits."""

from __future__ import annotations

import math
from typing import cast

import torch

from rlmath._validation import check_tensor
from rlmath.fused_head.chunking import auto_tile_sizes
from rlmath.fused_head.dispatch import get_fused_kernel
from rlmath.logprobs._inputs import compute_dtype, normalize_temperature

__all__ = ["linear_logprobs_entropy", "log_probs_and_entropy_from_hidden"]


def _check_head(
    hidden: object, weight: object, bias: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    h = check_tensor("hidden", hidden, floating=True)
    if h.dim() < 1:
        raise ValueError("hidden must have shape (..., H), got a 0-d tensor")
    w = check_tensor("weight", weight, floating=True)
    if w.dim() != 2 or w.shape[0] < 1 or w.shape[1] != h.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) with V >= 1 and H = hidden.shape[-1] = "
            f"{h.shape[-1]}, got {tuple(w.shape)}"
        )
    if w.dtype != h.dtype:
        raise TypeError(f"weight must have the dtype of hidden ({h.dtype}), got {w.dtype}")
    if w.device != h.device:
        raise ValueError(f"weight is on {w.device} but hidden is on {h.device}")
    if bias is None:
        return h, w, None
    b = check_tensor("bias", bias, floating=True)
    if tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"bias must have shape (V,) = ({w.shape[0]},), got {tuple(b.shape)}")
    if b.dtype != w.dtype:
        raise TypeError(f"bias must have the dtype of weight ({w.dtype}), got {b.dtype}")
    if b.device != w.device:
        raise ValueError(f"bias is on {b.device} but weight is on {w.device}")
    return h, w, b


def _check_labels(labels: object, hidden: torch.Tensor) -> torch.Tensor:
    lab = check_tensor("labels", labels)
    if lab.is_floating_point() or lab.is_complex() or lab.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got dtype {lab.dtype}")
    if tuple(lab.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
            f"got {tuple(lab.shape)}"
        )
    if lab.device != hidden.device:
        raise ValueError(f"labels is on {lab.device} but hidden is on {hidden.device}")
    return lab


def _check_size(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value}")
    return value


def log_probs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = True,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    Gradients flow to ``hidden``, ``weight`` and ``bias`` from whichever outputs
    are used; the weight and bias gradients accumulate in fp32 over all
    tokens (for bf16/fp16 weights in one fp32 buffer of the weight's shape,
    rounded once at the end).

    Args:
        hidden: ``(..., H)`` float tensor, the last hidden states (fp32, bf16,
            fp16 or fp64). ``hidden[..., i, :]`` scores ``labels[..., i]``: there
            is no shift inside.
        weight: ``(V, H)`` LM-head (or tied embedding) weight, dtype of ``hidden``.
        labels: ``(...)`` = ``hidden.shape[:-1]`` integer tensor, values in
            ``[0, V)`` or ``ignore_index``.
        bias: ``(V,)`` bias of the head in the weight's dtype, or ``None``.
        temperature: float > 0, or a tensor broadcastable to ``hidden.shape[:-1]``
            (e.g. one per sequence); the logits are divided by it in fp32. A tensor
            temperature receives no gradient.
        return_entropy: also compute the entropy of each row (otherwise one
            pass per block fewer, and ``None`` is returned in its place).
        ignore_index: label value marking positions to skip: they get log-prob
            and entropy 0 and contribute no gradient (their hidden states are not
            read by the math, so NaN there is harmless).
        chunk_size: tokens per block; ``None`` picks 2048 on a CPU and 4096 on an
            accelerator (fewer for short inputs).
        vocab_chunk_size: vocabulary entries per block; ``None`` fills a block of
            8M entries on a CPU, 32M on an accelerator (at most 1/64 or 1/48 of
            the logits). Both change speed and memory only
            (:mod:`rlmath.fused_head.chunking`), results agree to rounding.
        validate: check that every label lies in ``[0, V)`` or equals
            ``ignore_index`` (and that a tensor temperature is positive) with a
            clear ``ValueError``; off by default because it reads tensor data.
            Without it, an out-of-range label gives a meaningless log-prob.

    Returns:
        ``(log_probs, entropy)``, both of shape ``labels.shape``, fp32 (fp64 for
        fp64 inputs); ``log_probs <= 0`` and ``0 <= entropy <= log V``. ``entropy``
        is ``None`` when ``return_entropy`` is false.

    Raises:
        TypeError: a non-tensor, non-floating ``hidden``/``weight``/``bias``,
            mismatched dtypes, non-integer ``labels``.
        ValueError: mismatched shapes or devices, temperature <= 0, chunk sizes < 1.
    """
    h, w, b = _check_head(hidden, weight, bias)
    lab = _check_labels(labels, h)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    rows = _check_size("chunk_size", chunk_size)
    tile = _check_size("vocab_chunk_size", vocab_chunk_size)
    batch = tuple(h.shape[:-1])
    V, H = w.shape
    temp = normalize_temperature(
        temperature,
        batch,
        compute_dtype(h, w),
        h.device,
        validate=validate,
        shape_name="hidden.shape[:-1]",
        device_of="hidden",
    )
    N = math.prod(batch)
    flat = lab.reshape(N).long()
    valid = flat != ignore_index
    if validate and N:
        bad = valid & ((flat < 0) | (flat >= V))
        if bool(bad.any()):
            raise ValueError(
                f"labels must lie in [0, {V}) (the vocabulary) or equal ignore_index = "
                f"{ignore_index}, found {int(flat[bad][0])}"
            )
    safe = torch.where(valid, flat, 0)
    rows, tile = auto_tile_sizes(N, V, chunk_size=rows, vocab_chunk_size=tile, device=hidden.device)
    kernel = get_fused_kernel(h)
    logp, ent = cast(
        tuple[torch.Tensor, torch.Tensor],
        kernel(h.reshape(N, H), w, b, safe, valid, temp, bool(return_entropy), rows, tile),
    )
    return logp.view(batch), ent.view(batch) if return_entropy else None


linear_logprobs_entropy = log_probs_and_entropy_from_hidden
"""The name DESIGN.md gives :func:`log_probs_and_entropy_from_hidden` (same function)."""
