"""The forward pass of the exact KL between two sets of logits, chunk by chunk.

``KL = Σ_j p_j·(ls^z_j - ls^r_j)`` per row, a weighted sum of per-entry
differences (not ``Σ p·z - lse_z - (Σ p·r - lse_r)``) so that the small KL of
two close distributions is not lost to cancellation. For a vocabulary shard
the normalization is local: the engine combines the shards by the chain rule
of the KL (:func:`rlmath.engine.stats.combine_kl`).
"""

from __future__ import annotations

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, Workspace
from rlmath.engine.torch_backend.reductions import row_nansum, row_sum, scaled_max, scaled_shift
from rlmath.engine.torch_backend.rows import RowBlocks, chunk_ranges, real_columns

__all__ = ["chunk_kl", "finish_kl", "kl_stats"]

NEG_INF = float("-inf")


def chunk_kl(
    src_z: torch.Tensor,
    src_r: torch.Tensor,
    ws: Workspace,
    temperature: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw per-row KL statistics of one ``(c, V)`` chunk: ``(kl, m_z, log s_z, m_r, log s_r)``.

    Each row is shifted by its max (by 0 where the max is ``-inf``: a row with
    no mass). :func:`finish_kl` turns them into ``(KL, lse_z, lse_r)``.

    Args:
        src_z, src_r: ``(c, V)`` raw policy and reference logits, any floating
            dtypes and strides.
        ws: scratch buffers (uses ``"y"``, ``"e"`` and ``"yr"``).
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
    """
    c = src_z.shape[0]
    e = ws.get("e", c)
    mz = scaled_max(src_z, temperature, ws.dtype)
    mr = scaled_max(src_r, temperature, ws.dtype)
    yr = scaled_shift(src_r, temperature, torch.where(mr == NEG_INF, 0, mr), ws.get("yr", c))
    log_sr = row_sum(torch.exp(yr, out=e)).log()
    yz = scaled_shift(src_z, temperature, torch.where(mz == NEG_INF, 0, mz), ws.get("y", c))
    sz = row_sum(torch.exp(yz, out=e))
    log_sz = sz.log()
    # d = ls_z - ls_r; NaN where both logits are -inf (then p = 0: skipped by nansum).
    d = yz.sub_(yr).sub_((log_sz - log_sr).unsqueeze(-1))
    kl = row_nansum(e.mul_(d)).div_(sz)
    return kl, mz.squeeze(-1), log_sz, mr.squeeze(-1), log_sr


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


def kl_stats(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunk_kl` of every row (only the first ``real`` columns), ``(N,)`` each."""
    dev = logits.device
    lay_z = RowBlocks(real_columns(logits, real))
    lay_r = RowBlocks(real_columns(ref_logits, real))
    N = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    stats = [torch.zeros(N, dtype=dtype, device=dev) for _ in range(5)]
    if N == 0 or real == 0:
        stats[1].fill_(NEG_INF)
        stats[3].fill_(NEG_INF)
        return finish_kl(*stats)
    chunk = chunk or auto_chunk_size(real, N, device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)
    ranges = list(chunk_ranges(N, chunk, lay_z, lay_r))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        for out, x in zip(stats, chunk_kl(lay_z.get(a, b), lay_r.get(a, b), ws, temp.rows(a, b))):
            out[a:b] = x

    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, N), real, dtype, dev), dev)
    return finish_kl(*stats)
