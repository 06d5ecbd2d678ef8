"""The kept set of a truncating sampler when the vocabulary is split over processes.

A sampler keeps ``{j : z_j >= tau}`` of each row (:mod:`rlmath.engine.sampling`).
Under vocabulary parallelism the threshold is global: :func:`sharded_thresholds`
finds it from every shard's columns with collectives over the rows, and never
gathers the vocabulary. Per call (``M`` rows, ``W`` ranks):

- the rows' max: one all-reduce (max) of ``M`` floats;
- min-p: one all-reduce (min) of ``M`` floats, each shard's smallest logit that
  passes ``exp(z - max) >= min_p``;
- top-k: one all-gather of each shard's ``kmax`` largest logits per row (the
  global ``k``-th largest is the ``k``-th of their union), in row blocks of at
  most 2²² values;
- top-p: two all-reduces of a 32-bucket histogram per row (float64: the
  masses per bucket, ``M × 32``, locating the bucket where the cut falls, then
  the masses and token counts of its 32 sub-buckets, ``M × 64``) and an
  all-gather of the logits in each row's cut sub-bucket (as wide as the
  largest count, in row blocks of at most 2²² values).

min-p and top-k are order statistics: their thresholds are those of one
process. Top-p compares masses: each mass here is a sum over sub-buckets of
width ``40/1024`` in ``z - max z`` (the buckets of one process's search), and
the float32 weights ``exp(z - max z)`` of one sub-bucket lie within a factor
``e^0.04`` (two binades), so their sum is exact in float64 for fewer than 2²⁷
tokens, in any order and over any split. The kept set is therefore the same
for every number of shards. One process's search sums in the compute dtype:
the two agree except where a token's excluded mass is within rounding of
``p · S``. Tokens more than 40 nats below the row's max (probability below
``e^-40`` times the largest) carry no mass in this search: top-p with ``p < 1``
never keeps them.
"""

from __future__ import annotations

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.groups import ProcessGroup, all_gather, all_reduce
from rlmath.engine.policy import auto_chunk_size
from rlmath.engine.sampling import _BUCKETS, _SPAN, Param, head_values, scaled_rows
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, Workspace
from rlmath.engine.torch_backend.rows import RowSource

__all__ = ["sharded_thresholds"]

_NEG_INF = float("-inf")
_FINE = 32  # sub-buckets per bucket of the first level: _BUCKETS = 32 · 32
_GATHER_BUDGET = 1 << 22  # candidate logits per all-gather, over every rank
# Masses at or below e^-40 (sub-bucket 0 and the bottom of sub-bucket 1) count as 0: every
# sub-bucket's masses then lie within a factor e^0.04 (and a coarse bucket's within e^1.3),
# so their float64 sums are exact.
_FLOOR = float(torch.tensor(-_SPAN).exp())


def _column(value: torch.Tensor | float | int, a: int, b: int) -> torch.Tensor | float | int:
    if isinstance(value, torch.Tensor):
        return value[a:b].unsqueeze(-1)
    return value


