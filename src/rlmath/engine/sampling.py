"""The kept set of a truncating sampler (top-k, top-p, min-p), one chunk of rows at a time.

Rollout engines draw each token from the temperature-scaled distribution
restricted to a *kept set* and renormalised over it. Every rule they apply
keeps the largest logits of a row, so the kept set is ``{j : z_j >= tau}``
for one threshold ``tau`` per row (``z = logits / T``). rlmath defines one
deterministic rule for ties: tokens whose logit equals the threshold are all
kept (the engines keep a subset of them that depends on their sort order;
``docs/sampling.md``).

With ``m = max_j z_j`` and ``z_(1) >= z_(2) >= ...`` a row's sorted logits:

- min-p keeps ``exp(z_j - m) >= min_p`` (a probability at least ``min_p``
  times the largest one);
- top-k keeps ``z_j >= z_(k)``;
- top-p keeps a token when the mass of the tokens with a strictly larger logit,
  within the candidate set ``C`` the engine applies top-p to, is below
  ``p · mass(C)`` (SGLang: at most ``p``, on the full distribution).

The samplers differ in the candidate set of top-p (see :data:`SAMPLERS`).
The threshold is a function of the logits that receives no gradient; the
log-probs and entropy are those of ``softmax`` over the kept set, i.e. of the
logits with ``-inf`` outside it, which is what the engine's kernels compute
from the chunk :meth:`KeptSet.chunk` returns.
"""

from __future__ import annotations

import torch

from rlmath.engine.torch_backend.buffers import Workspace

__all__ = ["SAMPLERS", "KeptSet", "chunk_threshold"]

SAMPLERS = ("vllm", "sglang", "hf")
"""The engines whose rules :func:`chunk_threshold` follows.

- ``"vllm"``: temperature, then min-p, then top-k, then top-p over the tokens
  min-p and top-k kept, renormalised (``excl < p``).
- ``"sglang"``: temperature, then top-k, top-p and min-p each on the full
  distribution: top-p's mass is not renormalised after top-k (``excl <= p``).
- ``"hf"``: temperature, then top-k, then top-p over the top-k tokens,
  renormalised (``excl < p``), then min-p.
"""

_NEG_INF = float("-inf")

# Top-k alone takes the k-th value from torch.topk below this many values, else from a sort.
_TOPK_LIMIT = 1024

Param = torch.Tensor | float | int | None


def _col(value: Param, a: int, b: int) -> Param:
    """Rows ``[a, b)`` of a per-row ``(M,)`` parameter as a ``(c, 1)`` column; a scalar as is."""
    if isinstance(value, torch.Tensor):
        return value[a:b].unsqueeze(-1)
    return value


def chunk_threshold(
    z: torch.Tensor,
    ws: Workspace,
    *,
    sampler: str,
    top_k: Param,
    top_p: Param,
    min_p: Param,
    kmax: int,
) -> torch.Tensor:
    """The threshold ``tau`` ``(c, 1)`` of each row of scaled logits: the kept set is ``z >= tau``.

    Args:
        z: ``(c, V)`` scaled logits ``logits / T`` in the compute dtype (read only).
        ws: scratch buffers (uses ``"ks"``, ``"ki"`` and ``"kw"``).
        sampler: one of :data:`SAMPLERS`.
        top_k: ``None``, an int ``>= 1`` or a ``(c, 1)`` int64 column (``>= V``: none).
        top_p: ``None``, a float in ``(0, 1]`` or a ``(c, 1)`` column (``1``: none).
        min_p: ``None``, a float in ``[0, 1]`` or a ``(c, 1)`` column (``0``: none).
        kmax: the largest ``k`` of the rows (for ``torch.topk``), at most ``V``.

    Returns:
        ``(c, 1)`` in ``z``'s dtype; ``-inf`` keeps every token. The row's
        largest logit is always kept.
    """
    c, V = z.shape
    m = z.amax(-1, keepdim=True)
    m = torch.where(m == _NEG_INF, 0.0, m)  # a row of -inf logits: nothing to cut
    tau = torch.full((c, 1), _NEG_INF, dtype=z.dtype, device=z.device)
    tau_k: torch.Tensor | None = None
    if min_p is not None:
        ratio = torch.sub(z, m, out=ws.get("kw", c)).exp_()
        # exp(z - m) >= min_p: the smallest logit that passes (ties kept).
        passed = torch.where(ratio >= min_p, z, float("inf"))
        tau = torch.maximum(tau, passed.amin(-1, keepdim=True))
    zs: torch.Tensor | None = None
    if top_p is not None or (top_k is not None and kmax > _TOPK_LIMIT):
        zs, _ = torch.sort(
            z, -1, descending=True, out=(ws.get("ks", c), ws.get("ki", c, torch.int64))
        )
    if top_k is not None:
        k = top_k.clamp(1, V) if isinstance(top_k, torch.Tensor) else min(int(top_k), V)
        if zs is not None:
            head = zs
        else:
            head = torch.topk(z, max(1, min(kmax, V)), -1, sorted=True).values
        if isinstance(k, torch.Tensor):
            tau_k = head.gather(1, k - 1)
        else:
            tau_k = head[:, k - 1 : k]
        tau = torch.maximum(tau, tau_k)
    if top_p is not None:
        assert zs is not None
        base: torch.Tensor | None = None  # SGLang: the full distribution
        if sampler == "vllm":
            base = tau  # after min-p and top-k
        elif sampler == "hf":
            base = tau_k  # after top-k only
        w = torch.sub(zs, m, out=ws.get("kw", c)).exp_()
        if base is not None:
            w.masked_fill_(zs < base, 0.0)
        cum = w.cumsum_(-1)
        total = cum[:, -1:]
        limit = total * top_p
        # Exclusive prefix mass: position j holds the mass of positions < j.
        excl = torch.cat([torch.zeros_like(total), cum[:, :-1]], -1)
        ok = excl <= limit if sampler == "sglang" else excl < limit
        n = ok.sum(-1, keepdim=True).clamp_min_(1)
        tau_p = zs.gather(1, n - 1)
        none = top_p >= 1.0
        if isinstance(none, torch.Tensor):
            tau_p = torch.where(none, _NEG_INF, tau_p)
        elif none:
            tau_p = torch.full_like(tau_p, _NEG_INF)
        tau = torch.maximum(tau, tau_p)
    return tau


