"""Turning prompts and responses into tensors, and the packed (rmpad) forward pass.

Layout (the one verl uses): prompts are left-padded to ``P`` tokens,
responses right-padded to ``R`` tokens, and a sequence is their concatenation
``[B, P + R]``::

    prompt (left-padded)        response (right-padded)
    <pad> <bos> 3 1 4 <sep>  |  1 3 4 <eos> <pad> <pad>

``response_forward`` runs the transformer trunk on this padded batch (through
:class:`ResponseModel`, the module data-parallel wrappers act on), then
drops the padding with ``rlmath.unpad_input`` and applies the LM head and the
value head to the packed ``[N, H]`` hidden states only. Log-probs of the
response tokens come from ``rlmath.log_probs_from_logits_response_rmpad``
(which shifts labels within each sequence, so it never mixes tokens of two
sequences), entropies from ``rlmath.entropy_from_logits``, and per-token
outputs go back to the padded layout with ``rlmath.pad_input``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

import rlmath
from rlmath.demo.config import Truncation
from rlmath.demo.model import DemoLM
from rlmath.demo.vocab_parallel_head import VocabParallelLMHead

__all__ = [
    "ResponseModel",
    "ResponseOutputs",
    "Rollout",
    "left_pad",
    "make_rollout",
    "response_forward",
]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows: ids ``[B, P]`` (int64) and mask ``[B, P]`` (int64, 1 = token)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


@dataclass
class Rollout:
    """One batch of sampled sequences and everything computed about them.

    Tensors are ``[B, P + R]`` (sequence) or ``[B, R]`` (response);
    ``index`` holds each row's prompt id (rows of one GRPO group share it).
    The optional fields are filled in by the algorithm as it goes.
    """

    input_ids: torch.Tensor  # [B, P+R] int64
    attention_mask: torch.Tensor  # [B, P+R] int64
    position_ids: torch.Tensor  # [B, P+R] int64
    response_mask: torch.Tensor  # [B, R] int64, 1 up to and including <eos>
    index: torch.Tensor  # [B] int64
    scores: torch.Tensor | None = None  # [B] fp32 task reward
    rollout_log_prob: torch.Tensor | None = None  # [B, R] fp64, the sampler's
    old_log_prob: torch.Tensor | None = None  # [B, R]
    ref_log_prob: torch.Tensor | None = None  # [B, R]
    values: torch.Tensor | None = None  # [B, R]
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rollout restricted to ``rows`` (a mini-batch)."""
        kwargs = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kwargs[f.name] = v[rows] if isinstance(v, torch.Tensor) else v
        return Rollout(**kwargs)


def make_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    index: torch.Tensor,
    *,
    eos_id: int,
) -> Rollout:
    """Concatenate left-padded prompts ``[B, P]`` and responses ``[B, R]`` into a Rollout.

    The response mask keeps every token up to and including the first
    ``<eos>`` (``rlmath.get_response_mask``); a response cut at the length
    limit is valid everywhere.
    """
    response_mask = rlmath.get_response_mask(response_ids, eos_id, dtype=torch.long)
    attention_mask = torch.cat([prompt_mask.long(), response_mask], dim=1)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Rollout(input_ids, attention_mask, position_ids, response_mask, index)


@dataclass
class ResponseOutputs:
    """Per-response-token outputs ``[B, R]`` (the model's dtype, at least fp32); 0 on padding."""

    log_prob: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


class ResponseModel(nn.Module):
    """The module a trainer calls (and DDP or FSDP2 wrap): sampling logits or response outputs.

    Data-parallel wrappers act on ``forward`` only (DDP prepares its gradient
    reduction there, FSDP2 gathers the sharded weights there), so everything
    the trainer computes with the model goes through this one ``forward``.
    """

    def __init__(self, lm: DemoLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        with_log_prob: bool = True,
        with_entropy: bool = False,
        with_values: bool = False,
        truncation: Truncation | None = None,
    ) -> Any:
        """Without ``response_mask``: logits ``[B, 1, V]`` of the last position (sampling).

        With it: a dict of ``[B, R]`` tensors (``log_prob``, ``entropy``,
        ``values``, as asked), see :func:`response_forward`.
        """
        if response_mask is None:
            hidden = self.lm.hidden_states(input_ids, attention_mask, position_ids)
            return self.lm.lm_head(hidden[:, -1:])
        return _response_outputs(
            self.lm,
            input_ids,
            attention_mask,
            position_ids,
            response_mask,
            temperature=temperature,
            with_log_prob=with_log_prob,
            with_entropy=with_entropy,
            with_values=with_values,
            truncation=truncation,
        )