def _positions(z: torch.Tensor, m: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """Each token's bucket coordinate ``t`` in ``[0, 1024)``: its sub-bucket is ``floor(t)``
    (that of one process's search, :func:`rlmath.engine.sampling.chunk_threshold`; NaN: 0).
    ``z - m`` stays in ``ws["ky"]``."""
    c = z.shape[0]
    y = torch.sub(z, m, out=ws.get("ky", c))
    t = torch.mul(y, _BUCKETS / _SPAN, out=ws.get("kb", c)).add_(_BUCKETS)
    return t.clamp_(0, _BUCKETS - 1).nan_to_num_(0.0)


def _masses(z: torch.Tensor, base: torch.Tensor | None, ws: Workspace) -> torch.Tensor:
    """Each token's float64 mass ``exp(z - m)`` (from ``ws["ky"]``), 0 below ``base`` and
    at most :data:`_FLOOR` (more than 40 nats below the max: sub-bucket 0)."""
    c = z.shape[0]
    w = torch.exp(ws.get("ky", c), out=ws.get("kw", c))
    torch.threshold_(w, _FLOOR, 0.0)
    if base is not None:
        w.mul_(torch.ge(z, base, out=ws.get("kg", c)))  # a float 0/1 mask: faster on CPUs
    return ws.get("kd", c, torch.float64).copy_(w)


def _index(t: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``floor(t)`` as the int64 index ``scatter_add_`` takes (``t`` already clamped)."""
    return ws.get("ki", t.shape[0], torch.int64).copy_(t.floor_())


def _from_top(h: torch.Tensor, above: torch.Tensor | None = None) -> torch.Tensor:
    """``T[:, b] = above + Σ_{b' >= b} h[:, b']``, added one bucket at a time from the top.

    Without ``above`` the running sum itself (each step one float64 addition, so
    ``T[:, b] = T[:, b + 1] + h[:, b]`` holds exactly); with it, ``above`` plus the
    exact in-bucket sums.
    """
    out = torch.empty_like(h)
    run = torch.zeros_like(h[:, 0])
    for b in range(h.shape[1] - 1, -1, -1):
        run = run + h[:, b]
        out[:, b] = run
    return out if above is None else above.unsqueeze(-1) + out


def _highest_crossed(T: torch.Tensor, limit: torch.Tensor, strict: bool) -> torch.Tensor:
    """The highest bucket whose mass from the top reaches ``limit`` (``(M,)``, clamped >= 0)."""
    crossed = T >= limit.unsqueeze(-1) if strict else T > limit.unsqueeze(-1)
    return (crossed.sum(-1) - 1).clamp_min(0)


def sharded_thresholds(
    logits: torch.Tensor,
    row_index: torch.Tensor | None,
    narrow: tuple[int, int, int] | None,
    temperature: Temperature,
    real: int,
    chunk: int | None,
    dtype: torch.dtype,
    *,
    sampler: str,
    top_k: Param,
    top_p: Param,
    min_p: Param,
    kmax: int,
    group: ProcessGroup,
) -> torch.Tensor:
    """The global threshold ``tau`` ``(M,)`` of each selected row (``-inf``: keep every token).

    ``logits`` holds this rank's ``real`` columns; ``top_k`` / ``top_p`` /
    ``min_p`` and ``kmax`` as for :class:`~rlmath.engine.sampling.KeptSet`
    (``(M,)`` tensors or scalars). Every rank of ``group`` calls this with the
    same rows and parameters and gets the same thresholds.
    """
    dev = logits.device
    src = RowSource(logits, real, row_index, narrow)
    M = src.num_rows
    chunk = chunk or auto_chunk_size(max(real, 1), max(M, 1), device=dev)
    temp = TemperatureColumn(temperature, dtype, dev)
    ranges = list(src.ranges(chunk)) if M and real else []

    def scratch() -> Workspace:
        return Workspace(min(chunk, max(M, 1)), max(real, 1), dtype, dev)

    def passes(work) -> None:  # type: ignore[no-untyped-def]
        run_chunks(ranges, work, scratch, dev)

    def z_of(a: int, b: int, ws: Workspace) -> torch.Tensor:
        return scaled_rows(src.rows(a, b, ws), temp.rows(a, b), ws)

    def within(r0: int, r1: int) -> list[tuple[int, int]]:
        """The chunks of rows ``[r0, r1)``."""
        return [(max(a, r0), min(b, r1)) for a, b in ranges if a < r1 and b > r0]

    # 1. The rows' max and, for top-k, the k-th largest logit of the union of every shard's
    #    kmax largest (in row blocks: each shard's heads of a block, then their all-gather).
    world = torch.distributed.get_world_size(group)
    m = torch.full((M,), _NEG_INF, dtype=dtype, device=dev)
    k_local = min(kmax, real) if top_k is not None else 0
    head_width = max(kmax, 1)
    tau = torch.full((M,), _NEG_INF, dtype=dtype, device=dev)
    tau_k: torch.Tensor | None = None
    if top_k is None:

        def row_max(a: int, b: int, ws: Workspace) -> None:
            m[a:b] = z_of(a, b, ws).amax(-1)

        passes(row_max)
    else:
        k = top_k if isinstance(top_k, torch.Tensor) else torch.full((M,), int(top_k), device=dev)
        tau_k = torch.full((M,), _NEG_INF, dtype=dtype, device=dev)
        block = max(1, _GATHER_BUDGET // (world * head_width))
        for r0 in range(0, M, block):
            r1 = min(M, r0 + block)
            heads = torch.full((r1 - r0, head_width), _NEG_INF, dtype=dtype, device=dev)

            def first(
                a: int, b: int, ws: Workspace, r0: int = r0, heads: torch.Tensor = heads
            ) -> None:
                z = z_of(a, b, ws)
                m[a:b] = z.amax(-1)
                if k_local:
                    heads[a - r0 : b - r0, :k_local] = head_values(z, k_local)

            run_chunks(within(r0, r1), first, scratch, dev)
            union = all_gather(heads, group).permute(1, 0, 2).reshape(r1 - r0, -1)
            ordered = torch.topk(union, min(kmax, union.shape[1]), -1, sorted=True).values
            kr = k[r0:r1]
            pick = (kr.clamp(1, max(ordered.shape[1], 1)) - 1).unsqueeze(-1)
            kth = ordered.gather(1, pick).squeeze(-1) if ordered.shape[1] else tau_k[r0:r1]
            tau_k[r0:r1] = torch.where(kr > ordered.shape[1], _NEG_INF, kth)
        tau = torch.maximum(tau, tau_k)
    m = all_reduce(m, "max", group)
    m = torch.where(m == _NEG_INF, 0.0, m)  # a row of -inf logits: nothing to cut
    col = m.unsqueeze(-1)

    # 2. min-p: the smallest logit that passes, over every shard.
    if min_p is not None:
        low = torch.full((M,), float("inf"), dtype=dtype, device=dev)
        floor: torch.Tensor | float | int = min_p

        def passing(a: int, b: int, ws: Workspace) -> None:
            z = z_of(a, b, ws)
            y = torch.sub(z, col[a:b], out=ws.get("ky", b - a))
            w = torch.exp(y, out=ws.get("kw", b - a))
            low[a:b] = torch.where(w >= _column(floor, a, b), z, float("inf")).amin(-1)

        passes(passing)
        tau = torch.maximum(tau, all_reduce(low, "min", group))
    if top_p is None:
        return tau

    # 3. top-p over the candidates: min-p's and top-k's survivors (vLLM), top-k's (HF),
    #    or the whole row (SGLang).
    base: torch.Tensor | None = None
    if sampler == "vllm" and (min_p is not None or top_k is not None):
        base = tau.clone()
    elif sampler == "hf":
        base = tau_k
    base_col = base.unsqueeze(-1) if base is not None else None
    strict = sampler != "sglang"
    h1 = torch.zeros(M, _FINE, dtype=torch.float64, device=dev)

    def coarse(a: int, b: int, ws: Workspace) -> None:
        z = z_of(a, b, ws)
        t = _positions(z, col[a:b], ws)
        w = _masses(z, _rows(base_col, a, b), ws)
        h1[a:b].scatter_add_(1, _index(t.mul_(1 / _FINE), ws), w)  # floor(t / 32): exact

    passes(coarse)
    T1 = _from_top(all_reduce(h1, "sum", group))
    if isinstance(top_p, torch.Tensor):
        p = top_p.double()
    else:
        p = torch.full((M,), float(top_p), dtype=torch.float64, device=dev)
    limit = p * T1[:, 0]
    c_star = _highest_crossed(T1, limit, strict)
    nxt = (c_star + 1).clamp_max(_FINE - 1).unsqueeze(-1)
    above1 = torch.where(c_star + 1 >= _FINE, 0.0, T1.gather(1, nxt).squeeze(-1))
    # The sub-buckets of each row's cut bucket: masses, and token counts (the widest
    # count bounds the candidates a rank sends).
    # Columns 1..32 of each: the 32 sub-buckets; 0 and 33 collect the tokens below and
    # above the cut bucket (dropped).
    h2 = torch.zeros(M, 2, _FINE + 2, dtype=torch.float64, device=dev)
    first_fine = (c_star * _FINE).unsqueeze(-1).to(dtype)
    ones = torch.ones((1, 1), dtype=torch.float64, device=dev)

    def fine(a: int, b: int, ws: Workspace) -> None:
        z = z_of(a, b, ws)
        t = _positions(z, col[a:b], ws)
        w = _masses(z, _rows(base_col, a, b), ws)
        j = t.sub_(first_fine[a:b])  # exact: t and the integer 32·c* share t's grid
        idx = _index(j.clamp_(-1, _FINE), ws).add_(1)
        h2[a:b, 0].scatter_add_(1, idx, w)
        h2[a:b, 1].scatter_add_(1, idx, ones.expand(idx.shape))

    passes(fine)
    h2 = all_reduce(h2, "sum", group)[:, :, 1 : _FINE + 1]
    T2 = _from_top(h2[:, 0].contiguous(), above1)
    j_star = _highest_crossed(T2, limit, strict)
    nxt = (j_star + 1).clamp_max(_FINE - 1).unsqueeze(-1)
    above = torch.where(j_star + 1 >= _FINE, above1, T2.gather(1, nxt).squeeze(-1))
    b_star = (c_star * _FINE + j_star).unsqueeze(-1).to(dtype)

    # 4. The tokens of each row's cut sub-bucket, from every shard, sorted: the cut is the
    #    last one whose excluded mass stays below the limit.
    counts = h2[:, 1].gather(1, j_star.unsqueeze(-1))
    width = int(counts.max()) if M else 0  # one host read per call
    tau_p = torch.full((M,), _NEG_INF, dtype=dtype, device=dev)
    block = max(1, _GATHER_BUDGET // max(world * width, 1))
    for r0 in range(0, M, block):
        r1 = min(M, r0 + block)
        cand = torch.full((r1 - r0, max(width, 1)), _NEG_INF, dtype=dtype, device=dev)

        def collect(a: int, b: int, ws: Workspace, r0: int = r0, cand: torch.Tensor = cand) -> None:
            z = z_of(a, b, ws)
            t = _positions(z, col[a:b], ws)
            lo = b_star[a:b]
            hit = (t >= lo) & (t < lo + 1)  # floor(t) == b*
            rows, cols = hit.nonzero(as_tuple=True)
            n = hit.sum(-1)
            pos = torch.arange(rows.numel(), device=dev) - (n.cumsum(0) - n)[rows]
            cand[rows + (a - r0), pos] = z[rows, cols]

        run_chunks(within(r0, r1), collect, scratch, dev)
        vals = all_gather(cand, group).permute(1, 0, 2).reshape(r1 - r0, -1)
        vals = vals.sort(-1, descending=True).values
        real_c = vals > _NEG_INF
        wv = torch.exp(vals - col[r0:r1])
        if base_col is not None:
            wv = wv * (vals >= base_col[r0:r1])
        wv = torch.where(real_c, wv.double(), 0.0)
        excl = above[r0:r1].unsqueeze(-1) + (wv.cumsum(-1) - wv)
        lim = limit[r0:r1].unsqueeze(-1)
        ok = (excl < lim if strict else excl <= lim) & real_c
        n = ok.sum(-1, keepdim=True)
        cut = vals.gather(1, (n - 1).clamp_min(0)).squeeze(-1)
        tau_p[r0:r1] = torch.where(n.squeeze(-1) == 0, _NEG_INF, cut)
    tau_p = torch.where(p >= 1.0, _NEG_INF, tau_p)
    return torch.maximum(tau, tau_p)


def _rows(col: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return col[a:b] if col is not None else None
