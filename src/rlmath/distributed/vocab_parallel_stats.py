"""Per-row statistics of one vocabulary shard and their combination over the group.

Shared by the vocabulary-parallel functions on logits and on the LM head. Each
rank reduces its own columns with the chunk primitives of
:mod:`rlmath.logprobs._kernels`, giving per row ``m_k = max z``,
``s_k = Σ exp(z - m_k)`` and ``t_k = Σ exp(z - m_k)·(z - m_k)``; the group then
combines them (``M = max_k m_k``, ``s = Σ_k s_k e^{m_k - M}``,
``t = Σ_k e^{m_k - M}(t_k + (m_k - M)s_k)``) in two collectives per call: one
max, and one sum of a packed ``(N, 2 + K)`` buffer that also carries the label
logits (only the owner of a label contributes a non-zero value).

A shard row whose logits are all ``-inf`` (padding columns, a masked
vocabulary) has no mass: it contributes ``s_k = t_k = 0`` instead of the NaN
that ``-inf - (-inf)`` would give, so another rank's finite logits decide the
row. A NaN logit still makes its row NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmath.distributed._collectives import ProcessGroup, all_reduce
from rlmath.logprobs._kernels import (
    Workspace,
    chunk_stats,
    finish_stats,
    scaled_shift,
)

__all__ = [
    "ShardSpec",
    "Temperature",
    "TileWorkspace",
    "combine_shard_stats",
    "local_labels",
    "merge_stats",
    "shard_chunk_grad",
    "shard_chunk_stats",
    "shard_kl_grad",
]

# Any log-prob below this has exp() == 0 exactly in fp32 and fp64.
_ZERO_PROB_LOG = -1.0e4


@dataclass(frozen=True)
class ShardSpec:
    """Which global vocabulary columns this rank holds.

    ``start`` is the global id of local column 0; only the first ``real``
    local columns are real tokens (the rest, if any, are padding that is left
    out of the softmax and receives a zero gradient). ``ignore_index`` marks
    labels that give log-prob 0 and no gradient (``None``: none).
    """

    start: int
    real: int
    ignore_index: int | None


class Temperature:
    """The temperature as the ``(rows, 1)`` (or ``(1, 1)``) compute-dtype column the kernels take.

    ``value`` is ``None`` (exactly 1), a float, or a flat ``(N,)`` tensor in the
    compute dtype (from :func:`rlmath.logprobs._inputs.normalize_temperature`).
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
        if self.col is None or not self.per_row:
            return self.col
        return self.col[start:end]

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x / T`` for an ``(N, K)`` tensor of raw logits (already in the compute dtype)."""
        return x if self.col is None else x / self.col


class TileWorkspace(Workspace):
    """A :class:`Workspace` whose buffers have the width of the current vocabulary tile.

    The kernels ask for ``ws.get(name, c)`` and expect a ``(c, width)`` buffer
    matching their input; the last tile of a shard is narrower than the
    others. Each named buffer is one flat allocation of ``rows × vocab``
    entries viewed as a contiguous ``(c, width)`` matrix for the current
    :attr:`width`.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        super().__init__(rows, vocab, dtype, device)
        self.width = vocab
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        buf = self._flat.get((name, dt))
        if buf is None:
            buf = torch.empty(self.rows * self.vocab, dtype=dt, device=self.device)
            self._flat[(name, dt)] = buf
        return buf[: c * self.width].view(c, self.width)


