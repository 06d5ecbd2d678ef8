"""Blocks of the fused LM head's logits: ``hidden_chunk @ weight_tile.T (+ bias_tile)``.

Shared by the head's forward and backward passes. A block is computed into
one reused buffer in the inputs' dtype (as ``hidden @ weight.T`` would be).
On a CPU its matmuls run in pieces (:meth:`HeadBlocks.for_row_pieces`,
:meth:`HeadBlocks.for_entry_pieces`), each piece a task for one worker thread
(:mod:`rlmath.engine.torch_backend.workers`) that also runs the elementwise
passes over its rows, in L2-sized slices
(:func:`rlmath.engine.policy.elementwise_rows`). Every piece writes its own
rows (or vocabulary entries) of the outputs, and the pieces' bounds never
depend on the thread count, so neither do the results.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from rlmath import _device
from rlmath.engine.policy import elementwise_rows, matmul_piece, spans, tile_spans
from rlmath.engine.torch_backend.buffers import TileWorkspace
from rlmath.engine.torch_backend.workers import for_each_chunk, pass_workers

__all__ = ["HeadBlocks"]


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
            live = None  # nothing to replace: skip the copy of every chunk
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.labels, self.owned, self.live = labels, owned, live
        self.row_spans = spans(hidden.shape[0], rows)
        self.tile_spans = tile_spans(real, tile, hidden.device)
        c_max, w_max = min(rows, max(1, hidden.shape[0])), max(1, min(tile, real))
        self.piece_rows = matmul_piece(c_max, hidden.device)
        self.piece_entries = matmul_piece(w_max, hidden.device)
        # Block-sized buffers (the logits block, the gradient block, matmul operands)...
        self.ws = TileWorkspace(c_max, w_max, dtype, hidden.device)
        # ...and slice-sized scratch for the elementwise passes.
        self.sub = elementwise_rows(c_max, w_max, hidden.device)
        self.small = TileWorkspace(self.sub, w_max, dtype, hidden.device)
        # The slice scratch of every other thread that works on the slices
        # (rlmath.engine.torch_backend.workers), made on first use.
        self._w_max, self._dtype = w_max, dtype
        self._small_of: dict[int, TileWorkspace] = {threading.get_ident(): self.small}
        self._small_lock = threading.Lock()
        self.scale, self.softcap = scale, softcap
        self.transform = scale != 1.0 or softcap is not None

    def hidden_rows(self, r0: int, r1: int) -> torch.Tensor:
        """``hidden[r0:r1]``, with the rows of dead (all-ignored) positions replaced by zeros."""
        if self.live is None:
            return self.hidden[r0:r1]
        return torch.where(self.live[r0:r1, None], self.hidden[r0:r1], 0.0)

    def begin_tile(self, v0: int, v1: int) -> None:
        """Shape the block buffers (and every thread's slice scratch) for the tile ``[v0, v1)``.

        Called before the pieces of a block start, and it creates the block
        buffers the pieces write into: the workers only read shared state.
        """
        self.ws.width = self.small.width = v1 - v0
        self.ws.get("z", 1, dtype=self.hidden.dtype)
        if self.transform:
            self.ws.get("zt", 1)

    def for_row_pieces(self, c: int, work: Callable[[int, int, TileWorkspace], None]) -> None:
        """``work(a, b, slice_scratch)`` for every row piece of a ``c``-row block, on the workers.

        One worker task per piece (see :func:`matmul_piece`); each worker gets
        its own slice scratch (:meth:`small_scratch`).
        """
        pieces = spans(c, self.piece_rows)
        for_each_chunk(
            pieces, work, self.small_scratch, pass_workers(self.hidden.device, len(pieces))
        )

    def for_entry_pieces(self, width: int, work: Callable[[int, int, None], None]) -> None:
        """``work(e0, e1, None)`` for every vocabulary-entry piece of a ``width``-wide tile."""
        pieces = spans(width, self.piece_entries)
        for_each_chunk(pieces, work, lambda: None, pass_workers(self.hidden.device, len(pieces)))

    def logits(self, h: torch.Tensor, v0: int, v1: int, a: int = 0) -> torch.Tensor:
        """Rows ``[a, a + len(h))`` of the block buffer: ``h @ weight[v0:v1].T + bias[v0:v1]``.

        In the inputs' dtype; ``h`` is those rows of the block's hidden states.
        """
        out = self.ws.get("z", a + h.shape[0], dtype=h.dtype)[a:]
        w = self.weight[v0:v1].T
        if self.bias is None:
            return torch.mm(h, w, out=out)
        return torch.addmm(self.bias[v0:v1], h, w, out=out)

    def transformed(self, z: torch.Tensor, a: int = 0) -> torch.Tensor:
        """The logits the softmax sees: ``softcap·tanh(scale·z / softcap)`` in the compute dtype.

        ``z`` itself when there is no transform (the passes upcast it element by
        element); otherwise rows ``[a, a + len(z))`` of a compute-dtype block
        buffer (``"zt"``).
        """
        if not self.transform:
            return z
        out = torch.mul(z, self.scale, out=self.ws.get("zt", a + z.shape[0])[a:])
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
        """Row slices of ``c`` rows of a block (a piece) for the elementwise passes."""
        return spans(c, self.sub)

    def small_scratch(self) -> TileWorkspace:
        """The calling thread's slice scratch, shaped for the current tile (see :meth:`begin_tile`)."""
        key = threading.get_ident()
        with self._small_lock:
            ws = self._small_of.get(key)
            if ws is None:
                ws = TileWorkspace(self.sub, self._w_max, self._dtype, self.hidden.device)
                self._small_of[key] = ws
        ws.width = self.small.width
        return ws

    def tile_labels(self, r0: int, r1: int, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index (c, K) into the tile, in-tile mask (c, K))`` of each row's labels."""
        local = self.labels[r0:r1]
        inside = self.owned[r0:r1] & (local >= v0) & (local < v1)
        return torch.where(inside, local - v0, 0), inside
