"""The bodies of the engine's operators: one implementation for one process or a vocabulary shard.

Each operator runs the same steps for every backend: locate the labels in
this process's vocabulary columns, apply ``ignore_index``, put the
temperature on the rows, call the backend's pass, combine the per-row
statistics over the vocabulary-parallel group (nothing to combine in a
world of one), and finish the per-row results. Backward computes the
per-row gradient coefficients once and hands them to the backend's pass.

Ignored positions (every label of the row equal to ``ignore_index``) are
*dead* rows: they return 0, receive an exactly zero gradient whatever their
logits or hidden states hold, and their temperature is never read (it is
replaced by 1, so a 0 or NaN there cannot reach any gradient).
"""

from __future__ import annotations

import math

import torch

from rlmath._validation import result_dtype
from rlmath.engine.backends import get_kernels
from rlmath.engine.config import OpConfig
from rlmath.engine.groups import ProcessGroup, all_reduce, resolve_group
from rlmath.engine.policy import auto_tile_sizes
from rlmath.engine.sampling import KeptSet
from rlmath.engine.stats import (
    STATS_TREE,
    check_layout,
    combine_kl,
    combine_nodes,
    combine_pi_squared,
    combine_shards,
    combine_tiles,
    finish_kl,
    global_max,
    grad_coefficients,
    tiles_in_tree_order,
)
from rlmath.engine.tree import TILE, tile_count

__all__ = [
    "head_backward",
    "head_forward",
    "kl_backward",
    "kl_forward",
    "logits_backward",
    "logits_forward",
    "num_rows",
    "pi_squared",
]

Temp = torch.Tensor | float | None


def num_rows(
    logits: torch.Tensor, row_index: torch.Tensor | None, narrow: tuple[int, int, int] | None
) -> int:
    """Rows an operator on ``logits`` processes (all, a narrow of a batch dim, or indexed)."""
    if row_index is not None:
        return row_index.numel()
    shape = list(logits.shape[:-1])
    if narrow is not None:
        shape[narrow[0]] = narrow[2]
    return math.prod(shape)