def merge_stats(
    m1: torch.Tensor,
    s1: torch.Tensor,
    t1: torch.Tensor | None,
    m2: torch.Tensor,
    s2: torch.Tensor,
    t2: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row ``(m, s, t)`` of the union of two column sets (the rule of the module docstring).

    Either side may be a row without mass (``m = -inf``, ``s = t = 0``).
    """
    big = torch.maximum(m1, m2)
    d1 = torch.where(m1 == float("-inf"), 0, m1 - big)
    d2 = torch.where(m2 == float("-inf"), 0, m2 - big)
    e1, e2 = d1.exp(), d2.exp()
    s = e1 * s1 + e2 * s2
    t = None
    if t1 is not None and t2 is not None:
        t = e1 * (t1 + d1 * s1) + e2 * (t2 + d2 * s2)
    return big, s, t


def local_labels(
    labels: torch.Tensor, shard: ShardSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local, owned, valid)`` for ``(N, K)`` global labels.

    ``valid``: not ``ignore_index``. ``owned``: valid and inside this rank's
    real columns. ``local``: the local column of an owned label, 0 elsewhere
    (a safe index for ``gather``/``scatter_add`` whose value is then masked).
    """
    valid = (
        labels != shard.ignore_index
        if shard.ignore_index is not None
        else torch.ones_like(labels, dtype=torch.bool)
    )
    local = labels - shard.start
    owned = valid & (local >= 0) & (local < shard.real)
    return torch.where(owned, local, 0), owned, valid


def shard_chunk_stats(
    src: torch.Tensor,
    ws: Workspace,
    *,
    temperature: torch.Tensor | None,
    labels: torch.Tensor | None,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`chunk_stats` of one chunk of local columns, plus the raw label logits.

    Returns ``(m, s, t, z_labels)``: ``(c,)``, ``(c,)``, ``(c,)`` or ``None``,
    and ``(c, K)`` scaled logits ``z[labels]`` (compute dtype) or ``None``.
    ``labels`` are local column indices (garbage rows are masked by the caller).
    A row with no finite logit comes back as ``m = -inf, s = t = 0``.
    """
    m, s, t, _ = chunk_stats(src, ws, temperature=temperature, entropy=entropy)
    dead = m == float("-inf")
    s = torch.where(dead, 0, s)
    if t is not None:
        t = torch.where(dead, 0, t)
    z = None
    if labels is not None:
        # The same rounding as the single-process kernel: upcast, then divide by T.
        z = src.gather(1, labels).to(ws.dtype)
        if temperature is not None:
            z = z / temperature
    return m, s, t, z


def combine_shard_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None,
    z_labels: torch.Tensor | None,
    owned: torch.Tensor | None,
    group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Global ``(lse, entropy, label logits)`` from every rank's per-row shard statistics.

    Args:
        m, s: ``(N,)`` this rank's max and shifted sum-exp (``m = -inf`` with
            ``s = 0`` for a row without finite logits here).
        t: ``(N,)`` shifted entropy partial, or ``None``.
        z_labels: ``(N, K)`` scaled label logits (garbage where not owned), or ``None``.
        owned: ``(N, K)`` bool, the labels this rank owns (with ``z_labels``).
        group: the tensor-parallel group.

    Returns:
        ``lse (N,)``, ``entropy (N,)`` or ``None``, ``z (N, K)`` or ``None``:
        the global log-sum-exp, entropy and the label logits (0 for labels no
        rank owns, i.e. ignored ones), identical on every rank.
    """
    big_m = all_reduce(m, "max", group)
    dead = m == float("-inf")
    # A rank without mass in a row contributes exact zeros (its e^{m - M} may be NaN).
    scale = torch.where(dead, 0, torch.exp(m - big_m))
    parts = [s * scale]
    if t is not None:
        parts.append(torch.where(dead, 0, scale * (t + (m - big_m) * s)))
    if z_labels is not None:
        assert owned is not None
        parts.extend(torch.where(owned, z_labels, 0).unbind(-1))
    total = all_reduce(torch.stack(parts, -1), "sum", group)
    s_all = total[:, 0]
    t_all = total[:, 1] if t is not None else None
    lse, _, ent = finish_stats(big_m, s_all, t_all)
    z = total[:, 2 if t is not None else 1 :] if z_labels is not None else None
    return lse, ent, z


def shard_chunk_grad(
    src: torch.Tensor,
    ws: Workspace,
    out: torch.Tensor,
    *,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    w: torch.Tensor | None,
    labels: torch.Tensor | None,
    temperature: torch.Tensor | None,
) -> torch.Tensor:
    """Write the gradient of one chunk of local columns into ``out``.

    ``grad_j = p_j·(alpha + beta·ls_j) + Σ_k w_k·[j = label_k]`` (see
    :func:`rlmath.logprobs._kernels.grad_coefficients`) with ``ls = z/T - lse``
    from the *global* log-sum-exp, so each rank writes its own columns of the
    full-vocabulary gradient. Formed in the compute dtype and rounded to
    ``out``'s dtype once; ``out`` may alias ``src``.

    ``ls`` is clamped to ``-1e4`` before the entropy term: there ``p`` is
    already exactly 0, whereas ``-inf`` (or the dtype's finite minimum times
    ``|beta| > 1``, which overflows) would turn the zero terms of ``-inf``
    logits (padding columns) into NaN.

    Args:
        src: ``(c, V_local)`` raw logits, any floating dtype and strides.
        ws: scratch buffers (uses ``"y"`` and, when ``out`` is not in the compute
            dtype, ``"g"``).
        out: ``(c, V_local)`` destination, any floating dtype.
        lse: ``(c, 1)`` global log-sum-exp of ``src / T``, compute dtype.
        alpha: ``(c, 1)``; beta: ``(c, 1)`` or ``None``; w: ``(c, K)`` or ``None``
            (zero for labels this chunk does not hold).
        labels: ``(c, K)`` int64 local column indices, needed with ``w``.
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` compute-dtype tensor.
    """
    c = src.shape[0]
    direct = out.dtype == ws.dtype
    work = out if direct else ws.get("g", c)
    ls = scaled_shift(src, temperature, lse, ws.get("y", c))
    p = torch.exp(ls, out=work)
    if beta is not None:
        ls.clamp_min_(_ZERO_PROB_LOG)
        p.mul_(torch.addcmul(alpha, ls, beta, out=ls))
    else:
        p.mul_(alpha)
    if w is not None:
        assert labels is not None
        p.scatter_add_(1, labels, w)
    if not direct:
        out.copy_(p)
    return out


def shard_kl_grad(
    src_z: torch.Tensor,
    src_r: torch.Tensor,
    ws: Workspace,
    *,
    lse_z: torch.Tensor,
    lse_r: torch.Tensor,
    kl: torch.Tensor,
    grad: torch.Tensor,
    out_z: torch.Tensor | None,
    out_r: torch.Tensor | None,
    temperature: torch.Tensor | None,
) -> None:
    """Local columns of the gradients of ``Σ g·KL(p‖q)``.

    ``g·p·(ls_z - ls_r - KL)/T`` for the policy logits and ``g·(q - p)/T`` for
    the reference, with ``ls = z/T - lse`` from the global log-sum-exps.
    ``ls`` is clamped to the dtype's finite minimum and ``p`` multiplies the
    difference before ``g`` does, so entries with ``p = 0`` are exact zeros.

    Args:
        src_z, src_r: ``(c, V_local)`` raw policy and reference logits.
        ws: scratch buffers (``"y"``, ``"yr"``, ``"e"``, ``"gz"``, ``"gr"``).
        lse_z, lse_r, kl: ``(c, 1)`` global values saved by the forward.
        grad: ``(c, 1)`` upstream gradient of the KL, already divided by ``T``.
        out_z, out_r: ``(c, V_local)`` destinations, or ``None``.
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` compute-dtype tensor.
    """
    c = src_z.shape[0]
    fmin = torch.finfo(ws.dtype).min
    lz = scaled_shift(src_z, temperature, lse_z, ws.get("y", c))
    lr = scaled_shift(src_r, temperature, lse_r, ws.get("yr", c))
    if out_z is not None:
        pz = out_z if out_z.dtype == ws.dtype else ws.get("gz", c)
    else:
        pz = ws.get("e", c)
    p = torch.exp(lz, out=pz)
    if out_r is not None:
        qr = out_r if out_r.dtype == ws.dtype else ws.get("gr", c)
        q = torch.exp(lr, out=qr).sub_(p).mul_(grad)
        if q is not out_r:
            out_r.copy_(q)
    if out_z is not None:
        d = lz.clamp_min_(fmin).sub_(lr.clamp_min_(fmin)).sub_(kl)
        p.mul_(d).mul_(grad)
        if p is not out_z:
            out_z.copy_(p)
