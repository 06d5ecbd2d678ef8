"""Scratch buffers and the temperature column of the pure-torch kernels."""

from __future__ import annotations

import torch

__all__ = ["Temperature", "TemperatureColumn", "TileWorkspace", "Workspace"]

Temperature = torch.Tensor | float | None
"""A temperature as the kernels receive it: ``None`` (exactly 1), a float, or a
flat ``(M,)`` tensor in the compute dtype, one value per processed row."""


class Workspace:
    """Scratch buffers of ``rows × V``, allocated once per call and reused by every chunk.

    ``get(name, c)`` returns the first ``c`` rows of the buffer called ``name``
    (created in the compute dtype on first use).
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.vocab, self.dtype, self.device = rows, vocab, dtype, device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        buf = self._buffers.get((name, dt))
        if buf is None:
            buf = torch.empty(self.rows, self.vocab, dtype=dt, device=self.device)
            self._buffers[(name, dt)] = buf
        return buf[:c]


class TileWorkspace(Workspace):
    """A :class:`Workspace` whose buffers take the shape of the current vocabulary tile.

    The chunk kernels ask for ``ws.get(name, c)`` and expect a ``(c, V)``
    buffer matching their ``(c, V)`` input; for the fused head the input is one
    vocabulary tile, whose width changes for the last tile. Each named buffer
    is one flat allocation of ``rows × vocab`` entries, viewed as a contiguous
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


class TemperatureColumn:
    """A temperature as the column the chunk kernels take.

    ``col`` is ``None`` (exactly 1), a ``(1, 1)`` or an ``(M, 1)`` tensor in the
    compute dtype; ``inv`` is ``1/T`` (``None``, a float or an ``(M,)`` tensor)
    for the gradient coefficients.
    """

    def __init__(self, value: Temperature, dtype: torch.dtype, device: torch.device):
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