class _Labels:
    """Labels located in this process's columns, and which of them count.

    ``local``: ``(M, K)`` column indices into the local vocabulary (0 where the
    label is not held here or ignored). ``owned``: ``(M, K)`` bool, held here
    and not ignored. ``valid``: not ignored (``None``: all). ``live``: ``(M,)``
    rows with at least one valid label (``None``: all; computed when first
    read). ``held``: ``(M, K)`` bool, the label is a column of this process;
    in a world of one (``single``), whether it is a token id of the
    vocabulary at all (``[0, V)``); for a shard no column of the others is
    known (see :func:`~rlmath.engine.stats.combine_shards`).
    """

    def __init__(self, labels: torch.Tensor, cfg: OpConfig, real: int, single: bool):
        ignore = cfg.ignore_index
        self.valid = labels != ignore if ignore is not None else None
        self._live: torch.Tensor | None = None
        start = cfg.shard.start
        local = labels - start if start else labels
        if real > 0:
            # One clamp and one comparison: held exactly where 0 <= local < real.
            held = local.clamp(0, real - 1) == local
        else:
            held = torch.zeros_like(local, dtype=torch.bool)
        self.held = held
        self.single = single
        self.owned = held if self.valid is None else held & self.valid
        self.local = torch.where(self.owned, local, 0)

    @property
    def live(self) -> torch.Tensor | None:
        if self._live is None and self.valid is not None:
            self._live = self.valid.any(-1)
        return self._live

    def finish(self, logp: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
        """``logp`` with 0 at ignored labels and NaN at labels that are not token ids.

        ``held``: for a shard, whether any shard of the group holds each label.
        """
        if held is None and self.single:
            held = self.held
        if held is not None:
            # NaN wherever no shard holds the label; an ignored one is 0 next.
            logp = torch.where(held, logp, float("nan"))
        if self.valid is not None:
            logp = torch.where(self.valid, logp, 0)
        return logp


def _row_temperature(
    temperature: torch.Tensor | None,
    scalar: float,
    batch: tuple[int, ...],
    dtype: torch.dtype,
    *,
    narrow: tuple[int, int, int] | None = None,
    row_index: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
) -> Temp:
    """The temperature of each processed row: ``None`` (1), a float, or an ``(M,)`` tensor.

    A tensor broadcasts to ``batch`` (the rows of the logits or hidden states),
    then the same rows as the logits are taken; dead rows get 1.
    """
    if temperature is None:
        return None if scalar == 1.0 else scalar
    t = temperature.to(dtype).expand(batch)
    if narrow is not None:
        t = t.narrow(*narrow)
    t = t.reshape(-1)
    if row_index is not None:
        t = t[row_index]
    if live is not None:
        t = torch.where(live, t, 1.0)
    return t


def _inv(temperature: Temp) -> torch.Tensor | float | None:
    if isinstance(temperature, torch.Tensor):
        return temperature.reciprocal()
    return None if temperature is None else 1.0 / temperature


def _group(cfg: OpConfig) -> ProcessGroup | None:
    return resolve_group(cfg.shard.group)


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


# ------------------------------------------------------------------ logits


def _logits_setup(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: torch.Tensor | None,
    row_index: torch.Tensor | None,
    cfg: OpConfig,
    cdt: torch.dtype,
) -> tuple[int, ProcessGroup | None, _Labels | None, Temp]:
    """``(real columns, group, labels located here, temperature of each row)``."""
    real = cfg.shard.real_columns(logits.shape[-1])
    group = _group(cfg)
    lab = None
    if labels is not None:
        lab = _Labels(labels, cfg, real, group is None)
    temp = _row_temperature(
        temperature,
        cfg.temperature,
        tuple(logits.shape[:-1]),
        cdt,
        narrow=cfg.narrow,
        row_index=row_index,
        # The live rows matter to a per-row temperature only.
        live=lab.live if lab is not None and temperature is not None else None,
    )
    return real, group, lab, temp


def _row_params(
    sampling: torch.Tensor | None,
    batch: tuple[int, ...],
    narrow: tuple[int, int, int] | None,
    row_index: torch.Tensor | None,
) -> torch.Tensor | None:
    """The per-row sampling parameters ``(M, 3)`` (top-k, top-p, min-p) of the processed rows.

    ``sampling`` is ``batch + (3,)`` (float64); the rows are taken as for the temperature.
    """
    if sampling is None:
        return None
    t = sampling.expand(*batch, 3)
    if narrow is not None:
        t = t.narrow(*narrow)
    t = t.reshape(-1, 3)
    return t[row_index] if row_index is not None else t


def _sampler_params(
    cfg: OpConfig,
    sampling: torch.Tensor | None,
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    real: int | None,
    cdt: torch.dtype,
) -> tuple[
    torch.Tensor | int | None, torch.Tensor | float | None, torch.Tensor | float | None, int
]:
    """``(top_k, top_p, min_p, kmax)`` of the processed rows (scalars or ``(M,)`` tensors).

    ``real``: the columns ``top_k`` is clamped to (``None``: the vocabulary is
    split, its size is not known here).
    """
    rows = _row_params(sampling, tuple(logits.shape[:-1]), cfg.narrow, row_index)
    top_k: torch.Tensor | int | None = None
    top_p: torch.Tensor | float | None = None
    min_p: torch.Tensor | float | None = None
    kmax = 0
    if cfg.sampler == "kept":
        return top_k, top_p, min_p, kmax
    if cfg.top_k == -1:
        assert rows is not None
        top_k = rows[:, 0].to(torch.int64).clamp_(1, max(real, 1) if real is not None else None)
        kmax = int(top_k.max()) if top_k.numel() else 0  # one host read per call
    elif cfg.top_k > 0:
        top_k = cfg.top_k
        kmax = min(cfg.top_k, real) if real is not None else cfg.top_k
    if cfg.top_p == -1.0:
        assert rows is not None
        top_p = rows[:, 1].to(cdt)
    elif cfg.top_p < 1.0:
        top_p = cfg.top_p
    if cfg.min_p == -1.0:
        assert rows is not None
        min_p = rows[:, 2].to(cdt)
    elif cfg.min_p > 0.0:
        min_p = cfg.min_p
    return top_k, top_p, min_p, kmax


def _kept_set(
    cfg: OpConfig,
    sampling: torch.Tensor | None,
    kept: torch.Tensor | None,
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    lab: _Labels | None,
    real: int,
    cdt: torch.dtype,
    *,
    tau: torch.Tensor,
    count: torch.Tensor | None,
    forward: bool,
) -> KeptSet | None:
    """The kept set of a truncating sampler for this call (``None``: the full vocabulary).

    A replayed ``kept`` over vocabulary shards (global columns or token ids) is
    cut to this shard's columns.
    """
    if not cfg.sampler:
        return None
    top_k, top_p, min_p, kmax = _sampler_params(cfg, sampling, logits, row_index, real, cdt)
    if kept is not None and cfg.shard.group:
        kept = _local_kept(kept, cfg.shard.start, real)
    return KeptSet(
        cfg.sampler,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        kmax=kmax,
        kept=kept,
        labels=lab.local if lab is not None else None,
        owned=lab.owned if lab is not None else None,
        tau=tau,
        count=count,
        forward=forward,
    )


def _local_kept(kept: torch.Tensor, start: int, real: int) -> torch.Tensor:
    """This shard's part of a replayed kept set: its columns of a mask, or its ids made
    local (-1 for the other shards' ids)."""
    if kept.dtype == torch.bool:
        return kept[:, start : start + real]
    inside = (kept >= start) & (kept < start + real)
    return torch.where(inside, kept - start, -1)


def _replayed_inside(kept: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``(M, K)`` bool: each global label is in the replayed (global) kept set."""
    if kept.dtype == torch.bool:
        safe = labels.clamp(0, max(kept.shape[1] - 1, 0))
        inside = (
            kept.gather(1, safe) if kept.shape[1] else torch.zeros_like(labels, dtype=torch.bool)
        )
        return inside & (labels >= 0) & (labels < kept.shape[1])
    return (kept.unsqueeze(1) == labels.unsqueeze(-1)).any(-1)


def _outside(
    kept_set: KeptSet, lab: _Labels | None, z_labels: torch.Tensor | None
) -> torch.Tensor | None:
    """``(M, K)`` bool: valid labels that the sampler's rule leaves out of the kept set."""
    if lab is None or z_labels is None:
        return None
    kept = kept_set.kept
    if kept is None:
        inside = z_labels >= kept_set.tau.unsqueeze(-1)
    elif kept.dtype == torch.bool:
        inside = kept.gather(1, lab.local)
    else:
        inside = (kept.unsqueeze(1) == lab.local.unsqueeze(-1)).any(-1)
    return lab.owned & ~inside


def logits_forward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: torch.Tensor | None,
    row_index: torch.Tensor | None,
    cfg: OpConfig,
    sampling: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp (M, K) or empty, entropy (M,) or empty, lse (M,), aux, outside)``.

    In the compute dtype. With a truncating sampler (``cfg.sampler``),
    ``aux`` is ``(M, 2)``: each row's threshold (the kept set is the scaled
    logits at or above it) and, with ``cfg.kept_stats``, the size of its kept
    set (else 0), and ``outside``
    ``(M, K)`` bool marks the valid labels the sampler's rule leaves out
    (they are scored as if kept); without one both are empty.
    ``sampling``: ``batch + (3,)`` per-row (top-k, top-p, min-p), float64;
    ``kept``: a replayed kept set, ``(M, V)`` bool or ``(M, K')`` int64 ids padded with -1.
    """
    cdt, dev = result_dtype(logits), logits.device
    real, group, lab, temp = _logits_setup(logits, labels, temperature, row_index, cfg, cdt)
    kernels = get_kernels(cfg.backend)
    kept_set, extra = None, {}
    if cfg.sampler:
        M = num_rows(logits, row_index, cfg.narrow)
        tau = torch.full((M,), float("-inf"), dtype=cdt, device=dev)
        count = torch.zeros(M, dtype=cdt, device=dev)
        search = True
        no_rows = row_index is not None and logits.shape[0] == 0  # every row is dead
        if group is not None and cfg.sampler != "kept" and not no_rows:
            # The thresholds are global: found over every shard first, then applied.
            assert kernels.kept_thresholds is not None
            top_k, top_p, min_p, kmax = _sampler_params(cfg, sampling, logits, row_index, None, cdt)
            tau = kernels.kept_thresholds(
                logits, row_index, cfg.narrow, temp, real, cfg.chunk_size, cdt,
                sampler=cfg.sampler, top_k=top_k, top_p=top_p, min_p=min_p, kmax=kmax,
                group=group,
            )  # fmt: skip
            search = False
        kept_set = _kept_set(
            cfg, sampling, kept, logits, row_index, lab, real, cdt, tau=tau,
            count=count if cfg.kept_stats else None, forward=search,
        )  # fmt: skip
        extra = {"restrict": kept_set}
    z_labels = None
    if row_index is not None and logits.shape[0] == 0:
        # No packed rows at all: every selected row is dead.
        M = row_index.numel()
        m = torch.full((M,), float("-inf"), dtype=cdt, device=dev)
        s = torch.zeros(M, dtype=cdt, device=dev)
        t = torch.zeros(M, dtype=cdt, device=dev) if cfg.want_entropy else None
        z = torch.zeros(labels.shape, dtype=cdt, device=dev) if labels is not None else None
        big, log_s, ent, z_all, held = combine_shards(
            m, s, t, z, lab.owned if lab is not None else None, group,
            (cfg.shard.start, logits.shape[-1]),
        )  # fmt: skip
    else:
        args = (logits, row_index, cfg.narrow)
        owned = lab.owned if lab is not None else None
        layout = (cfg.shard.start, logits.shape[-1])
        if tiles_in_tree_order(cfg.shard, group) and kernels.logits_max is not None:
            # Every shard shifts by the row's global max and adds its tiles in the
            # single-process tree: bitwise the result of one process.
            assert group is not None
            shift = global_max(
                kernels.logits_max(*args, temp, real, cfg.chunk_size, cdt), group, layout
            )
            m, s, t, z = kernels.logits_stats(
                *args, lab.local if lab is not None else None, temp, cfg.want_entropy, real,
                cfg.chunk_size, cdt, shift=shift, **extra,
            )  # fmt: skip
            sums, z_all, held = combine_tiles(
                m, [x for x in (s, t) if x is not None], z, owned, cfg.shard, group
            )
            big, log_s = m, sums[0].log()
            ent = log_s - sums[1] / sums[0] if t is not None else None
        else:
            m, s, t, z = kernels.logits_stats(
                *args, lab.local if lab is not None else None, temp, cfg.want_entropy, real,
                cfg.chunk_size, cdt, **extra,
            )  # fmt: skip
            z_labels = z
            big, log_s, ent, z_all, held = combine_shards(m, s, t, z, owned, group, layout)
    lse = big + log_s
    if lab is not None:
        assert z_all is not None
        logp = lab.finish((z_all - big.unsqueeze(-1)) - log_s.unsqueeze(-1), held)
    else:
        logp = _empty(cdt, dev)
    if ent is None:
        ent = _empty(cdt, dev)
    elif lab is not None and lab.live is not None:
        ent = torch.where(lab.live, ent, 0)
    aux, outside = _empty(cdt, dev), torch.empty(0, dtype=torch.bool, device=dev)
    if kept_set is not None:
        if group is not None and cfg.kept_stats:
            count = all_reduce(count, "sum", group)  # each shard counted its own columns
        aux = torch.stack([kept_set.tau, count], -1)
        if group is not None and lab is not None and z_all is not None:
            # The label's logit and the threshold (or the replayed set) are global: every
            # rank flags the same labels.
            valid = lab.valid if lab.valid is not None else torch.ones_like(lab.owned)
            if kept is not None:
                assert labels is not None
                found = valid & ~_replayed_inside(kept, labels)
            else:
                found = valid & (z_all < kept_set.tau.unsqueeze(-1))
            outside = found & held if held is not None else found
        else:
            single = _outside(kept_set, lab, z_labels)
            if single is not None:
                outside = single
            elif lab is not None:
                outside = torch.zeros(lab.local.shape, dtype=torch.bool, device=dev)
    return logp, ent, lse, aux, outside


def logits_backward(
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: torch.Tensor | None,
    row_index: torch.Tensor | None,
    lse: torch.Tensor,
    ent: torch.Tensor,
    cfg: OpConfig,
    sampling: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the logits (their shape and dtype) for the given upstream gradients.

    With a truncating sampler, ``aux`` is the forward's ``(M, 2)`` output
    (the thresholds are reused, not searched again).
    """
    cdt = lse.dtype
    real, group, lab, temp = _logits_setup(logits, labels, temperature, row_index, cfg, cdt)
    if lab is None:
        grad_logp = None
    if not cfg.want_entropy:
        grad_ent = None
    live = lab.live if lab is not None else None
    if grad_logp is not None and lab is not None and lab.valid is not None:
        grad_logp = torch.where(lab.valid, grad_logp, 0)  # an ignored label is a constant 0
    if grad_ent is not None and live is not None:
        grad_ent = torch.where(live, grad_ent, 0)
    if grad_logp is None and grad_ent is None:
        return torch.zeros_like(logits)
    alpha, beta, w = grad_coefficients(
        grad_logp, grad_ent, ent if grad_ent is not None else None, _inv(temp)
    )
    owned = lab.owned if lab is not None else None
    if w is not None and owned is not None:
        # The one-hot part of ∂logp/∂z lives on the owner's columns only.
        w = torch.where(owned, w, 0)
    logp_only = beta is None and lab is not None and lab.local.shape[-1] == 1
    label_sign = None
    if logp_only and owned is not None:
        label_sign = -owned.to(cdt)
    if row_index is not None and logits.shape[0] == 0:
        return torch.zeros_like(logits)
    kernels = get_kernels(cfg.backend)
    extra = {}
    if cfg.sampler:
        assert aux is not None
        extra["restrict"] = _kept_set(
            cfg, sampling, kept, logits, row_index, lab, real, cdt,
            tau=aux[:, 0].contiguous(), count=None, forward=False,
        )  # fmt: skip
    return kernels.logits_grad(  # type: ignore[no-any-return]
        logits,
        row_index,
        cfg.narrow,
        lse=lse,
        alpha=alpha,
        beta=beta,
        w=w,
        labels=lab.local if lab is not None else None,
        temperature=temp,
        dead=~live if live is not None else None,
        logp_only=logp_only,
        label_sign=label_sign,
        real=real,
        chunk=cfg.chunk_size,
        **extra,
    )


# ------------------------------------------------------------------ KL


def kl_forward(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    cfg: OpConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(KL (N,), lse_z (N,), lse_r (N,))`` in the compute dtype."""
    cdt = result_dtype(logits, ref_logits)
    real = cfg.shard.real_columns(logits.shape[-1])
    temp = _row_temperature(temperature, cfg.temperature, tuple(logits.shape[:-1]), cdt)
    kernels = get_kernels(cfg.backend)
    group = _group(cfg)
    layout = (cfg.shard.start, logits.shape[-1])
    if tiles_in_tree_order(cfg.shard, group) and kernels.logits_max is not None:
        assert group is not None
        return _kl_in_tree_order(logits, ref_logits, temp, real, cdt, cfg, group, layout)
    kl, lse_z, lse_r = kernels.kl_stats(logits, ref_logits, temp, real, cfg.chunk_size, cdt)  # type: ignore[misc]
    return combine_kl(kl, lse_z, lse_r, group, layout)


def _kl_in_tree_order(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temp: Temp,
    real: int,
    cdt: torch.dtype,
    cfg: OpConfig,
    group: ProcessGroup,
    layout: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KL over shards on the tile grid: bitwise one process's (three collectives).

    The global maxima, then every shard's tiles of both sum-exps added in the
    single-process tree, then the tiles of ``Σ e^{z - max z}·(ls^z - ls^r)``
    the same way; the operations per entry are those of one process.
    """
    kernels = get_kernels(cfg.backend)
    assert kernels.logits_max is not None
    chunk = cfg.chunk_size
    maxima = torch.stack(
        [kernels.logits_max(x, None, None, temp, real, chunk, cdt) for x in (logits, ref_logits)],
        -1,
    )
    big = global_max(maxima, group, layout)
    shift = (big[:, 0], big[:, 1])
    tiles = kernels.kl_stats(logits, ref_logits, temp, real, chunk, cdt, shift=shift)
    (sz, sr), _, _ = combine_tiles(big[:, 0], list(tiles), None, None, cfg.shard, group)
    log_sums = (sz.log(), sr.log())
    (wd,) = kernels.kl_stats(
        logits, ref_logits, temp, real, chunk, cdt, shift=shift, log_sums=log_sums
    )
    (a,), _, _ = combine_tiles(big[:, 0], [wd], None, None, cfg.shard, group)
    return finish_kl(a.div(sz), shift[0], log_sums[0], shift[1], log_sums[1])


def kl_backward(
    grad_kl: torch.Tensor,
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: torch.Tensor | None,
    lse_z: torch.Tensor,
    lse_r: torch.Tensor,
    kl: torch.Tensor,
    need_z: bool,
    need_r: bool,
    cfg: OpConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of both logits (an empty tensor for one not needed)."""
    cdt = kl.dtype
    real = cfg.shard.real_columns(logits.shape[-1])
    temp = _row_temperature(temperature, cfg.temperature, tuple(logits.shape[:-1]), cdt)
    inv = _inv(temp)
    g = grad_kl if inv is None else grad_kl * inv
    kernels = get_kernels(cfg.backend)
    gz, gr = kernels.kl_grad(  # type: ignore[misc]
        logits,
        ref_logits,
        lse_z=lse_z,
        lse_r=lse_r,
        kl=kl,
        grad=g,
        temperature=temp,
        need_z=need_z,
        need_r=need_r,
        real=real,
        chunk=cfg.chunk_size,
    )
    return (
        gz if gz is not None else _empty(logits.dtype, logits.device),
        gr if gr is not None else _empty(ref_logits.dtype, ref_logits.device),
    )


# ------------------------------------------------------------------ fused head


def _head_setup(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor | None,
    cfg: OpConfig,
) -> tuple[torch.dtype, int, ProcessGroup | None, _Labels, Temp, tuple[int, int]]:
    cdt = result_dtype(hidden, weight)
    real = cfg.shard.real_columns(weight.shape[0])
    group = _group(cfg)
    lab = _Labels(labels, cfg, real, group is None)
    batch = tuple(hidden.shape[:-1])
    temp = _row_temperature(temperature, cfg.temperature, batch, cdt, live=lab.live)
    tile_rule = get_kernels(cfg.backend).head_tiles or auto_tile_sizes
    tiles = tile_rule(
        math.prod(batch),
        real,
        chunk_size=cfg.chunk_size,
        vocab_chunk_size=cfg.vocab_chunk_size,
        device=hidden.device,
    )
    return cdt, real, group, lab, temp, tiles


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as ``(N, H)``: its leading dims flattened (also for ``H = 0``)."""
    return hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])


def head_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: torch.Tensor | None,
    cfg: OpConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp (N, K), entropy (N,) or empty, lse (N,))`` of the head's logits."""
    cdt, real, group, lab, temp, (rows, tile) = _head_setup(
        hidden, weight, labels, temperature, cfg
    )
    h2 = _rows(hidden)
    kernels = get_kernels(cfg.backend)
    args = (h2, weight, bias, lab.local, lab.owned, lab.live, temp, cfg.want_entropy)
    kw = dict(
        real=real, rows=rows, tile=tile, dtype=cdt, scale=cfg.logit_scale,
        softcap=cfg.softcap or None,
    )  # fmt: skip
    layout = (cfg.shard.start, weight.shape[0])
    if tiles_in_tree_order(cfg.shard, group) and kernels.head_tile_nodes is not None:
        # Each shard's nodes of the fixed tree of per-tile statistics, finished on
        # every rank: bitwise the statistics of one process.
        assert group is not None
        # The nodes' all-gather has a size that follows from the layout: check it first.
        ok = check_layout(h2, group, layout)
        first = torch.distributed.get_rank(group) * cfg.shard.stride // TILE
        nodes, z = kernels.head_tile_nodes(
            *args, **kw, first=first, total=tile_count(cfg.shard.total)
        )
        width = 3 if cfg.want_entropy else 2
        root, z_all, held = combine_nodes(
            nodes, width, h2.new_empty(h2.shape[0], dtype=cdt), z, lab.owned, cfg.shard,
            group, STATS_TREE, ok,
        )  # fmt: skip
        big, log_s = root[:, 0], root[:, 1].log()
        ent = log_s - root[:, 2] / root[:, 1] if cfg.want_entropy else None
    else:
        m, s, t, z = kernels.head_stats(*args, **kw)
        big, log_s, ent, z_all, held = combine_shards(m, s, t, z, lab.owned, group, layout)
    assert z_all is not None
    logp = lab.finish((z_all - big.unsqueeze(-1)) - log_s.unsqueeze(-1), held)
    if ent is None:
        ent = _empty(cdt, hidden.device)
    elif lab.live is not None:
        ent = torch.where(lab.live, ent, 0)
    return logp, ent, big + log_s


