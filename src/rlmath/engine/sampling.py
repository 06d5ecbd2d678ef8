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

from collections.abc import Callable
from typing import NamedTuple

import torch

from rlmath import _device
from rlmath.engine.torch_backend.buffers import Workspace

__all__ = ["SAMPLERS", "KeptSet", "chunk_threshold", "head_values", "scaled_rows"]

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

# The bucketed threshold search: scaled logits y = z - max z in [-_SPAN, 0] fall in
# _BUCKETS buckets of equal width (lower ones, and -inf, in bucket 0).
_BUCKETS = 1024
_SPAN = 40.0

# Top-k of at most this many tokens takes the head of each row from torch.topk (faster
# than the histogram on CPUs up to about 256 tokens).
_TOPK_HEAD = 128

Param = torch.Tensor | float | int | None


def head_values(z: torch.Tensor, h: int) -> torch.Tensor:
    """The ``h`` largest values of each row of ``z`` ``(c, V)``, sorted descending: ``torch.topk``'s.

    ``torch.topk`` of a few dozen values costs several passes over a row on
    CPUs; here it runs on a fraction of it. The row is cut in blocks of ``B``
    columns and only the ``h`` blocks with the largest maxima are searched
    (with the columns past the last whole block): a value above the smallest
    of those maxima lies in one of them, and they hold at least ``h`` values
    at or above it, so the ``h`` largest values (ties and ``-inf`` included;
    NaN sorts first, as in ``torch.topk``) are the same.
    """
    c, V = z.shape
    B = 64 if h <= 64 else 32
    nb = V // B
    if h > nb // 4:
        return torch.topk(z, h, -1, sorted=True).values
    blocks = z[:, : nb * B].unflatten(1, (nb, B))
    best = torch.topk(blocks.amax(-1), h, -1, sorted=False).indices
    rows = torch.arange(c, device=z.device).unsqueeze(-1)
    cand = blocks[rows, best].flatten(1)
    if nb * B < V:
        cand = torch.cat([cand, z[:, nb * B :]], 1)
    return torch.topk(cand, h, -1, sorted=True).values


def _col(value: Param, a: int, b: int) -> Param:
    """Rows ``[a, b)`` of a per-row ``(M,)`` parameter as a ``(c, 1)`` column; a scalar as is."""
    if isinstance(value, torch.Tensor):
        return value[a:b].unsqueeze(-1)
    return value


class _Buckets(NamedTuple):
    """The bucket of each token of a chunk and the buffers :func:`_select` compares into.

    ``bucket``: int64, as ``scatter_add_`` takes it; ``key``: the same whole numbers in
    the compute dtype; ``hit``: compute-dtype scratch and ``mask`` its bool copy (on CPUs a
    comparison into a float buffer and a copy to bool are several times faster than a
    comparison into a bool buffer: 46 + 30 against 310 µs for 16 × 32000 on one thread).
    """

    bucket: torch.Tensor
    key: torch.Tensor
    hit: torch.Tensor
    mask: torch.Tensor


def _bucket_index(y: torch.Tensor, m: torch.Tensor, ws: Workspace) -> _Buckets:
    """The bucket of each shifted logit ``y <= 0`` (NaN: bucket 0), ``(c, V)``.

    ``m``: the rows' max, NaN where a row holds a NaN.
    """
    c = y.shape[0]
    t = torch.mul(y, _BUCKETS / _SPAN, out=ws.get("kb", c)).add_(_BUCKETS)
    t.clamp_(0, _BUCKETS - 1)
    if not _device.reads_host(y.device) or bool(m.isnan().any()):
        t.nan_to_num_(0.0)
    t.floor_()  # t >= 0: what the int64 conversion's truncation gives
    index = ws.get("ki", c, torch.int64).copy_(t)
    return _Buckets(index, t, ws.get("kh", c), ws.get("km", c, torch.bool))


def _at_least(x: torch.Tensor, bound: torch.Tensor | float, ws: Workspace) -> torch.Tensor:
    """``x >= bound`` as a bool ``(c, V)`` buffer of ``ws``, compared into a float one first
    (see :class:`_Buckets`)."""
    c = x.shape[0]
    ok = torch.ge(x, bound, out=ws.get("kh", c))
    return ws.get("km", c, torch.bool).copy_(ok)


