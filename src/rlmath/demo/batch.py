"""Turning prompts and responses into tensors, and the packed (rmpad) forward pass.

Layout (the one verl uses): prompts are left-padded to ``P`` tokens,
responses right-padded to ``R`` tokens, and a sequence is their concatenation
``[B, P + R]``::

    prompt (left-padded)        response (right-padded)
    <pad> <bos> 3 1 4 <sep>  |  1 3 4 <eos> <pad> <pad>

``response_forward`` runs the transformer trunk on this padded batch, then
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

import torch

import rlmath
from rlmath.demo.model import DemoLM

__all__ = ["ResponseOutputs", "Rollout", "left_pad", "make_rollout", "response_forward"]


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
    """Per-response-token outputs ``[B, R]`` (fp32); 0 where the response is padding."""

    log_prob: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


def response_forward(
    model: DemoLM,
    batch: Rollout,
    *,
    temperature: float = 1.0,
    with_log_prob: bool = True,
    with_entropy: bool = False,
    with_values: bool = False,
) -> ResponseOutputs:
    """Log-probs (and entropies, values) of the response tokens, via the packed path.

    ``log_prob[b, t]`` is ``log π(response[b, t] | prompt, response[b, :t])``
    at ``temperature``; ``entropy[b, t]`` is the entropy of that
    distribution; ``values[b, t]`` is the value head's estimate at the state
    *before* token ``t`` (the position whose hidden state predicts it).
    Gradients flow to the model unless the caller disables them.
    """
    ids, mask = batch.input_ids, batch.attention_mask
    b, s = ids.shape
    r = batch.response_length
    hidden = model.hidden_states(ids, mask, batch.position_ids)  # [B, S, H]
    hidden_rmpad, indices, *_ = rlmath.unpad_input(hidden, mask)  # [N, H]

    def to_response(packed: torch.Tensor) -> torch.Tensor:
        # Hidden state at position p scores token p + 1, so the response
        # tokens at [S - R, S) are scored by positions [S - R - 1, S - 1).
        return rlmath.pad_input(packed.unsqueeze(-1), indices, b, s)[:, s - r - 1 : s - 1, 0]

    out = ResponseOutputs(log_prob=torch.zeros(b, r, device=ids.device))
    if with_log_prob or with_entropy:
        logits_rmpad = model.lm_head(hidden_rmpad)  # [N, V]
        if with_log_prob:
            out.log_prob = rlmath.log_probs_from_logits_response_rmpad(
                ids, mask, logits_rmpad, response_length=r, temperature=temperature
            )
        if with_entropy:
            out.entropy = to_response(
                rlmath.entropy_from_logits(logits_rmpad, temperature=temperature)
            )
    if with_values:
        if model.value_head is None:
            raise ValueError("with_values=True needs a model with a value head")
        out.values = to_response(model.value_head(hidden_rmpad).squeeze(-1).float())
    response_valid = batch.response_mask.bool()
    for name in ("log_prob", "entropy", "values"):
        v = getattr(out, name)
        if v is not None:
            setattr(out, name, torch.where(response_valid, v, 0.0))
    return out