def response_forward(
    model: nn.Module,
    batch: Rollout,
    *,
    temperature: float = 1.0,
    with_log_prob: bool = True,
    with_entropy: bool = False,
    with_values: bool = False,
    truncation: Truncation | None = None,
) -> ResponseOutputs:
    """Log-probs (and entropies, values) of the response tokens, via the packed path.

    ``model`` is a :class:`ResponseModel`, possibly wrapped by DDP or FSDP2.
    ``log_prob[b, t]`` is ``log π(response[b, t] | prompt, response[b, :t])``
    at ``temperature``; ``entropy[b, t]`` is the entropy of that
    distribution; ``values[b, t]`` is the value head's estimate at the state
    *before* token ``t`` (the position whose hidden state predicts it).
    ``truncation`` (``top_k`` / ``top_p`` / ``min_p``, as rlmath's
    log-probs functions take them): the log-probs and entropy are those of
    the sampler's kept set, renormalised (vLLM's rule), as the rollout drew
    from it. Gradients flow to the model unless the caller disables them.
    """
    out = model(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.response_mask,
        temperature=temperature,
        with_log_prob=with_log_prob,
        with_entropy=with_entropy,
        with_values=with_values,
        truncation=truncation,
    )
    return ResponseOutputs(**out)


def _response_outputs(
    model: DemoLM,
    ids: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_mask: torch.Tensor,
    *,
    temperature: float,
    with_log_prob: bool,
    with_entropy: bool,
    with_values: bool,
    truncation: Truncation | None = None,
) -> dict[str, torch.Tensor]:
    b, s = ids.shape
    r = response_mask.shape[1]
    hidden = model.hidden_states(ids, mask, position_ids)  # [B, S, H]
    hidden_rmpad, indices, *_ = rlmath.unpad_input(hidden, mask)  # [N, H]
    dtype = torch.promote_types(hidden.dtype, torch.float32)

    def to_response(packed: torch.Tensor) -> torch.Tensor:
        # Hidden state at position p scores token p + 1, so the response
        # tokens at [S - R, S) are scored by positions [S - R - 1, S - 1).
        return rlmath.pad_input(packed.unsqueeze(-1), indices, b, s)[:, s - r - 1 : s - 1, 0]

    def packed_labels() -> torch.Tensor:
        # Labels of the packed positions: the next token of the same sequence
        # (-100 where there is none).
        valid = mask.bool()
        nxt_valid = torch.zeros_like(valid)
        nxt_valid[:, :-1] = valid[:, 1:]
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        return torch.where(nxt_valid, labels, -100).flatten()[indices]

    out: dict[str, torch.Tensor] = {"log_prob": torch.zeros(b, r, dtype=dtype, device=ids.device)}
    head = model.lm_head
    if (with_log_prob or with_entropy) and isinstance(head, VocabParallelLMHead):
        # The logits are never formed.
        log_prob, entropy = head.log_probs_and_entropy(
            hidden_rmpad, packed_labels(), temperature=temperature, with_entropy=with_entropy,
            truncation=truncation,
        )  # fmt: skip
        out["log_prob"] = to_response(log_prob)
        if entropy is not None:
            out["entropy"] = to_response(entropy)
    elif (with_log_prob or with_entropy) and truncation:
        # Under the sampler's kept set: one pass gives the log-probs and the entropy.
        logits_rmpad = head(hidden_rmpad)  # [N, V]
        log_prob, entropy = rlmath.log_probs_and_entropy_from_logits(
            logits_rmpad, packed_labels(), temperature=temperature, **truncation
        )
        out["log_prob"] = to_response(log_prob)
        if with_entropy:
            out["entropy"] = to_response(entropy)
    elif with_log_prob or with_entropy:
        logits_rmpad = head(hidden_rmpad)  # [N, V]
        if with_log_prob:
            out["log_prob"] = rlmath.log_probs_from_logits_response_rmpad(
                ids, mask, logits_rmpad, response_length=r, temperature=temperature
            )
        if with_entropy:
            out["entropy"] = to_response(
                rlmath.entropy_from_logits(logits_rmpad, temperature=temperature)
            )
    if with_values:
        if model.value_head is None:
            raise ValueError("with_values=True needs a model with a value head")
        out["values"] = to_response(model.value_head(hidden_rmpad).squeeze(-1).to(dtype))
    response_valid = response_mask.bool()
    return {name: torch.where(response_valid, v, 0.0) for name, v in out.items()}
