"""Per-row statistics of one vocabulary shard and their combination over the group.

Shared by the vocabulary-parallel functions on logits and on the LM head. Each
rank reduces its own columns with the chunk primitives of
:mod:`rlmath.logprobs._kernels`, giving per row ``m_k = max z``,
``s_k = Σ exp(z - m_k)`` and ``t_k = Σ exp(z - m_k)·(z - m_k)``; the group then
combines them (``M = max_k m_k``, ``s = Σ_k s_k e^{m_k - M}``,
``t = Σ_k e^{m_k - M}(t_k + (m_k - M)s_k)``) in two collectives per call: one
max, and one sum of a packed ``(N, 2 + K)`` buffer that also carries the label
logits (only the owner of a label contributes a non-zero value).

A shard row whose logits are all ``-inf`` (padding columns, a masked
vocabulary) has no mass: it contributes ``s_k = t_k = 0`` instead of the NaN
that ``-inf - (-inf)`` would give, so another rank's finite logits decide the
row. A NaN logit still makes its row NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmath.distributed._collectives import ProcessGroup, all_reduce
from rlmath.logprobs._kernels import (
    Workspace,
    chunk_stats,
    finish_stats,
)

__all__ = [
    "ShardSpec",
    "combine_shard_stats",
    "local_labels",
    "shard_chunk_stats",
]


@dataclass(frozen=True)
class ShardSpec:
    """Which global vocabulary columns this rank holds.

    ``start`` is the global id of local column 0; only the first ``real``
    local columns are real tokens (the rest, if any, are padding that is left
    out of the softmax and receives a zero gradient). ``ignore_index`` marks
    labels that give log-prob 0 and no gradient (``None``: none).
    """

    start: int
    real: int
    ignore_index: int | None


def local_labels(
    labels: torch.Tensor, shard: ShardSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local, owned, valid)`` for ``(N, K)`` global labels.

    ``valid``: not ``ignore_index``. ``owned``: valid and inside this rank's
    real columns. ``local``: the local column of an owned label, 0 elsewhere
    (a safe index for ``gather``/``scatter_add`` whose value is then masked).
    """
    valid = (
        labels != shard.ignore_index
        if shard.ignore_index is not None
        else torch.ones_like(labels, dtype=torch.bool)
    )
    local = labels - shard.start
    owned = valid & (local >= 0) & (local < shard.real)
    return torch.where(owned, local, 0), owned, valid


def shard_chunk_stats(
    src: torch.Tensor,
    ws: Workspace,
    *,
    temperature: torch.Tensor | None,
    labels: torch.Tensor | None,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`chunk_stats` of one chunk of local columns, plus the raw label logits.

    Returns ``(m, s, t, z_labels)``: ``(c,)``, ``(c,)``, ``(c,)`` or ``None``,
    and ``(c, K)`` scaled logits ``z[labels]`` (compute dtype) or ``None``.
    ``labels`` are local column indices (garbage rows are masked by the caller).
    A row with no finite logit comes back as ``m = -inf, s = t = 0``.
    """
    m, s, t, _ = chunk_stats(src, ws, temperature=temperature, entropy=entropy)
    dead = m == float("-inf")
    s = torch.where(dead, 0, s)
    if t is not None:
        t = torch.where(dead, 0, t)
    z = None
    if labels is not None:
        # The same rounding as the single-process kernel: upcast, then divide by T.
        z = src.gather(1, labels).to(ws.dtype)
        if temperature is not None:
            z = z / temperature
    return m, s, t, z


def combine_shard_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    z_labels: torch.Tensor | None,
    owned: torch.Tensor | None,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Global ``(lse, entropy, label logits)`` from every rank's per-row shard statistics.

    Args:
        m, s: ``(N,)`` this rank's max and shifted sum-exp (``m = -inf`` with
            ``s = 0`` for a row without finite logits here).
        t: ``(N,)`` shifted entropy partial, or ``None``.
        z_labels: ``(N, K)`` scaled label logits (garbage where not owned), or ``None``.
        owned: ``(N, K)`` bool, the labels this rank owns (with ``z_labels``).
        group: the tensor-parallel group.

    Returns:
        ``lse (N,)``, ``entropy (N,)`` or ``None``, ``z (N, K)`` or ``None``:
        the global log-sum-exp, entropy and the label logits (0 for labels no
        rank owns, i.e. ignored ones), identical on every rank.
    """
    big_m = all_reduce(m, "max", group)
    dead = m == float("-inf")
    # A rank without mass in a row contributes exact zeros (its e^{m - M} may be NaN).
    scale = torch.where(dead, 0, torch.exp(m - big_m))
    parts = [s * scale]
    if t is not None:
        parts.append(torch.where(dead, 0, scale * (t + (m - big_m) * s)))
    if z_labels is not None:
        assert owned is not None
        parts.extend(torch.where(owned, z_labels, 0).unbind(-1))
    total = all_reduce(torch.stack(parts, -1), "sum", group)
    s_all = total[:, 0]
    t_all = total[:, 1] if t is not None else None
    lse, _, ent = finish_stats(big_m, s_all, t_all)
    z = total[:, 2 if t is not None else 1 :] if z_labels is not None else None
    return lse, ent, z
