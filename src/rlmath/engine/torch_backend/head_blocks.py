"""Blocks of the fused LM head's logits: ``hidden_rows @ weight_tile.T (+ bias_tile)``.

Shared by the head's forward and backward passes, which are written per
block: :meth:`HeadBlocks.run` calls them for every block of the grid of row
spans × vocabulary tiles (:func:`rlmath.engine.execution.run_blocks`). On a
CPU the rows are cut finely (:func:`rlmath.engine.policy.matmul_piece`), and
each block's matmuls are followed by its elementwise passes in L2-sized
slices (:func:`rlmath.engine.policy.elementwise_rows`). On an accelerator a
block is a whole chunk × tile, run in order (every op is a kernel launch).
Whoever runs a block owns its block buffers (:class:`BlockScratch`);
where a CPU's fp32 matmuls run in oneDNN
(:mod:`~rlmath.engine.torch_backend.cpu_matmul`), which writes its results
to new tensors, a block's logits are a new tensor instead of a buffer.
The grid never depends on the thread count, and every sum over blocks is
added in the same order, so neither do the results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlmath import _device
from rlmath.engine.execution import run_blocks
from rlmath.engine.policy import (
    elementwise_rows,
    is_cpu,
    matmul_piece,
    spans,
    tile_spans,
)
from rlmath.engine.torch_backend import cpu_matmul
from rlmath.engine.torch_backend.buffers import TileWorkspace

__all__ = ["BlockScratch", "HeadBlocks"]


class BlockScratch:
    """One worker's buffers: a block's (``ws``) and an elementwise slice's (``small``).

    ``ws`` holds the logits block and the other block-sized buffers; its
    :meth:`~rlmath.engine.torch_backend.buffers.TileWorkspace.scratch` holds
    the fp32 copies of a weight tile (kept while the worker stays in one
    tile: :attr:`weight_tile`) and of a block's hidden rows.
    """

    def __init__(self, rows: int, width: int, sub: int, dtype: torch.dtype, device: torch.device):
        self.ws = TileWorkspace(rows, width, dtype, device)
        self.small = TileWorkspace(sub, width, dtype, device)
        self.weight_tile: int | None = None  # the tile whose fp32 copy ws.scratch("w32") holds
        self.hidden_span: tuple[int, int] | None = None  # the rows ws.scratch("h_live") holds

    def release(self) -> None:
        """Hand the buffers to this thread's next pass."""
        self.ws.release()
        self.small.release()
        self.weight_tile = self.hidden_span = None

    def begin_tile(self, v0: int, v1: int) -> None:
        """Shape the buffers for the tile ``[v0, v1)``."""
        self.ws.width = self.small.width = v1 - v0


