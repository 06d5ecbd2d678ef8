"""Helpers shared by every blocked vocabulary reduction (logits, fused head, vocab parallel).

* :class:`TemperatureColumn`: the temperature as the ``(rows, 1)`` / ``(1, 1)``
  compute-dtype column the chunk kernels of :mod:`rlmath.logprobs._kernels` take.
* :class:`TileWorkspace`: scratch buffers whose width follows the current
  vocabulary tile (the last tile of a vocabulary or of a shard is narrower).
* :func:`merge_tile_stats`: the exact per-row merge of the ``(m, s, t)``
  statistics of two disjoint column sets (vocabulary tiles, or shards).
"""

from __future__ import annotations

import torch

from rlmath.logprobs._kernels import Workspace

__all__ = ["TemperatureColumn", "TileWorkspace", "merge_tile_stats"]


class TemperatureColumn:
    """A temperature as the column the chunk kernels take.

    ``value`` is ``None`` (exactly 1), a float, or a flat ``(N,)`` tensor in the
    compute dtype (from :func:`rlmath.logprobs._inputs.normalize_temperature`).
    ``col`` is ``None``, a ``(1, 1)`` or an ``(N, 1)`` tensor; ``inv`` is ``1/T``
    (``None``, a float or an ``(N,)`` tensor) for the gradient coefficients.
    """

    def __init__(
        self, value: torch.Tensor | float | None, dtype: torch.dtype, device: torch.device
    ):
        self.col: torch.Tensor | None = None
        self.inv: torch.Tensor | float | None = None
        self.per_row = isinstance(value, torch.Tensor)
        if isinstance(value, torch.Tensor):
            self.col, self.inv = value.unsqueeze(-1), value.reciprocal()
        elif value is not None:
            self.col = torch.full((1, 1), value, dtype=dtype, device=device)
            self.inv = 1.0 / value

    def rows(self, start: int, end: int) -> torch.Tensor | None:
        """The column for rows ``[start, end)`` (the whole ``(1, 1)`` column for a scalar)."""
        if self.col is None or not self.per_row:
            return self.col
        return self.col[start:end]

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x / T`` for an ``(N, K)`` tensor of raw logits (already in the compute dtype)."""
        return x if self.col is None else x / self.col


class TileWorkspace(Workspace):
    """A :class:`~rlmath.logprobs._kernels.Workspace` whose buffers take the shape of the current tile.

    The shared kernels ask for ``ws.get(name, c)`` and expect a ``(c, V)``
    buffer matching their ``(c, V)`` input; here the input is one vocabulary
    tile, whose width changes for the last tile. Each named buffer is one flat
    allocation of ``rows × vocab`` entries, viewed as a contiguous
    ``(c, width)`` matrix for the tile set in :attr:`width`. :meth:`scratch`
    holds buffers of other shapes (the fp32 copy of a weight tile, the fp32
    ``grad_hidden`` of a chunk) the same way.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        super().__init__(rows, vocab, dtype, device)
        self.width = vocab
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._flat.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._flat[(name, dtype)] = buf
        return buf

    def get(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        buf = self._buffer(name, self.rows * self.vocab, dt)
        return buf[: c * self.width].view(c, self.width)

    def scratch(self, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous buffer of ``shape``, reused by later calls with the same name."""
        buf = self._buffer(name, shape[0] * shape[1], dtype)
        return buf[: shape[0] * shape[1]].view(shape)


def merge_tile_stats(
    old: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row ``(m, s, t)`` of two disjoint parts of the vocabulary merged into one.

    Each part is as returned by :func:`rlmath.logprobs._kernels.chunk_stats`
    (``s`` and ``t`` relative to that part's own max ``m``); start from
    ``(-inf, 0, 0)`` and fold in the vocabulary tiles (or shards) one by one,
    which keeps the state at three numbers per row. With ``M = max(m_a, m_b)``
    and ``d = m - M``: ``S = Σ e^d·s`` and ``T = Σ e^d·(t + d·s)``. A part whose
    logits are all ``-inf`` for a row (``m = -inf``, NaN or 0 ``s``)
    contributes nothing; a NaN logit makes ``M``, and so the row's outputs, NaN.

    Args:
        old, new: ``(m, s, t)``, each ``(c,)`` (``t`` ``None`` when the entropy
            is not needed).

    Returns:
        The merged ``(m, s, t)``.
    """
    big = torch.maximum(old[0], new[0])
    s_out = torch.zeros_like(big)
    t_out = torch.zeros_like(big) if old[2] is not None and new[2] is not None else None
    for m, s, t in (old, new):
        empty = m == float("-inf")
        d = torch.where(empty, 0.0, m - big)
        e = torch.where(empty, 0.0, d.exp())
        s = torch.where(empty, 0.0, s)
        s_out += e * s
        if t_out is not None and t is not None:
            t_out += e * (torch.where(empty, 0.0, t) + d * s)
    return big, s_out, t_out