class KeptSet:
    """The kept set of every row of one call, applied chunk by chunk.

    Built once per forward or backward pass. In forward it finds each row's
    threshold (:func:`chunk_threshold`) and records it in :attr:`tau` (and the
    size of the kept set in :attr:`count`); in backward it reuses the saved
    thresholds. With ``kept`` (a replayed kept set) the threshold is not used.

    Every valid label of a row is added to that row's kept set: a label the
    rule leaves out (a numerical difference between engines) is scored as if
    the sampler had kept it, and reported as *outside*.

    Args:
        sampler: one of :data:`SAMPLERS`, or ``"kept"`` (replay ``kept``).
        top_k, top_p, min_p: ``None``, a scalar, or an ``(M,)`` tensor (int64
            for ``top_k``, the compute dtype for the others).
        kmax: the largest ``k`` over the rows (``0`` without top-k).
        kept: replay: ``(M, V)`` bool, or ``(M, K)`` int64 column ids padded with -1.
        labels, owned: ``(M, K)`` local label columns and whether each counts.
        tau: ``(M,)`` compute dtype: written in forward, read in backward.
        count: ``(M,)`` compute dtype, written in forward (or ``None``).
        forward: find the thresholds (else read :attr:`tau`).
    """

    def __init__(
        self,
        sampler: str,
        *,
        top_k: Param,
        top_p: Param,
        min_p: Param,
        kmax: int,
        kept: torch.Tensor | None,
        labels: torch.Tensor | None,
        owned: torch.Tensor | None,
        tau: torch.Tensor,
        count: torch.Tensor | None,
        forward: bool,
    ):
        self.sampler = sampler
        self.top_k, self.top_p, self.min_p, self.kmax = top_k, top_p, min_p, kmax
        self.kept, self.labels, self.owned = kept, labels, owned
        self.tau, self.count, self.forward = tau, count, forward

    def chunk(
        self,
        a: int,
        b: int,
        src: torch.Tensor,
        temperature: torch.Tensor | None,
        ws: Workspace,
    ) -> torch.Tensor:
        """Rows ``[a, b)`` as scaled logits ``src / T`` with ``-inf`` outside the kept set.

        ``src``: ``(c, V)`` raw logits (any floating dtype, read only);
        ``temperature``: ``None`` or a ``(c, 1)`` / ``(1, 1)`` compute-dtype
        column. Returns a ``(c, V)`` compute-dtype buffer of ``ws`` (``"kz"``).
        """
        c = b - a
        z = ws.get("kz", c)
        if temperature is None:
            z.copy_(src)
        else:
            torch.div(src, temperature, out=z)
        keep = ws.get("kk", c, torch.bool)
        if self.kept is None:
            if self.forward:
                tau = chunk_threshold(
                    z, ws, sampler=self.sampler, top_k=_col(self.top_k, a, b),
                    top_p=_col(self.top_p, a, b), min_p=_col(self.min_p, a, b), kmax=self.kmax,
                )  # fmt: skip
                self.tau[a:b] = tau.squeeze(-1)
            else:
                tau = self.tau[a:b].unsqueeze(-1)
            torch.ge(z, tau, out=keep)
        elif self.kept.dtype == torch.bool:
            keep.copy_(self.kept[a:b, : z.shape[1]])
        else:
            ids = self.kept[a:b]
            keep.zero_()
            keep.scatter_reduce_(1, ids.clamp_min(0), ids >= 0, reduce="amax")
        if self.count is not None:
            self.count[a:b] = (keep & (z > _NEG_INF)).sum(-1)
        if self.labels is not None and self.owned is not None:
            keep.scatter_reduce_(1, self.labels[a:b], self.owned[a:b], reduce="amax")
        return z.masked_fill_(keep.logical_not_(), _NEG_INF)
