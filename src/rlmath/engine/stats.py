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
import torch.distributed as dist

from rlmath import _device
from rlmath.engine import tree
from rlmath.engine.config import VocabShard
from rlmath.engine.groups import ProcessGroup, all_gather, all_reduce

__all__ = [
    "STATS_TREE",
    "ShardLayoutError",
    "combine_kl",
    "combine_nodes",
    "combine_pi_squared",
    "combine_shards",
    "combine_tiles",
    "finish_kl",
    "global_max",
    "grad_coefficients",
    "merge_stat_nodes",
    "tiles_in_tree_order",
]


class ShardLayoutError(ValueError):
    """The vocabulary shards of a group do not tile ``[0, V)`` (a gap or an overlap)."""


def _max_with_layout(
    x: torch.Tensor, layout: tuple[int, int], group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce max of ``x``, and whether the group's shards tile the vocabulary.

    The shards' ``(start, width)`` ride in the same collective (``2·world``
    slots after ``x``; each rank fills its own), so the layout is checked on
    every call at no extra collective and without a host read. Returns
    ``(max of x, ok)`` with ``ok`` a 0-d bool tensor: sorted by start, the
    first shard starts at 0 and each next one where the previous ends. Where
    reading it is free (a CPU), a bad layout raises :class:`ShardLayoutError`
    on every rank; elsewhere the caller turns its results into NaN.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    slots = torch.full((2 * world,), NEG_INF, dtype=x.dtype, device=x.device)
    slots[me], slots[world + me] = float(layout[0]), float(layout[1])
    out = all_reduce(torch.cat([x.reshape(-1), slots]), "max", group)
    return out[: x.numel()].view_as(x), _layout_ok(out[-2 * world : -world], out[-world:])


