"""Blocks of the fused LM head's logits: ``hidden_chunk @ weight_tile.T (+ bias_tile)``.

Shared by the head's forward and backward passes. A block is computed into
one reused buffer in the inputs' dtype (as ``hidden @ weight.T`` would be);
the elementwise passes over it run in row slices (on a CPU, L2-sized:
:func:`rlmath.engine.policy.elementwise_rows`).
"""

from __future__ import annotations

import threading

import torch

from rlmath.engine import policy
from rlmath.engine.policy import elementwise_rows, spans
from rlmath.engine.torch_backend.buffers import TileWorkspace

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
        if live is not None and policy.reads_host(hidden.device) and bool(live.all()):
            live = None  # nothing to replace: skip the copy of every chunk
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.labels, self.owned, self.live = labels, owned, live
        self.row_spans = spans(hidden.shape[0], rows)
        self.tile_spans = spans(real, tile)
        c_max, w_max = min(rows, max(1, hidden.shape[0])), max(1, min(tile, real))
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

    def logits(self, h: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
        """The ``(c, v1 - v0)`` block ``h @ weight[v0:v1].T + bias[v0:v1]`` in the inputs' dtype."""
        self.ws.width = v1 - v0
        out = self.ws.get("z", h.shape[0], dtype=h.dtype)
        w = self.weight[v0:v1].T
        if self.bias is None:
            return torch.mm(h, w, out=out)
        return torch.addmm(self.bias[v0:v1], h, w, out=out)

    def transformed(self, z: torch.Tensor) -> torch.Tensor:
        """The logits the softmax sees: ``softcap·tanh(scale·z / softcap)`` in the compute dtype.

        ``z`` itself when there is no transform (the passes upcast it element by
        element); otherwise a compute-dtype block buffer (``"zt"``).
        """
        if not self.transform:
            return z
        out = torch.mul(z, self.scale, out=self.ws.get("zt", z.shape[0]))
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

    def slices(self, c: int, v0: int, v1: int) -> list[tuple[int, int]]:
        """Row slices of a ``(c, v1 - v0)`` block for the elementwise passes."""
        self.small.width = v1 - v0
        return spans(c, self.sub)

    def small_scratch(self) -> TileWorkspace:
        """The calling thread's slice scratch, shaped for the current tile (see :meth:`slices`)."""
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
