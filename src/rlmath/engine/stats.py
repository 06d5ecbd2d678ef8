"""Per-row statistics that every backend shares: merging, combining over shards, coefficients.

A backend's forward pass returns, per row and over the vocabulary columns it
reads, ``m = max z``, ``s = Σ exp(z - m)`` and (for the entropy)
``t = Σ exp(z - m)·(z - m)``. Two disjoint parts of a vocabulary (tiles of a
fused-head block, or the shards of a vocabulary-parallel group) merge
exactly: with ``M = max_k m_k``, ``S = Σ_k e^{m_k - M}·s_k`` and
``T = Σ_k e^{m_k - M}·(t_k + (m_k - M)·s_k)``. Then ``lse = M + log S``,
``log p(label) = (z_label - M) - log S`` and ``H = log S - T / S``.
A part without a finite logit in a row (``m = -inf``) contributes nothing; a
NaN logit makes its row NaN.
"""

from __future__ import annotations

import torch

from rlmath.engine.groups import ProcessGroup, all_reduce

__all__ = [
    "combine_kl",
    "combine_pi_squared",
    "combine_shards",
    "grad_coefficients",
    "merge_tile_stats",
]

NEG_INF = float("-inf")


def merge_tile_stats(
    old: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row ``(m, s, t)`` of two disjoint parts of the vocabulary merged into one.

    Start from ``(-inf, 0, 0)`` and fold in the tiles one by one, which keeps
    the state at three numbers per row. A part whose logits are all ``-inf``
    for a row (``m = -inf``, NaN or 0 ``s``) contributes nothing.

    Args:
        old, new: ``(m, s, t)``, each ``(c,)`` (``t`` ``None`` without entropy).
    """
    big = torch.maximum(old[0], new[0])
    s_out = torch.zeros_like(big)
    t_out = torch.zeros_like(big) if old[2] is not None and new[2] is not None else None
    for m, s, t in (old, new):
        empty = m == NEG_INF
        d = torch.where(empty, 0.0, m - big)
        e = torch.where(empty, 0.0, d.exp())
        s = torch.where(empty, 0.0, s)
        s_out += e * s
        if t_out is not None and t is not None:
            t_out += e * (torch.where(empty, 0.0, t) + d * s)
    return big, s_out, t_out


def combine_shards(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    z_labels: torch.Tensor | None,
    owned: torch.Tensor | None,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Global ``(M, log S, entropy, label logits)`` from every shard's per-row statistics.

    In a world of one (``group=None``) these are this process's statistics;
    otherwise two collectives: a max of ``m``, and one sum of a packed
    ``(N, 2 + K)`` buffer that also carries the label logits (only the owner
    of a label contributes a non-zero value).

    Args:
        m, s: ``(N,)`` max and shifted sum-exp (``m = -inf`` with ``s = 0`` for a
            row without finite logits here).
        t: ``(N,)`` shifted entropy partial, or ``None``.
        z_labels: ``(N, K)`` scaled label logits (any value where not owned), or ``None``.
        owned: ``(N, K)`` bool, the labels this process holds (``None``: all).
        group: the vocabulary-parallel group, ``None`` for a world of one.

    Returns:
        ``M (N,)``, ``log S (N,)``, entropy ``(N,)`` or ``None``, label logits
        ``(N, K)`` or ``None`` (0 for labels nobody owns).
    """
    if z_labels is not None and owned is not None:
        z_labels = torch.where(owned, z_labels, 0)
    if group is None:
        big, s_all, t_all, z_all = m, s, t, z_labels
    else:
        big = all_reduce(m, "max", group)
        dead = m == NEG_INF
        # A shard without mass in a row contributes exact zeros (its e^{m - M} may be NaN).
        scale = torch.where(dead, 0, torch.exp(m - big))
        parts = [s * scale]
        if t is not None:
            parts.append(torch.where(dead, 0, scale * (t + (m - big) * s)))
        if z_labels is not None:
            parts.extend(z_labels.unbind(-1))
        total = all_reduce(torch.stack(parts, -1), "sum", group)
        s_all = total[:, 0]
        t_all = total[:, 1] if t is not None else None
        z_all = total[:, 2 if t is not None else 1 :] if z_labels is not None else None
    log_s = s_all.log()
    ent = log_s - t_all / s_all if t_all is not None else None
    return big, log_s, ent, z_all


def combine_kl(
    kl: torch.Tensor, lse_z: torch.Tensor, lse_r: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global ``(KL, lse_z, lse_r)`` from the shards' by the chain rule of the KL.

    With ``π_k``, ``ρ_k`` the probability mass of shard ``k`` under the policy
    and the reference, ``KL(p‖q) = Σ_k π_k·KL_k + Σ_k π_k·log(π_k/ρ_k)``: both
    terms are sums of small non-negative-on-average numbers, never a large
    difference, so a small KL keeps its relative accuracy. Three collectives;
    none in a world of one (``group=None``).
    """
    if group is None:
        return kl, lse_z, lse_r
    big = all_reduce(torch.stack([lse_z, lse_r], -1), "max", group)
    dead = torch.stack([lse_z == NEG_INF, lse_r == NEG_INF], -1)
    local = torch.stack([lse_z, lse_r], -1)
    sums = all_reduce(torch.where(dead, 0, torch.exp(local - big)), "sum", group)
    glob = big + sums.log()
    log_mass = local - glob  # log π_k, log ρ_k
    pi = log_mass[:, 0].exp()
    part = pi * (kl + log_mass[:, 0] - log_mass[:, 1])
    part = torch.where(dead[:, 0], 0, part)
    total = all_reduce(part, "sum", group).clamp_min(0)
    return total, glob[:, 0].clone(), glob[:, 1].clone()


def combine_pi_squared(
    m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, group: ProcessGroup | None
) -> torch.Tensor:
    """``Σ π² = U / S²`` over all shards from each shard's ``(m, s, u)`` (two collectives)."""
    if group is not None:
        big = all_reduce(m, "max", group)
        scale = torch.where(m == NEG_INF, 0, torch.exp(m - big))
        total = all_reduce(torch.stack([s * scale, u * scale * scale], -1), "sum", group)
        s, u = total[:, 0], total[:, 1]
    return u / s.square()


def grad_coefficients(
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    inv_temperature: torch.Tensor | float | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-row coefficients ``(alpha, beta, w)`` of the gradient, for all rows at once.

    With ``g_k`` the upstream gradient of log-prob ``k`` and ``g_H`` that of the
    entropy, ``∂logp_k/∂z = onehot(label_k) - p`` and ``∂H/∂z = -p·(ls + H)``
    (``= -p·(z - E_p[z])``), so the gradient w.r.t. the raw logits is::

        grad_j = p_j·(alpha + beta·ls_j) + Σ_k w_k·[j = label_k]
        alpha = -(Σ_k g_k + g_H·H)/T,   beta = -g_H/T,   w_k = g_k/T

    Returns ``alpha (N, 1)``, ``beta (N, 1)`` or ``None``, ``w (N, K)`` or ``None``.
    """
    a: torch.Tensor | None = None
    beta = w = None
    if grad_logp is not None:
        a = grad_logp.sum(-1)
        w = grad_logp if inv_temperature is None else grad_logp * _col(inv_temperature)
    if grad_entropy is not None:
        assert entropy is not None
        ga = grad_entropy * entropy
        a = ga if a is None else a + ga
        beta = -grad_entropy if inv_temperature is None else -grad_entropy * inv_temperature
        beta = beta.unsqueeze(-1)
    assert a is not None
    alpha = -a if inv_temperature is None else -a * inv_temperature
    return alpha.unsqueeze(-1), beta, w


def _col(x: torch.Tensor | float) -> torch.Tensor | float:
    return x.unsqueeze(-1) if isinstance(x, torch.Tensor) else x
