"""``Σ_v π_v²`` statistics of logits, chunk by chunk (no gradient)."""

from __future__ import annotations

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, Workspace
from rlmath.engine.torch_backend.reductions import row_sum, scaled_max, scaled_shift
from rlmath.engine.torch_backend.rows import RowBlocks, chunk_ranges, real_columns

__all__ = ["pi_squared_stats"]


def pi_squared_stats(
    logits: torch.Tensor, temperature: Temperature, real: int, chunk: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, s, u)`` per row: ``m = max z``, ``s = Σ e^{z-m}``, ``u = Σ e^{2(z-m)}``.

    ``Σ π² = u / s²``; a row without a finite logit gives ``m = -inf, s = u = 0``.
    """
    dev = logits.device
    N = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    m = torch.full((N,), float("-inf"), dtype=dtype, device=dev)
    s = torch.zeros(N, dtype=dtype, device=dev)
    u = torch.zeros(N, dtype=dtype, device=dev)
    if N == 0 or real == 0:
        return m, s, u
    chunk = chunk or auto_chunk_size(real, N, device=dev)
    lay = RowBlocks(real_columns(logits, real))
    temp = TemperatureColumn(temperature, dtype, dev)
    ranges = list(chunk_ranges(N, chunk, lay))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        src, t = lay.get(a, b), temp.rows(a, b)
        cm = scaled_max(src, t, dtype)
        e = scaled_shift(src, t, torch.where(cm == float("-inf"), 0, cm), ws.get("y", b - a))
        e.exp_()
        m[a:b], s[a:b] = cm.squeeze(-1), row_sum(e)
        u[a:b] = row_sum(e.mul_(e))

    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, N), real, dtype, dev), dev)
    return m, s, u