class HeadBlocks:
    """Computes blocks of logits and locates each row's labels in the vocabulary tiles.

    Args:
        hidden: ``(N, H)`` hidden states.
        weight: ``(V, H)`` the (local) head weight; only its first ``real`` rows are used.
        bias: ``(V,)`` or ``None``.
        labels: ``(N, K)`` int64 local column indices (any valid index where not owned).
        owned: ``(N, K)`` bool, the labels whose column lies in this weight.
        live: ``(N,)`` bool, ``False`` for rows whose labels are all ignored (their
            hidden state is replaced by zeros, so NaN or inf there cannot reach
            anything), or ``None`` when every row is live.
        rows, tile: rows per chunk and vocabulary entries per tile.
        real: weight rows that are real tokens.
        dtype: the compute dtype.
        scale, softcap: the logit transform ``softcap·tanh(scale·z / softcap)``
            (``softcap=None``: ``scale·z``; :meth:`transformed`).
    """

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        owned: torch.Tensor,
        live: torch.Tensor | None,
        rows: int,
        tile: int,
        real: int,
        dtype: torch.dtype,
        scale: float = 1.0,
        softcap: float | None = None,
    ):
        if live is not None and _device.reads_host(hidden.device) and bool(live.all()):
            live = None  # nothing to replace: skip the copies of the hidden rows
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.labels, self.owned, self.live = labels, owned, live
        self.row_spans = spans(hidden.shape[0], rows)
        self.tile_spans = tile_spans(real, tile, hidden.device)  # on the 128-column grid
        widest = max((b - a for a, b in self.tile_spans), default=1)
        c_max, w_max = min(rows, max(1, hidden.shape[0])), max(1, widest)
        self.row_major = not is_cpu(hidden.device)
        if self.row_major:
            # An accelerator: a block is a chunk × tile, the blocks run in order.
            self.block_rows = self.row_spans
            unit = c_max
        else:
            # A CPU: each chunk cut into pieces of rows, every piece × tile one block.
            piece = matmul_piece(c_max, hidden.device)
            self.block_rows = [
                (r0 + a, r0 + b) for r0, r1 in self.row_spans for a, b in spans(r1 - r0, piece)
            ]
            unit = min(piece, c_max)
        self.dtype = dtype
        self._unit, self._w_max = unit, w_max
        self.sub = elementwise_rows(unit, w_max, hidden.device)
        # On a CPU the blocks of a row do not run one after another: the dead
        # rows of hidden are replaced once for the whole pass.
        self._hidden_live = None
        if live is not None and not self.row_major:
            self._hidden_live = torch.where(live[:, None], hidden, 0.0)
        self.scale, self.softcap = scale, softcap
        self.transform = scale != 1.0 or softcap is not None
        # Where the matmuls run, decided once per pass: the logits in the
        # inputs' dtype, the gradients in the compute dtype (cpu_matmul).
        self.onednn_logits = cpu_matmul.uses_onednn(hidden.dtype, hidden.device)
        self.onednn = cpu_matmul.uses_onednn(dtype, hidden.device)

    def scratch(self) -> BlockScratch:
        """A new worker's buffers (see :class:`BlockScratch`)."""
        return BlockScratch(self._unit, self._w_max, self.sub, self.dtype, self.hidden.device)

    def run(
        self,
        work: Callable[[int, int, BlockScratch], None],
        *,
        along_rows: bool,
        along_columns: bool,
        band: tuple[int, int] | None = None,
    ) -> None:
        """``work(i, j, scratch)`` for block rows ``block_rows[i]`` × tile ``tile_spans[j]``.

        Every block, or with ``band = (i0, i1)`` the blocks of block rows
        ``i0 <= i < i1``. ``along_rows``: the blocks of a row run in tile order
        (they add into that row's outputs); ``along_columns``: the blocks of a
        tile run in row order. On an accelerator every block runs in order, row
        by row, with one scratch, so per-row buffers can be reused.
        """
        i0, i1 = band if band is not None else (0, len(self.block_rows))
        run_blocks(
            i1 - i0,
            len(self.tile_spans),
            work if i0 == 0 else lambda i, j, scratch: work(i0 + i, j, scratch),
            self.scratch,
            self.hidden.device,
            along_rows=along_rows,
            along_columns=along_columns,
        )

    def hidden_rows(self, r0: int, r1: int, scratch: BlockScratch) -> torch.Tensor:
        """``hidden[r0:r1]``, with the rows of dead (all-ignored) positions replaced by zeros."""
        if self.live is None:
            return self.hidden[r0:r1]
        if self._hidden_live is not None:
            return self._hidden_live[r0:r1]
        out = scratch.ws.scratch("h_live", (r1 - r0, self.hidden.shape[1]), self.hidden.dtype)
        if scratch.hidden_span != (r0, r1):
            out.copy_(self.hidden[r0:r1]).masked_fill_(~self.live[r0:r1, None], 0.0)
            scratch.hidden_span = (r0, r1)
        return out

    def logits(self, scratch: BlockScratch, h: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """``h @ weight[v0:v1].T + bias[v0:v1]``, a block buffer of its own.

        In the inputs' dtype; ``h`` is the block's hidden rows. With torch's
        BLAS it is the ``"z"`` buffer of ``scratch``; where the matmul runs in
        oneDNN (:mod:`~rlmath.engine.torch_backend.cpu_matmul`) a new tensor.
        """
        bias = self.bias[v0:v1] if self.bias is not None else None
        w = self.weight[v0:v1].T
        if self.onednn_logits:
            return cpu_matmul.mm(h, w, bias=bias, onednn=True)
        out = scratch.ws.get("z", h.shape[0], dtype=h.dtype)
        return cpu_matmul.mm(h, w, out=out, bias=bias, onednn=False)

    def transformed(self, scratch: BlockScratch, z: torch.Tensor) -> torch.Tensor:
        """The logits the softmax sees: ``softcap·tanh(scale·z / softcap)`` in the compute dtype.

        ``z`` itself when there is no transform (the passes upcast it element by
        element); otherwise a compute-dtype block buffer of ``scratch`` (``"zt"``).
        """
        if not self.transform:
            return z
        out = torch.mul(z, self.scale, out=scratch.ws.get("zt", z.shape[0]))
        if self.softcap is not None:
            out.div_(self.softcap).tanh_().mul_(self.softcap)
        return out

    def chain_rule(self, g: torch.Tensor, zt: torch.Tensor) -> torch.Tensor:
        """``g`` (the gradient w.r.t. :meth:`transformed` logits ``zt``) times their derivative.

        ``d zt / d z = scale·(1 - (zt / softcap)²)``; ``zt`` is overwritten.
        """
        if self.softcap is None:
            return g.mul_(self.scale)
        factor = zt.div_(self.softcap).square_().mul_(-self.scale).add_(self.scale)
        return g.mul_(factor)

    def slices(self, c: int) -> list[tuple[int, int]]:
        """Row slices of a ``c``-row block for the elementwise passes."""
        return spans(c, self.sub)

    def tile_labels(self, r0: int, r1: int, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index (c, K) into the tile, in-tile mask (c, K))`` of each row's labels."""
        local = self.labels[r0:r1]
        inside = self.owned[r0:r1] & (local >= v0) & (local < v1)
        return torch.where(inside, local - v0, 0), inside
