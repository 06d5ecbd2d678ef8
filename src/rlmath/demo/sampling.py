"""Batched autoregressive sampling from the policy.

Sequences are at most a dozen tokens long, so each step simply re-runs the
model on the whole prefix instead of keeping a KV cache: on CPU at this size
the cost is Python overhead, not arithmetic, and recomputation keeps the
model code free of cache plumbing.
"""

from __future__ import annotations

import torch
from torch import nn

from rlmath.demo.metrics import NonFiniteError

__all__ = ["generate"]


def _first_bad(x: torch.Tensor) -> float:
    return float(x[~torch.isfinite(x)].flatten()[0])


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample responses ``[B, max_new_tokens]`` (int64) to left-padded prompts.

    ``prompt_ids`` / ``prompt_mask``: ``[B, P]``, prompts left-padded (mask 0 on
    padding). Each row is sampled from ``softmax(logits / temperature)`` until
    it emits ``eos_id``; later positions hold ``pad_id``. ``temperature == 0``
    means greedy decoding. Sampling stops early once every row has finished.
    """
    model_was_training = model.training
    model.eval()
    b = prompt_ids.shape[0]
    device = prompt_ids.device
    ids, mask = prompt_ids, prompt_mask
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        logits = model(ids, mask)[:, -1, :].float()
        if not bool(torch.isfinite(logits).all()):
            # A diverged policy: multinomial would fail with an unclear message.
            raise NonFiniteError("policy logits (sampling)", _first_bad(logits))
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        nxt = torch.where(finished, pad_id, nxt)
        out[:, t] = nxt
        finished = finished | (nxt == eos_id)
        if bool(finished.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, (~finished | (nxt == eos_id)).to(mask.dtype)[:, None]], dim=1)
    model.train(model_was_training)
    return out