def _layout_ok(starts: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Whether shards of these ``(start, width)`` (one per rank) tile ``[0, V)``: a 0-d bool.

    Where reading it is free (a CPU), a bad layout raises :class:`ShardLayoutError`.
    """
    order = torch.argsort(starts)
    begin = starts[order]
    end = begin + widths[order]
    ok = (begin[0] == 0) & (begin[1:] == end[:-1]).all()
    if _device.reads_host(starts.device) and not bool(ok):
        table = [(int(a), int(b)) for a, b in zip(starts.tolist(), widths.tolist(), strict=True)]
        raise ShardLayoutError(
            "vocabulary shards must tile [0, V) without gaps or overlap; (vocab_start_index, "
            f"width) by rank: {table}"
        )
    return ok


NEG_INF = float("-inf")


def merge_stat_nodes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row statistics of two disjoint parts of the vocabulary merged into one.

    ``a`` and ``b``: ``(..., k)``, the statistics stacked on the last dim,
    ``(m, s, t)`` (``k = 3``) or ``(m, s)`` (``k = 2``, no entropy). With
    ``M = max(m_a, m_b)``: ``s = e^{m_a - M}·s_a + e^{m_b - M}·s_b`` and
    ``t = e^{m_a - M}·(t_a + (m_a - M)·s_a) + (the same for b)``. A part
    without mass (``(-inf, 0, 0)``) adds exact zeros, so merging it returns the
    other part bit for bit; a NaN makes the result NaN.
    """
    ma, mb = a[..., 0], b[..., 0]
    # A part without mass has m = -inf: raised to the lowest float, its e^{m - M} is 0
    # (or, beside another such part, 1 times s = t = 0) and (m - M)·s is 0: no NaN.
    lowest = torch.finfo(a.dtype).min
    ca, cb = ma.clamp_min(lowest), mb.clamp_min(lowest)
    big = torch.maximum(ca, cb)
    da, db = ca - big, cb - big
    ea, eb = da.exp(), db.exp()
    sa, sb = a[..., 1], b[..., 1]
    parts = [torch.maximum(ma, mb), ea * sa + eb * sb]
    if a.shape[-1] == 3:
        parts.append(ea * (a[..., 2] + da * sa) + eb * (b[..., 2] + db * sb))
    return torch.stack(parts, -1)


def empty_stat_node(like: torch.Tensor) -> torch.Tensor:
    """``(m, s, t) = (-inf, 0, 0)`` shaped as ``like``: a part without mass, which
    :func:`merge_stat_nodes` returns the other operand for, bit for bit
    (``e^0 = 1`` times it, plus exact zeros)."""
    out = torch.zeros_like(like)
    out[..., 0] = NEG_INF
    return out


STATS_TREE = tree.TreeOp(merge_stat_nodes, empty_stat_node)
"""The fixed tree over per-tile ``(m, s[, t])`` statistics, each tile shifted by its own
max: the fused head's order, which needs no global max before its one pass."""


def combine_shards(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    z_labels: torch.Tensor | None,
    owned: torch.Tensor | None,
    group: ProcessGroup | None,
    layout: tuple[int, int] = (0, 0),
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None
]:
    """Global ``(M, log S, entropy, label logits, held)`` from every shard's per-row statistics.

    In a world of one (``group=None``) these are this process's statistics;
    otherwise two collectives: a max of ``m``, and one sum of a packed
    ``(N, 2 + 2K)`` buffer that also carries the label logits (only the owner
    of a label contributes a non-zero value) and how many shards hold each
    label (none: the label is not a token id of the whole vocabulary).

    Args:
        m, s: ``(N,)`` max and shifted sum-exp (``m = -inf`` with ``s = 0`` for a
            row without finite logits here).
        t: ``(N,)`` shifted entropy partial, or ``None``.
        z_labels: ``(N, K)`` scaled label logits (any value where not owned), or ``None``.
        owned: ``(N, K)`` bool, the labels this process holds (``None``: all).
        group: the vocabulary-parallel group, ``None`` for a world of one.
        layout: ``(start, width)`` of this shard, checked against the others'
            (:func:`_max_with_layout`; a bad layout makes every result NaN).

    Returns:
        ``M (N,)``, ``log S (N,)``, entropy ``(N,)`` or ``None``, label logits
        ``(N, K)`` or ``None`` (0 for labels nobody owns; in a world of one, any
        value at a label not owned here), and ``held``: ``(N, K)``
        bool, some shard holds the label (``None`` in a world of one, or without
        labels).
    """
    held = None
    if group is None:
        # A label not owned here is any value: the caller's finish makes it NaN or 0.
        big, s_all, t_all, z_all = m, s, t, z_labels
    else:
        if z_labels is not None and owned is not None:
            z_labels = torch.where(owned, z_labels, 0)  # the owner alone adds its logit
        big, ok = _max_with_layout(m, layout, group)
        big = torch.where(ok, big, float("nan"))
        dead = m == NEG_INF
        # A shard without mass in a row contributes exact zeros (its e^{m - M} may be NaN).
        scale = torch.where(dead, 0, torch.exp(m - big))
        parts = [s * scale]
        if t is not None:
            parts.append(torch.where(dead, 0, scale * (t + (m - big) * s)))
        k = 0
        if z_labels is not None:
            k = z_labels.shape[-1]
            parts.extend(z_labels.unbind(-1))
            if owned is not None:
                parts.extend(owned.to(s.dtype).unbind(-1))
        total = all_reduce(torch.stack(parts, -1), "sum", group)
        first = 2 if t is not None else 1
        s_all = total[:, 0]
        t_all = total[:, 1] if t is not None else None
        z_all = total[:, first : first + k] if z_labels is not None else None
        if z_labels is not None and owned is not None:
            held = total[:, first + k :] > 0
    log_s = s_all.log()
    ent = log_s - t_all / s_all if t_all is not None else None
    return big, log_s, ent, z_all, held


def combine_kl(
    kl: torch.Tensor,
    lse_z: torch.Tensor,
    lse_r: torch.Tensor,
    group: ProcessGroup | None,
    layout: tuple[int, int] = (0, 0),
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
    big, ok = _max_with_layout(torch.stack([lse_z, lse_r], -1), layout, group)
    big = torch.where(ok, big, float("nan"))
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
    m: torch.Tensor,
    s: torch.Tensor,
    u: torch.Tensor,
    group: ProcessGroup | None,
    layout: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """``Σ π² = U / S²`` over all shards from each shard's ``(m, s, u)`` (two collectives)."""
    if group is not None:
        big, ok = _max_with_layout(m, layout, group)
        big = torch.where(ok, big, float("nan"))
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


# ------------------------------------------------------------ the fixed tree over tiles


def tiles_in_tree_order(shard: VocabShard, group: ProcessGroup | None) -> bool:
    """Whether this shard's tile sums can be added in the single-process tree across the group.

    Needs every rank's columns from the shapes alone (:attr:`VocabShard.stride`)
    and shards that start on the 128-column tile grid.
    """
    return group is not None and shard.stride > 0 and shard.stride % tree.TILE == 0


def check_layout(like: torch.Tensor, group: ProcessGroup, layout: tuple[int, int]) -> torch.Tensor:
    """Whether the group's shards tile the vocabulary, as :func:`_max_with_layout` checks it,
    in a collective of its own (``2·world`` floats): a 0-d bool tensor (on a CPU a bad
    layout raises :class:`ShardLayoutError`). For a pass whose first collective has a
    size that follows from the layout, so that a bad one must be found before it."""
    return _max_with_layout(like.new_empty(0), layout, group)[1]


def global_max(m: torch.Tensor, group: ProcessGroup, layout: tuple[int, int]) -> torch.Tensor:
    """The max of each row over the group, the layout checked as in :func:`combine_shards`."""
    big, ok = _max_with_layout(m, layout, group)
    return torch.where(ok, big, float("nan"))


def combine_tiles(
    big: torch.Tensor,
    sums: list[torch.Tensor],
    z_labels: torch.Tensor | None,
    owned: torch.Tensor | None,
    shard: VocabShard,
    group: ProcessGroup,
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Per-tile sums of every shard added in the single-process tree: bitwise one process's sums.

    Every shard's sums are shifted by the same global row max ``big``
    (:func:`global_max`, which also checked the layout), so the tree only
    adds (:func:`combine_nodes`).

    Args:
        big: ``(N,)`` global row max.
        sums: ``(N, n)`` per-tile sums of this shard's real columns.
        z_labels, owned, shard, group: as in :func:`combine_nodes`.

    Returns:
        ``(sums (N,) each, label logits (N, K) or None, held (N, K) or None)``.
    """
    total = tree.tile_count(shard.total)
    first = dist.get_rank(group) * shard.stride // tree.TILE
    if sums:
        nodes = tree.local_nodes(torch.stack(sums, -1), first, total)
    else:
        nodes = []
    root, z_all, held = combine_nodes(nodes, len(sums), big, z_labels, owned, shard, group)
    return list(root.unbind(-1)), z_all, held


def combine_nodes(
    nodes: list[torch.Tensor],
    width: int,
    like: torch.Tensor,
    z_labels: torch.Tensor | None,
    owned: torch.Tensor | None,
    shard: VocabShard,
    group: ProcessGroup,
    op: tree.TreeOp = tree.ADD,
    ok: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The root of the single-process tree from every shard's nodes: one all-gather.

    Each rank hands on the nodes of the tree inside its run of tiles
    (:func:`rlmath.engine.tree.node_plan`, known to every rank from the
    layout); the all-gather carries them with the label logits (only the
    owner's is non-zero) and the owner flags, and each rank finishes the same
    tree from the nodes in the same order.

    Args:
        nodes: this rank's nodes, ``(N, width)`` each, in the order of its plan.
        width: values per node (``k`` sums, or ``(m, s[, t])``).
        like: any ``(N,)`` tensor of the compute dtype and device.
        z_labels: ``(N, K)`` scaled label logits (any value where not owned), or ``None``.
        owned: ``(N, K)`` bool, the labels this shard holds.
        shard: this shard (:attr:`~VocabShard.stride` > 0, a multiple of the tile width).
        group: the vocabulary-parallel group.
        op: how nodes combine (:data:`rlmath.engine.tree.ADD`, :data:`STATS_TREE`).
        ok: :func:`check_layout`'s result, for a caller without an earlier
            collective that checked the layout: where it is false, the root is NaN.

    Returns:
        ``(root (N, width), label logits (N, K) or None, held (N, K) or None)``.
    """
    world = dist.get_world_size(group)
    total = tree.tile_count(shard.total)
    plans = []
    for k in range(world):
        start = k * shard.stride
        real = max(0, min(shard.stride, shard.total - start))
        plans.append(tree.node_plan(start // tree.TILE, tree.tile_count(real), total))
    slots = max(len(p) for p in plans)
    n_rows = like.shape[0]
    packed = like.new_zeros(n_rows, slots, width)
    for j, v in enumerate(nodes):
        packed[:, j] = v
    parts = [packed.reshape(n_rows, -1)]
    k_labels = 0
    if z_labels is not None:
        k_labels = z_labels.shape[-1]
        parts.append(torch.where(owned, z_labels, 0) if owned is not None else z_labels)
        if owned is not None:
            parts.append(owned.to(like.dtype))
    everyone = all_gather(torch.cat(parts, -1), group)  # (world, N, ·)
    table = {
        node: everyone[k, :, j * width : (j + 1) * width]
        for k, plan in enumerate(plans)
        for j, node in enumerate(plan)
    }
    root = tree.evaluate(table, total, op) if total else op.identity(like.new_empty(n_rows, width))
    if ok is not None:
        root = torch.where(ok, root, float("nan"))
    z_all = held = None
    if z_labels is not None:
        first = slots * width
        z_all = everyone[:, :, first : first + k_labels].sum(0)
        if owned is not None:
            held = everyone[:, :, first + k_labels : first + 2 * k_labels].sum(0) > 0
    return root, z_all, held


def finish_kl(
    kl: torch.Tensor, mz: torch.Tensor, log_sz: torch.Tensor, mr: torch.Tensor, log_sr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(KL, lse_z, lse_r)`` from :func:`chunk_kl`'s statistics, for all rows at once.

    Entries with ``p_j = 0`` contribute 0 even when both logits are ``-inf``;
    ``p_j > 0`` where the reference is ``-inf`` makes the KL ``+inf``. A row
    whose policy logits are all ``-inf`` (no mass in this shard) gives
    ``KL = 0, lse_z = -inf``. Clamped at 0 (rounding could leave a hair below).
    A NaN in either row makes its KL NaN.
    """
    dead_z, dead_r = mz == NEG_INF, mr == NEG_INF
    shift = log_sz - log_sr
    kl = kl.clamp_min(0)
    kl = torch.where(dead_r & ~dead_z, float("inf"), kl)
    kl = torch.where(dead_z, 0, kl)
    # A NaN logit only reaches a log-sum (the NaN-skipping sum drops it): keep it visible.
    kl = torch.where(torch.isnan(shift), shift, kl)
    lse_z = torch.where(dead_z, NEG_INF, mz + log_sz)
    lse_r = torch.where(dead_r, NEG_INF, mr + log_sr)
    return kl, lse_z, lse_r