def _select(
    z: torch.Tensor,
    buckets: _Buckets,
    weights: torch.Tensor | None,
    target: torch.Tensor | float | int,
    fraction: bool,
    strict: bool,
    value_weight: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The smallest logit whose strictly-larger weight is below ``target`` (``<=`` if not ``strict``).

    The weight of a token is ``weights`` (``None``: 1, a count). With
    ``fraction``, the target is ``target`` times the row's total weight. The
    weight above each bucket is summed first (one histogram per row); only the
    tokens of the bucket where the target is crossed are sorted. Ties are one
    group: the threshold keeps all of it. ``(c, 1)``; ``-inf`` keeps every token.
    ``value_weight`` recomputes the weight of candidate logits (with ``weights``).
    ``buckets``: :func:`_bucket_index`'s pair.
    """
    c, V = z.shape
    dev = z.device
    idx = buckets.bucket
    hist = torch.zeros(c, _BUCKETS, dtype=z.dtype, device=dev)
    src = (
        weights
        if weights is not None
        else torch.ones((1, 1), dtype=z.dtype, device=dev).expand(c, V)
    )
    hist.scatter_add_(1, idx, src)
    T = hist.flip(-1).cumsum_(-1).flip(-1)  # T[:, b]: weight of the buckets >= b
    limit = target * T[:, :1] if fraction else target
    crossed = T >= limit if strict else T > limit
    bstar = crossed.sum(-1, keepdim=True) - 1  # the highest bucket reaching the limit (-1: none)
    nxt = (bstar + 1).clamp_max(_BUCKETS - 1)
    above = torch.where(bstar + 1 >= _BUCKETS, 0.0, T.gather(1, nxt))
    hit = torch.eq(buckets.key, bstar.to(buckets.key.dtype), out=buckets.hit)
    rows, cols = buckets.mask.copy_(hit).nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=c).unsqueeze(-1)
    width = max(int(counts.max()), 1) if counts.numel() else 1
    offsets = counts.squeeze(-1).cumsum(0) - counts.squeeze(-1)
    pos = torch.arange(rows.numel(), device=dev) - offsets[rows]
    cand = torch.full((c, width), float("-inf"), dtype=z.dtype, device=dev)
    cand[rows, pos] = z[rows, cols]
    vals = cand.sort(-1, descending=True).values
    real = torch.arange(width, device=dev) < counts
    if weights is None:
        wv = real.to(z.dtype)
    else:
        assert value_weight is not None
        wv = torch.where(real, value_weight(vals), 0.0)
    excl = above + (wv.cumsum(-1) - wv)
    ok = (excl < limit if strict else excl <= limit) & real
    n = ok.sum(-1, keepdim=True)
    tau = vals.gather(1, (n - 1).clamp_min(0))
    return torch.where((bstar < 0) | (n == 0), float("-inf"), tau)


def _head_top_p(
    head: torch.Tensor,
    m: torch.Tensor,
    base: torch.Tensor | None,
    total: torch.Tensor | None,
    top_p: torch.Tensor | float,
    strict: bool,
) -> torch.Tensor:
    """Top-p's threshold from the sorted head of each row (every candidate inside it).

    ``total``: the candidates' mass when it is not the head's own (SGLang: the
    whole row). Where the whole head passes, the cut lies at or below the
    head's last value: ``-inf`` (top-k decides there).
    """
    wv = (head - m).exp_()
    if base is not None:
        wv.mul_(head >= base)
    cum = wv.cumsum(-1)
    limit = top_p * (cum[:, -1:] if total is None else total)
    excl = cum - wv
    ok = excl < limit if strict else excl <= limit
    n = ok.sum(-1, keepdim=True)
    tau = head.gather(1, (n - 1).clamp_min(0))
    return torch.where((n == 0) | (n == head.shape[1]), _NEG_INF, tau)


def chunk_threshold(
    z: torch.Tensor,
    ws: Workspace,
    *,
    sampler: str,
    top_k: Param,
    top_p: Param,
    min_p: Param,
    kmax: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The threshold ``tau`` ``(c, 1)`` of each row of scaled logits: the kept set is ``z >= tau``.

    No sort of the rows. With top-k of at most :data:`_TOPK_HEAD` tokens, the
    largest ``kmax + 1`` logits of each row (:func:`head_values`) give top-k and,
    when every candidate of top-p lies among them, top-p. Otherwise top-k and
    top-p are found by :func:`_select`: a histogram of each row's count or
    mass over buckets of its logits, then a sort of the one bucket where the
    cut falls.

    Args:
        z: ``(c, V)`` scaled logits ``logits / T`` in the compute dtype (read only).
        ws: scratch buffers (uses ``"ky"``, ``"kw"``, ``"kb"``, ``"ki"``).
        sampler: one of :data:`SAMPLERS`.
        top_k: ``None``, an int ``>= 1`` or a ``(c, 1)`` int64 column (``>= V``: none).
        top_p: ``None``, a float in ``(0, 1]`` or a ``(c, 1)`` column (``1``: none).
        min_p: ``None``, a float in ``[0, 1]`` or a ``(c, 1)`` column (``0``: none).
        kmax: with ``top_k``, the largest ``k`` of the rows (0: unknown).

    Returns:
        ``(tau, e, row_max)``: ``tau`` ``(c, 1)`` in ``z``'s dtype, ``-inf`` keeps every
        token (the row's largest logit is always kept); ``e``: ``exp(z - max
        z)`` in ``ws["kw"]`` (with ``z - max z`` in ``ws["ky"]``); ``row_max``:
        ``(c, 1)`` each row's max (``-inf`` for a row without a finite logit).
    """
    c, V = z.shape
    row_max = z.amax(-1, keepdim=True)
    m = torch.where(row_max == _NEG_INF, 0.0, row_max)  # a row of -inf logits: nothing to cut
    tau = torch.full((c, 1), _NEG_INF, dtype=z.dtype, device=z.device)
    y = torch.sub(z, m, out=ws.get("ky", c))
    head: torch.Tensor | None = None
    if top_k is not None and 0 < kmax <= _TOPK_HEAD:
        head = head_values(z, min(kmax + 1, V))
    w: torch.Tensor | None = None
    if min_p is not None or (top_p is not None and (head is None or sampler == "sglang")):
        w = torch.exp(y, out=ws.get("kw", c))
    if min_p is not None:
        assert w is not None
        # exp(z - m) >= min_p: the smallest logit that passes (ties kept).
        ok = _at_least(w, min_p, ws)
        passed = torch.where(ok, z, float("inf"))
        tau = torch.maximum(tau, passed.amin(-1, keepdim=True))
    if top_k is None and top_p is None:
        if w is None:  # no rule at all (kept_stats alone): the statistics need it next
            w = torch.exp(y, out=ws.get("kw", c))
        return tau, w, row_max
    idx: _Buckets | None = None
    tau_k: torch.Tensor | None = None
    if top_k is not None:
        k = top_k.clamp(1, V) if isinstance(top_k, torch.Tensor) else min(int(top_k), V)
        if head is not None:
            tau_k = head.gather(1, k - 1) if isinstance(k, torch.Tensor) else head[:, k - 1 : k]
        else:
            idx = _bucket_index(y, m, ws)
            tau_k = _select(z, idx, None, k, False, True, None)
        tau = torch.maximum(tau, tau_k)
    if top_p is not None:
        base: torch.Tensor | None = None  # SGLang: the full distribution
        if sampler == "vllm" and (min_p is not None or top_k is not None):
            base = tau  # after min-p and top-k
        elif sampler == "hf":
            base = tau_k  # after top-k only
        strict = sampler != "sglang"
        tau_p: torch.Tensor | None = None
        if head is not None:
            assert tau_k is not None
            if sampler == "sglang":
                # Top-k keeps only the head: a top-p cut below it changes nothing.
                assert w is not None
                tau_p = _head_top_p(head, m, None, w.sum(-1, keepdim=True), top_p, strict)
            elif head.shape[1] == V or not bool((head[:, -1:] >= tau_k).any()):
                # Every candidate (at or above the top-k threshold) is in the head.
                tau_p = _head_top_p(head, m, base, None, top_p, strict)
        if tau_p is None and base is None and w is not None:
            # Each token weighs at most 1 (w = exp(z - max z)), so the nucleus holds at
            # least p·S tokens: where that fits in a head, try the head first.
            total = w.sum(-1, keepdim=True)
            least = float((top_p * total).max())
            # A small head first (a peaked row's nucleus is a few tokens), then the largest;
            # only where the nucleus may fit with room (a flat row's fills no head).
            sizes = [n for n in (32, _TOPK_HEAD) if n >= 2 * least]
            for n in sizes:
                h = min(n, V)
                top = head_values(z, h)
                found = _head_top_p(top, m, None, total, top_p, strict)
                # -inf: the whole head passed, the cut lies below it (unless it is the row).
                if h == V or not bool((found == _NEG_INF).any()):
                    tau_p = found
                    break
        if tau_p is None:
            if w is None:
                w = torch.exp(y, out=ws.get("kw", c))
            if idx is None:
                idx = _bucket_index(y, m, ws)
            weights = w
            if base is not None:  # w itself stays exp(y): the kernels reuse it
                weights = torch.ge(z, base, out=ws.get("kg", c)).mul_(w)

            def mass(v: torch.Tensor) -> torch.Tensor:
                e = (v - m).exp_()
                return e.masked_fill_(v < base, 0.0) if base is not None else e

            tau_p = _select(z, idx, weights, top_p, True, strict, mass)
        none = top_p >= 1.0
        if isinstance(none, torch.Tensor):
            tau_p = torch.where(none, _NEG_INF, tau_p)
        elif none:
            tau_p = torch.full_like(tau_p, _NEG_INF)
        tau = torch.maximum(tau, tau_p)
    if w is None:
        # The statistics over the kept set need it next: computed here, they reuse y.
        w = torch.exp(y, out=ws.get("kw", c))
    return tau, w, row_max


def scaled_rows(src: torch.Tensor, temperature: torch.Tensor | None, ws: Workspace) -> torch.Tensor:
    """``src / T`` in the compute dtype (``ws["kz"]``, or ``src`` itself when nothing changes).

    Every kept-set search reads its logits through this one rounding, so that a
    threshold found in one pass selects the same tokens in the next.
    """
    if temperature is None and src.dtype == ws.dtype:
        return src  # read only from here on
    c = src.shape[0]
    if temperature is not None:
        return torch.div(src, temperature, out=ws.get("kz", c))
    return ws.get("kz", c).copy_(src)


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
        kmax: with ``top_k``, the largest ``k`` of the rows (0: unknown).
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
        kmax: int = 0,
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows ``[a, b)``: the scaled logits ``src / T`` and the kept set (labels added).

        ``src``: ``(c, V)`` raw logits (any floating dtype, read only);
        ``temperature``: ``None`` or a ``(c, 1)`` / ``(1, 1)`` compute-dtype
        column. Returns ``(z, keep, e, row_max)``: ``(c, V)`` compute-dtype buffers of
        ``ws`` (``"kz"``, or ``src`` itself; ``"kk"``: 1 in the kept set, 0
        outside), and ``exp(z - max z)`` and the rows' max ``(c, 1)`` when
        the threshold search computed them (``ws["ky"]`` then holds ``z - max z``),
        else ``None``. The kernels use ``z`` as the
        logits and zero the probability of every token outside ``keep``: the
        softmax over the kept set, without ``-inf`` entries (whose ``exp`` is
        slow on CPUs).
        """
        c = b - a
        z = scaled_rows(src, temperature, ws)
        # The kept set as 1.0 / 0.0 in the compute dtype: compared into and multiplied by
        # several times faster than a bool mask on CPUs.
        keep = ws.get("kk", c)
        e = row_max = None
        if self.kept is None:
            if self.forward:
                tau, e, row_max = chunk_threshold(
                    z, ws, sampler=self.sampler, top_k=_col(self.top_k, a, b),
                    top_p=_col(self.top_p, a, b), min_p=_col(self.min_p, a, b),
                    kmax=self.kmax,
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
            keep.scatter_reduce_(1, ids.clamp_min(0), (ids >= 0).to(keep.dtype), reduce="amax")
        if self.count is not None:
            finite = torch.gt(z, _NEG_INF, out=ws.get("kg", c))  # a float 0/1 mask: see _Buckets
            self.count[a:b] = finite.mul_(keep).sum(-1)
        if self.labels is not None and self.owned is not None:
            owned = self.owned[a:b].to(keep.dtype)
            keep.scatter_reduce_(1, self.labels[a:b], owned, reduce="amax")
        return z, keep, e, row_max
