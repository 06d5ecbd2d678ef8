"""fp64 references written from the definitions (no chunking, no shared code with rlmath)."""

from __future__ import annotations

import torch


def scaled(logits: torch.Tensor, temperature) -> torch.Tensor:
    """``logits / T`` in fp64, ``T`` a float or a tensor broadcastable to ``logits.shape[:-1]``."""
    z = logits.double()
    if isinstance(temperature, torch.Tensor):
        return z / temperature.double().unsqueeze(-1)
    return z / temperature


def log_softmax64(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """``z - log Σ exp(z)`` in fp64, the max subtracted first (-inf entries stay -inf)."""
    z = scaled(logits, temperature)
    m = z.max(-1, keepdim=True).values
    return z - m - (z - m).exp().sum(-1, keepdim=True).log()


def ref_log_probs(logits, labels, temperature=1.0) -> torch.Tensor:
    ls = log_softmax64(logits, temperature)
    if labels.dim() == logits.dim() - 1:
        return ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return ls.gather(-1, labels)


def ref_entropy(logits, temperature=1.0) -> torch.Tensor:
    ls = log_softmax64(logits, temperature)
    p = ls.exp()
    return -torch.where(p > 0, p * ls, torch.zeros_like(p)).sum(-1)


def ref_kl(logits, ref_logits, temperature=1.0) -> torch.Tensor:
    lp = log_softmax64(logits, temperature)
    lq = log_softmax64(ref_logits, temperature)
    p = lp.exp()
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1)


def ref_response_dense(input_ids, logits, response_length) -> torch.Tensor:
    """Plain loop: column j scores the token at S - R + j with the logits of the column before."""
    B, S = input_ids.shape
    R = response_length
    out = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        for j in range(R):
            s = S - R + j
            ls = log_softmax64(logits[b, s - 1])
            out[b, j] = ls[input_ids[b, s]]
    return out
