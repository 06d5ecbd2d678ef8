"""Shared test helpers: batches with ragged and fully masked rows, fp64 reference aggregation.

The references here are written from the definitions (plain Python loops over
sequences and tokens), never from rlmath's code.
"""

from __future__ import annotations

import torch

MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "prompt-mean",
)


def prompt_of(row: int) -> int:
    """The prompt of a test batch's row: rows 2k and 2k + 1 answer prompt k."""
    return row // 2


def prompt_tokens(mask: torch.Tensor) -> torch.Tensor:
    """Each row's prompt token count (valid tokens of the rows of its prompt), by a loop."""
    b = mask.shape[0]
    per_prompt: dict[int, float] = {}
    for i in range(b):
        per_prompt[prompt_of(i)] = per_prompt.get(prompt_of(i), 0.0) + float(mask[i].sum())
    return torch.tensor([per_prompt[prompt_of(i)] for i in range(b)], dtype=torch.float64)


def agg_extra(mask: torch.Tensor, norm_length: float | None = None) -> dict:
    """The aggregation keywords every mode of the tests needs: ``norm_length`` (the padded
    width unless given) and ``prompt_num_tokens`` (for ``prompt-mean``)."""
    return {
        "norm_length": mask.shape[-1] if norm_length is None else norm_length,
        "prompt_num_tokens": prompt_tokens(mask).to(mask.device),
    }


# Every registered policy loss with the keyword scalars the tests use
# (dro needs dro_beta; clip/kl-cov get ratios that select several tokens).
LOSS_KWARGS: dict[str, dict] = {
    "vanilla": {},
    "gspo": {},
    "gspo_token": {},
    "gspo_seq": {},
    "sapo": {},
    "gpg": {},
    "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0, "clip_cov_ub": 50.0},
    "kl_cov": {"kl_cov_ratio": 0.2},
    "geo_mean": {},
    "cispo": {},
    "dppo_tv": {},
    "dppo_kl": {},
    "dro": {"dro_beta": 0.3},
    "reinforce": {},
    "vespo": {},
    "two_sided_clip": {"delta": 1.5},  # δ low enough that the random ratios reach it
    "luspo": {},
    "topr": {},
    "kimi15": {},
    "ipo": {"ipo_threshold": 0.05, "kl_tau": 0.01},  # masks a share of the random tokens
}


def ragged_mask(b: int, t: int, gen: torch.Generator, *, empty_rows=(1,), gaps: bool = True):
    """A ``(b, t)`` bool mask: random lengths, interior gaps, the rows in ``empty_rows`` fully masked."""
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).expand(b, t) < lengths[:, None]
    if gaps:
        mask = mask & (torch.rand(b, t, generator=gen) > 0.2)
        mask[:, 0] = mask[:, 0] | (lengths > 0)
    for r in empty_rows:
        if r < b:
            mask[r] = False
    return mask


def policy_batch(
    b: int,
    t: int,
    seed: int,
    *,
    dtype=torch.float64,
    scale: float = 0.4,
    seq_adv: bool = False,
    empty_rows=(1,),
):
    """Random ``(old_log_prob, log_prob, advantages, mask)`` with log-probs ≤ 0."""
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(b, t, gen, empty_rows=empty_rows)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3 - 0.05
    logp = (old + torch.randn(b, t, generator=gen, dtype=torch.float64) * scale).clamp(max=-1e-3)
    if seq_adv:
        adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t).contiguous()
    else:
        adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    return old.to(dtype), logp.to(dtype), adv.to(dtype), mask


def ref_agg(loss: dict, mask: torch.Tensor, mode: str, norm_length: float | None = None):
    """fp64 reference of every aggregation mode.

    ``loss[(i, t)]`` is a scalar tensor (autograd allowed) for each valid token;
    ``prompt-mean`` groups the rows by :func:`prompt_of`.
    """
    b, t = mask.shape
    rows = [[j for j in range(t) if mask[i, j]] for i in range(b)]
    zero = torch.zeros((), dtype=torch.float64)
    if mode == "prompt-mean":
        prompts: dict[int, list[int]] = {}
        for i in range(b):
            prompts.setdefault(prompt_of(i), []).append(i)
        means = []
        for members in prompts.values():
            cells = [(i, j) for i in members for j in rows[i]]
            if cells:
                means.append(sum((loss[c] for c in cells), zero) / len(cells))
        return sum(means, zero) / len(means) if means else zero
    if mode == "token-sum":
        return sum((loss[(i, j)] for i in range(b) for j in rows[i]), zero)
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        total = sum((loss[(i, j)] for i in range(b) for j in rows[i]), zero)
        return total / n if n else zero
    seqs = [i for i in range(b) if rows[i]]
    if not seqs:
        return zero
    per = []
    for i in seqs:
        s = sum((loss[(i, j)] for j in rows[i]), zero)
        if mode == "seq-mean-token-mean":
            s = s / len(rows[i])
        elif mode == "seq-mean-token-sum-norm":
            s = s / norm_length
        per.append(s)
    return sum(per, zero) / len(seqs)
