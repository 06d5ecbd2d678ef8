"""fp64 references of each engine's kept set, written per row from the engines' documented rules.

No code is shared with rlmath: every rule is a plain loop over one row's
tokens in fp64. rlmath's rule for ties (tokens whose logit equals the
threshold are all kept) is the one written here: "the mass of the tokens with
a strictly larger logit", "the k-th largest value".

- vLLM (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``):
  temperature, min-p, top-k, then top-p on the softmax of what min-p and top-k
  kept; a token is cut when the ascending cumulative mass up to it is
  ``<= 1 - p``, i.e. kept when the mass above it is ``< p``.
- SGLang (``sglang/srt/layers/sampler.py``,
  ``top_k_top_p_min_p_sampling_from_probs_torch``): on the full softmax after
  temperature, sorted: top-k by rank, top-p cuts a token whose exclusive
  cumulative mass is ``> p`` (no renormalisation after top-k), min-p cuts
  ``prob < min_p · max prob``.
- HF transformers (``generate``): Temperature, TopK, TopP (the softmax of the
  top-k scores, ``cumsum <= 1 - p`` ascending cut), MinP (``prob < min_p ·
  max prob`` cut).
"""

from __future__ import annotations

import math

import torch


def _softmax(values: list[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    if not finite:
        return [0.0] * len(values)
    m = max(finite)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in values]
    s = sum(e)
    return [x / s for x in e]


def _kth_largest(values: list[float], k: int) -> float:
    return sorted(values, reverse=True)[k - 1]


def _min_p_keep(z: list[float], cand: set[int], min_p: float) -> set[int]:
    m = max(z[j] for j in cand)
    return {j for j in cand if math.exp(z[j] - m) >= min_p}


def _top_k_keep(z: list[float], cand: set[int], k: int) -> set[int]:
    if k >= len(cand):
        return set(cand)
    kth = _kth_largest([z[j] for j in cand], k)
    return {j for j in cand if z[j] >= kth}


def _top_p_keep(
    z: list[float], cand: set[int], p: float, mass_over: set[int], strict: bool
) -> set[int]:
    """Tokens of ``cand`` whose strictly-larger mass (softmax over ``mass_over``) is below ``p``."""
    order = sorted(mass_over)
    probs = dict(zip(order, _softmax([z[j] for j in order]), strict=True))
    # The mass strictly above each distinct value, walking the values from the largest.
    above_value: dict[float, float] = {}
    total = 0.0
    for value in sorted({z[j] for j in mass_over} | {z[i] for i in cand}, reverse=True):
        above_value[value] = total
        total += sum(probs[j] for j in mass_over if z[j] == value)
    keep = set()
    for i in cand:
        above = above_value[z[i]]
        if (above < p) if strict else (above <= p):
            keep.add(i)
    return keep


def kept_row(
    z: list[float], sampler: str, top_k: int | None, top_p: float | None, min_p: float | None
) -> set[int]:
    """The kept set of one row of scaled logits ``z`` (``None``, ``k >= V``, ``p = 1``,
    ``min_p = 0``: that filter is off)."""
    V = len(z)
    everything = set(range(V))
    k = top_k if top_k is not None and top_k < V else None
    p = top_p if top_p is not None and top_p < 1.0 else None
    mp = min_p if min_p is not None and min_p > 0.0 else None
    if sampler == "vllm":
        cand = set(everything)
        if mp is not None:
            cand = _min_p_keep(z, cand, mp)
        if k is not None:
            cand = _top_k_keep(z, cand, k)
        if p is not None:
            cand = _top_p_keep(z, cand, p, cand, strict=True)
        return cand
    if sampler == "hf":
        cand = set(everything)
        if k is not None:
            cand = _top_k_keep(z, cand, k)
        if p is not None:
            cand = _top_p_keep(z, cand, p, cand, strict=True)
        if mp is not None:
            cand = _min_p_keep(z, cand, mp)
        return cand
    assert sampler == "sglang"
    cand = set(everything)
    if k is not None:
        cand &= _top_k_keep(z, everything, k)
    if p is not None:
        cand &= _top_p_keep(z, everything, p, everything, strict=False)
    if mp is not None:
        cand &= _min_p_keep(z, everything, mp)
    return cand


def _at(value, i: int):
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[i].item()
    return value


def reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    sampler: str = "vllm",
    top_k=None,
    top_p=None,
    min_p=None,
    temperature=1.0,
    kept: torch.Tensor | None = None,
):
    """fp64 ``(log_probs, entropy, outside, kept_count, kept_mask)`` of 2-D ``logits`` and 1-D labels.

    Per-row parameters are ``(N,)`` tensors. ``kept``: a ``(N, V)`` bool mask to
    replay instead of the rule. ``log_probs`` and ``entropy`` are differentiable
    w.r.t. ``logits`` (autograd through ``log_softmax`` of the masked logits).
    """
    N, V = logits.shape
    z = logits.double() / (
        temperature.double().reshape(-1, 1)
        if isinstance(temperature, torch.Tensor)
        else temperature
    )
    mask = torch.zeros(N, V, dtype=torch.bool)
    for i in range(N):
        row = z[i].tolist()
        if kept is not None:
            mask[i] = kept[i]
        else:
            for j in kept_row(row, sampler, _at(top_k, i), _at(top_p, i), _at(min_p, i)):
                mask[i, j] = True
    finite = z.detach() > -math.inf
    count = (mask & finite).sum(-1)
    outside = ~mask.gather(1, labels.unsqueeze(-1)).squeeze(-1)
    full = mask.clone()
    full[torch.arange(N), labels] = True
    ls = torch.log_softmax(z.masked_fill(~full, -math.inf), -1)
    logp = ls.gather(1, labels.unsqueeze(-1)).squeeze(-1)
    p = ls.exp()
    ent = -(p * ls.masked_fill(~(full & finite), 0.0)).sum(-1)
    return logp, ent, outside, count, mask
