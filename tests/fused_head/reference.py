"""fp64 references for the fused head, written from the math: unfused logits, then plain log-softmax."""

from __future__ import annotations

import torch

from tests.logprobs.reference import log_softmax64


def make(shape, dtype=torch.float64, *, scale=1.0, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return x.requires_grad_(requires_grad)


def make_labels(shape, V, *, seed=1, ignore=(), ignore_index=-100):
    labels = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    for pos in ignore:
        labels[pos] = ignore_index
    return labels


def logits64(hidden, weight, bias=None):
    """``hidden @ weight.T + bias`` in fp64 (from the given values, whatever their dtype)."""
    z = hidden.double() @ weight.double().T
    return z if bias is None else z + bias.double()


def ref_from_logits(logits, labels, temperature=1.0, ignore_index=-100):
    """``(log-probs, entropy)`` of ``logits / T`` in fp64; 0 where ``labels == ignore_index``."""
    ls = log_softmax64(logits, temperature)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0)
    lp = ls.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    p = ls.exp()
    ent = -torch.where(p > 0, p * ls, torch.zeros_like(p)).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def ref_fused(hidden, weight, labels, bias=None, temperature=1.0, ignore_index=-100):
    return ref_from_logits(logits64(hidden, weight, bias), labels, temperature, ignore_index)
