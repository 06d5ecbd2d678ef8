"""Batched autoregressive sampling from the policy, with one random stream per sample.

Sequences are at most a dozen tokens long, so each step simply re-runs the
model on the whole prefix instead of keeping a KV cache: on CPU at this size
the cost is Python overhead, not arithmetic, and recomputation keeps the
model code free of cache plumbing.

**Randomness that does not depend on the layout.** The token drawn at step
``t`` of a sample is the inverse of its distribution's CDF at a uniform number
``u[t]``, and a sample's uniforms come from its own generator, seeded from
``(seed, RL step, global sample index)`` (:func:`sample_uniforms`). So a
sample's tokens are the same whichever rank generates it and whatever else is
in its batch: an N-process run draws the tokens the one-process run draws.

**A truncating sampler.** With ``top_k`` / ``top_p`` / ``min_p`` the demo
samples as vLLM does (:func:`truncate_probs`: temperature, then min-p, then
top-k, then top-p over what those kept, renormalised) and records the
log-probability of each drawn token under that renormalised distribution,
the number a rollout engine reports. It is written here from the rule
itself, sorting each row, independently of rlmath's threshold search, so
that the trainer's matched log-probs (``rlmath``'s ``top_p=`` etc.) are
checked against a second implementation on every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from rlmath.demo.metrics import NonFiniteError

__all__ = [
    "Sampled",
    "generate",
    "inverse_cdf_sample",
    "sample_seed",
    "sample_uniforms",
    "truncate_probs",
]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators":
    # a bijective 64-bit mixer, so distinct inputs give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of sample ``index``'s generator at RL step ``step`` of a run seeded ``seed``."""
    h = _splitmix64(seed)
    h = _splitmix64(h ^ step)
    return _splitmix64(h ^ index) >> 1  # torch seeds are < 2**63


def sample_uniforms(seed: int, step: int, indices: Sequence[int], n: int) -> torch.Tensor:
    """``[len(indices), n]`` fp64 uniforms in ``[0, 1)``: row ``i`` from sample ``indices[i]``'s stream."""
    out = torch.empty(len(indices), n, dtype=torch.float64)
    g = torch.Generator()
    for row, index in enumerate(indices):
        g.manual_seed(sample_seed(seed, step, int(index)))
        out[row] = torch.rand(n, generator=g, dtype=torch.float64)
    return out


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids ``[B]``: the smallest ``k`` with ``Σ_{j<=k} p_j > u · Σ_j p_j``, per row.

    ``probs`` ``[B, V]`` (non-negative, any float dtype; computed on in fp64),
    ``u`` ``[B]`` in ``[0, 1)``. A token of probability 0 is never drawn.
    """
    cdf = probs.double().cumsum(-1)
    target = u.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def truncate_probs(
    probs: torch.Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:
    """vLLM's kept set: ``probs`` ``[B, V]`` with every token outside it set to 0 (not renormalised).

    Applied in vLLM's order: min-p keeps ``p_j >= min_p · max p``; top-k the
    ``k`` largest (every token tied with the ``k``-th too); top-p, over the
    distribution those two kept renormalised, the smallest prefix of the
    sorted tokens whose mass reaches ``top_p`` (a token is kept when the mass
    of the tokens sorted before it is below ``top_p``; tokens tied with the
    last one kept are kept too). The largest token is always kept.
    """
    keep = torch.ones_like(probs, dtype=torch.bool)
    if min_p is not None and min_p > 0:
        keep &= probs >= min_p * probs.amax(-1, keepdim=True)
    if top_k is not None and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, -1).values[:, -1:]
        keep &= probs >= kth
    if top_p is not None and top_p < 1:
        q = torch.where(keep, probs, 0.0)
        ordered = q.sort(-1, descending=True).values
        before = ordered.cumsum(-1) - ordered  # mass sorted before each token
        inside = before < top_p * ordered.sum(-1, keepdim=True)
        last = (inside.sum(-1, keepdim=True) - 1).clamp_min(0)
        keep &= probs >= ordered.gather(-1, last)
    return torch.where(keep, probs, 0.0)


class Sampled(NamedTuple):
    """What :func:`generate` drew: tokens, and their log-probabilities under the sampler."""

    #: ``[B, max_new_tokens]`` int64, ``pad_id`` after each row's ``eos_id``.
    tokens: torch.Tensor
    #: ``[B, max_new_tokens]`` fp64: log-probability of each drawn token under the
    #: distribution it was drawn from (temperature, then the kept set renormalised);
    #: 0 after the row finished and under greedy decoding.
    log_probs: torch.Tensor


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
    uniforms: torch.Tensor | None = None,
    stop_early: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> Sampled:
    """Sample responses ``[B, max_new_tokens]`` (int64) to left-padded prompts.

    ``prompt_ids`` / ``prompt_mask``: ``[B, P]``, prompts left-padded (mask 0 on
    padding). Each row is sampled from ``softmax(logits / temperature)``,
    restricted to the kept set of ``top_k`` / ``top_p`` / ``min_p``
    (:func:`truncate_probs`) and renormalised, until
    it emits ``eos_id``; later positions hold ``pad_id``. Token ``t`` of row
    ``b`` is drawn with ``uniforms[b, t]`` (``[B, max_new_tokens]``, see
    :func:`sample_uniforms`); ``temperature == 0`` means greedy decoding (no
    uniforms needed). With ``stop_early`` the loop ends once every row has
    finished; a sharded model (FSDP2) needs the same number of forward passes
    on every rank, so it passes ``stop_early=False``.
    """
    expected = (prompt_ids.shape[0], max_new_tokens)
    if temperature != 0 and (uniforms is None or tuple(uniforms.shape) != expected):
        raise ValueError(f"sampling at temperature > 0 needs uniforms of shape {expected}")
    model_was_training = model.training
    model.eval()
    b = prompt_ids.shape[0]
    device = prompt_ids.device
    ids, mask = prompt_ids, prompt_mask
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    log_probs = torch.zeros(b, max_new_tokens, dtype=torch.float64, device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        logits = model(ids, mask)[:, -1, :]
        if logits.dtype != torch.float64:
            logits = logits.float()
        if not bool(torch.isfinite(logits).all()):
            # A diverged policy: the sampler would draw garbage without saying why.
            raise NonFiniteError("policy logits (sampling)", _first_bad(logits))
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            assert uniforms is not None
            probs = torch.softmax(logits.double() / temperature, dim=-1)
            probs = truncate_probs(probs, top_k=top_k, top_p=top_p, min_p=min_p)
            nxt = inverse_cdf_sample(probs, uniforms[:, t]).to(device)
            drawn = probs.gather(-1, nxt[:, None]).squeeze(-1) / probs.sum(-1)
            log_probs[:, t] = torch.where(finished, 0.0, drawn.log())
        nxt = torch.where(finished, pad_id, nxt)
        out[:, t] = nxt
        finished = finished | (nxt == eos_id)
        if stop_early and bool(finished.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, (~finished | (nxt == eos_id)).to(mask.dtype)[:, None]], dim=1)
    model.train(model_was_training)
    return Sampled(out, log_probs)
