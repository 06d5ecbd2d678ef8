"""Which rows of the logits a pass reads, as 2-D views without copies."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

import torch

from rlmath.engine.torch_backend.buffers import Workspace

__all__ = ["RowBlocks", "RowSource", "chunk_ranges", "real_columns"]


def real_columns(x: torch.Tensor, real: int) -> torch.Tensor:
    """The first ``real`` columns of ``x`` (a view)."""
    return x if real == x.shape[-1] else x.narrow(-1, 0, real)


class RowBlocks:
    """The rows of a ``(..., V)`` tensor as 2-D views, without copying.

    A tensor whose leading dims cannot be merged into one (say
    ``logits[:, -R - 1 : -1]`` of a ``(B, S, V)`` tensor) is split into the
    fewest 2-D views that can; ``get(start, end)`` returns flat rows
    ``[start, end)`` as a view, provided they lie in one block (see
    :func:`chunk_ranges`).
    """

    def __init__(self, x: torch.Tensor):
        self.blocks = _blocks(x) if x.numel() else []
        self.starts: list[int] = []
        n = 0
        for b in self.blocks:
            self.starts.append(n)
            n += b.shape[0]
        self.num_rows = n

    def get(self, start: int, end: int) -> torch.Tensor:
        if len(self.blocks) == 1:
            return self.blocks[0][start:end]
        i = bisect.bisect_right(self.starts, start) - 1
        off = self.starts[i]
        return self.blocks[i][start - off : end - off]


def _blocks(x: torch.Tensor) -> list[torch.Tensor]:
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:
        return [b for i in range(x.shape[0]) for b in _blocks(x[i])]


def chunk_ranges(num_rows: int, chunk: int, *layouts: RowBlocks) -> Iterator[tuple[int, int]]:
    """``(start, end)`` row ranges of at most ``chunk`` rows, never crossing a block boundary."""
    cuts = sorted({0, num_rows, *(s for lay in layouts for s in lay.starts)})
    for lo, hi in itertools.pairwise(cuts):
        for start in range(lo, hi, chunk):
            yield start, min(start + chunk, hi)


class RowSource:
    """Where a pass's rows come from (only the ``real`` columns), and where their gradient goes.

    Rows are every row of ``logits`` in order, the rows of
    ``logits.narrow(dim, start, length)`` (``narrow``; a batch dim), or the
    rows ``index`` of 2-D ``logits``.
    """

    def __init__(
        self,
        logits: torch.Tensor,
        real: int,
        index: torch.Tensor | None = None,
        narrow: tuple[int, int, int] | None = None,
    ):
        self.logits, self.real, self.index, self.narrow = logits, real, index, narrow
        view = logits.narrow(*narrow) if narrow is not None else logits
        self.layout = RowBlocks(real_columns(view, real)) if index is None else None
        self.num_rows = index.numel() if index is not None else self.layout.num_rows  # type: ignore[union-attr]

    def ranges(self, chunk: int, *others: RowBlocks) -> Iterator[tuple[int, int]]:
        layouts = (self.layout, *others) if self.layout is not None else others
        return chunk_ranges(self.num_rows, chunk, *layouts)

    def rows(self, start: int, end: int, ws: Workspace) -> torch.Tensor:
        """Rows ``[start, end)`` as a ``(c, real)`` tensor (a view, or a gather into scratch)."""
        if self.index is None:
            return self.layout.get(start, end)  # type: ignore[union-attr]
        buf = ws.get("src", end - start, dtype=self.logits.dtype)
        rows = real_columns(self.logits, self.real)
        return torch.index_select(rows, 0, self.index[start:end], out=buf)

    def empty_grad(self) -> tuple[torch.Tensor, RowBlocks | None]:
        """The gradient of the whole logits, and the layout of its part that the rows map to.

        Rows and columns that are not used get zeros; the used part is left
        uninitialized (every chunk writes its rows), except with an index, which
        accumulates into zeros (the layout is then ``None``).
        """
        x = self.logits
        if self.index is not None:
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device), None
        grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if self.real < x.shape[-1]:
            grad.narrow(-1, self.real, x.shape[-1] - self.real).zero_()
        target = grad
        if self.narrow is not None:
            dim, start, length = self.narrow
            grad.narrow(dim, 0, start).zero_()
            grad.narrow(dim, start + length, x.shape[dim] - start - length).zero_()
            target = grad.narrow(dim, start, length)
        return grad, RowBlocks(real_columns(target, self.real))