def head_backward(
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: torch.Tensor | None,
    lse: torch.Tensor,
    ent: torch.Tensor,
    need: tuple[bool, bool, bool],
    cfg: OpConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_hidden, grad_weight, grad_bias)``; an empty tensor for each one not needed."""
    cdt, real, group, lab, temp, (rows, tile) = _head_setup(
        hidden, weight, labels, temperature, cfg
    )
    dev = hidden.device
    if not cfg.want_entropy:
        grad_ent = None
    if grad_logp is not None and lab.valid is not None:
        grad_logp = torch.where(lab.valid, grad_logp, 0)
    if grad_ent is not None and lab.live is not None:
        grad_ent = torch.where(lab.live, grad_ent, 0)
    if grad_logp is None and grad_ent is None:
        grad_logp = torch.zeros(lab.local.shape, dtype=cdt, device=dev)
    alpha, beta, w = grad_coefficients(
        grad_logp, grad_ent, ent if grad_ent is not None else None, _inv(temp)
    )
    if w is not None:
        w = torch.where(lab.owned, w, 0)
    reduce = group is not None and cfg.reduce_grad_hidden
    kernels = get_kernels(cfg.backend)
    gh, gw, gb = kernels.head_grad(  # type: ignore[misc]
        _rows(hidden),
        weight,
        bias,
        lab.local,
        lab.owned,
        lab.live,
        lse=lse,
        alpha=alpha,
        beta=beta,
        w=w,
        temperature=temp,
        need=need,
        grad_hidden_in_compute_dtype=reduce,
        real=real,
        rows=rows,
        tile=tile,
        scale=cfg.logit_scale,
        softcap=cfg.softcap or None,
    )
    if gh is not None:
        if reduce:
            # Σ over shards of g_k @ W_k, summed before rounding; every rank gets the same.
            torch.distributed.all_reduce(gh, group=group)
        gh = gh.to(hidden.dtype).view(hidden.shape)
    return (
        gh if gh is not None else _empty(hidden.dtype, dev),
        gw if gw is not None else _empty(hidden.dtype, dev),
        gb if gb is not None else _empty(hidden.dtype, dev),
    )


# ------------------------------------------------------------------ Σ π²


def pi_squared(
    logits: torch.Tensor, temperature: torch.Tensor | None, cfg: OpConfig
) -> torch.Tensor:
    """``Σ_v π_v²`` per row ``(N,)`` in the compute dtype (no gradient)."""
    cdt = result_dtype(logits)
    real = cfg.shard.real_columns(logits.shape[-1])
    temp = _row_temperature(temperature, cfg.temperature, tuple(logits.shape[:-1]), cdt)
    kernels = get_kernels(cfg.backend)
    group = _group(cfg)
    layout = (cfg.shard.start, logits.shape[-1])
    if tiles_in_tree_order(cfg.shard, group) and kernels.logits_max is not None:
        # As for the log-probs: the global max first, then the tiles in the fixed tree.
        assert group is not None
        shift = global_max(
            kernels.logits_max(logits, None, None, temp, real, cfg.chunk_size, cdt), group, layout
        )
        m, s, u = kernels.pi_squared_stats(logits, temp, real, cfg.chunk_size, cdt, shift=shift)
        (s_all, u_all), _, _ = combine_tiles(m, [s, u], None, None, cfg.shard, group)
        return u_all / s_all.square()
    m, s, u = kernels.pi_squared_stats(logits, temp, real, cfg.chunk_size, cdt)  # type: ignore[misc]
    return combine_pi_squared(m, s, u, group, layout)
