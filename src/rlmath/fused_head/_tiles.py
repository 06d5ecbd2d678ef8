"""Blocks of the logits: scratch buffers, row/vocabulary ranges and the merge of tile statistics."""

from __future__ import annotations

import torch

from rlmath.logprobs._kernels import Workspace

__all__ = ["TileWorkspace", "merge_tile_stats", "spans"]


def spans(total: int, step: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(total)`` in the fewest pieces of at most ``step``.

    The pieces differ in length by at most one (151936 by 4096 gives 38 pieces
    of 3998 or 3999, not 37 of 4096 and a last one of 384, which would cost as
    many passes as a full one for a tenth of the work).
    """
    if total <= 0:
        return []
    count = -(-total // step)
    size, extra = divmod(total, count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + size + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class TileWorkspace(Workspace):
    """A :class:`Workspace` whose buffers take the shape of the current tile.

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
    ``(-inf, 0, 0)`` and fold in the vocabulary tiles one by one, which keeps
    the state at three numbers per row. With ``M = max(m_a, m_b)`` and
    ``d = m - M``: ``S = Σ e^d·s`` and ``T = Σ e^d·(t + d·s)``. A part whose
    logits are all ``-inf`` for a row (``m = -inf``, NaN ``s``) contributes
    nothing; a NaN logit makes ``M``, and so the row's outputs, NaN.

    Args:
        old, new: ``(m, s, t)``, each ``(c,)`` (``t`` ``None`` when the entropy
            is not needed).

    Returns:
        The merged ``(m, s, t)``.
    """
    big = torch.maximum(old[0], new[0])
    s_out = torch.zeros_like(big)
    t_out = torch.zeros_like(big) if old[2] is not None else None
    for m, s, t in (old, new):
        empty = m == float("-inf")
        d = torch.where(empty, 0.0, m - big)
        e = torch.where(empty, 0.0, d.exp())
        s = torch.where(empty, 0.0, s)
        s_out += e * s
        if t_out is not None and t is not None:
            t_out += e * (torch.where(empty, 0.0, t) + d * s)
    return big, s_out, t_out
