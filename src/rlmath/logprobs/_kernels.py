"""Chunk-level math shared by every vocabulary-wide reduction in rlmath.

Everything here works on one *chunk*: a 2-D block of ``c`` rows by ``V``
vocabulary entries, in any floating dtype. Results are computed in the
*compute dtype* (fp32, or fp64 for fp64 input). The autograd functions in
``_functions.py`` loop over chunks; the fused LM head and the vocabulary-
parallel versions call the same primitives on the logits chunks they produce,
so the formulas exist once.

Notation for one row of raw logits ``x`` at temperature ``T`` (``z = x / T``)::

    m    = max_j z_j                     y_j  = z_j - m        (<= 0)
    s    = Σ_j exp(y_j)                  lse  = m + log s
    ls_j = z_j - lse                     p_j  = exp(ls_j)
    t    = Σ_j exp(y_j)·y_j              H    = -Σ_j p_j ls_j = log s - t / s

Working on the shifted ``y`` keeps every term of the entropy small: nothing
large cancels. ``-inf`` logits (a padded vocabulary) give ``exp(y_j) = 0`` and
``y_j = -inf``; their ``0·(-inf)`` products are dropped by a NaN-ignoring sum
in forward and made exact zeros by clamping ``ls`` at -1e4 in backward
(where ``p`` is already exactly 0, so no value changes). A NaN logit
still makes ``m``, ``s`` and therefore every output of its row NaN.

Temperature is applied in exactly one place, :func:`scaled_shift`: the chunk
is divided by ``T`` in the compute dtype (bf16 logits are never divided in
bf16) and shifted in the same fused operation, so no scaled copy of the chunk
is stored.

Speed: each full-chunk operation costs a pass over cache-resident data plus
a thread fork/join, so the kernels use as few of them as the math allows
(forward: ``amax``, one fused shift, ``exp``, ``sum``; backward of the log-probs:
shift, ``exp``, one fused scale-and-store) and every per-row coefficient is
computed once for all rows outside the chunk loop.

Determinism: a row's result never depends on which chunk holds it or on how
many rows that chunk has. Elementwise kernels are position independent and
row reductions (:func:`row_sum`) reduce each row with the same kernel; the one
case where ATen would split a single row's reduction across threads (a chunk
holding exactly one long row) is routed through a two-row view so that it
takes the same path as every multi-row chunk.
"""

from __future__ import annotations

import torch

__all__ = [
    "Workspace",
    "chunk_grad",
    "chunk_kl_forward",
    "chunk_kl_grad",
    "chunk_stats",
    "finish_stats",
    "grad_coefficients",
    "row_nansum",
    "row_sum",
    "scaled_max",
    "scaled_shift",
]

# Below this many elements a reduction never runs multi-threaded (ATen's
# GRAIN_SIZE), so a single short row reduces the same way whatever the thread count.
_ATEN_GRAIN_SIZE = 32768

# Floor for log-probabilities in backward products: far below any log-prob whose
# probability is nonzero in fp32 or fp64 (exp(-746) underflows to 0 in fp64).
_LS_FLOOR = -1e4


def _single_long_row(x: torch.Tensor) -> bool:
    # CPU only: the split is a property of ATen's CPU reduction (GPU kernels reduce rows
    # their own way, and a future GPU backend brings its own determinism story).
    return (
        x.shape[0] == 1
        and x.shape[1] >= _ATEN_GRAIN_SIZE
        and x.device.type == "cpu"
        and torch.get_num_threads() > 1
    )


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of a 2-D tensor, bitwise independent of ``x.shape[0]``.

    For a single row long enough to be split across threads, ATen would sum the
    two halves separately and add them; expanding the row to two (stride-0) rows
    makes it parallelize over rows instead, the path every multi-row chunk takes.

    Shape: ``(c, V)`` → ``(c,)``, dtype of ``x``.
    """
    if _single_long_row(x):
        return x.expand(2, x.shape[1]).sum(-1)[:1]
    return x.sum(-1)


def row_nansum(x: torch.Tensor) -> torch.Tensor:
    """:func:`row_sum` that skips NaN entries (the ``0·(-inf)`` of masked vocabulary)."""
    if _single_long_row(x):
        return x.expand(2, x.shape[1]).nansum(-1)[:1]
    return x.nansum(-1)


class Workspace:
    """Scratch buffers of ``rows × V``, allocated once per call and reused by every chunk.

    ``get(name, c)`` returns the first ``c`` rows of the buffer called ``name``
    (created in the compute dtype on first use).
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.vocab, self.dtype, self.device = rows, vocab, dtype, device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            buf = torch.empty(self.rows, self.vocab, dtype=dtype or self.dtype, device=self.device)
            self._buffers[name] = buf
        return buf[:c]


def scaled_max(
    src: torch.Tensor, temperature: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``max_j src_j / T`` per row, ``(c, 1)`` in ``dtype``.

    Division by ``T > 0`` is monotonic and so is rounding, hence
    ``fl(max x / T) = max fl(x / T)``: the max of the scaled chunk without
    scaling the chunk.
    """
    m = src.amax(-1, keepdim=True).to(dtype)
    return m if temperature is None else m / temperature


def scaled_shift(
    src: torch.Tensor,
    temperature: torch.Tensor | None,
    shift: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out = src / T - shift`` in the dtype of ``out``, in one fused pass.

    This is where the temperature is applied. ``src`` may be bf16/fp16 (it is
    upcast element by element, as the other operands are fp32 tensors) and
    may alias ``out``.

    Args:
        src: ``(c, V)`` raw logits, any floating dtype and strides.
        temperature: ``None`` or a ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
        shift: ``(c, 1)`` tensor in the compute dtype.
        out: ``(c, V)`` destination in the compute dtype.

    Returns:
        ``out``.
    """
    if temperature is None:
        return torch.sub(src, shift, out=out)
    # addcdiv rounds src / T first, then adds: the same value as (src / T) - shift.
    return torch.addcdiv(-shift, src, temperature, out=out)


def chunk_stats(
    src: torch.Tensor,
    ws: Workspace,
    *,
    temperature: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Unnormalized per-row statistics of one chunk: the single pass over its logits.

    Returns ``(m, s, t, y_labels)``: ``m = max z`` ``(c,)``, ``s = Σ exp(z - m)``
    ``(c,)``, ``t = Σ exp(z - m)·(z - m)`` ``(c,)`` (only with ``entropy``;
    ``-inf`` entries contribute 0) and ``y_labels = z[labels] - m`` ``(c, K)``
    (only with ``labels``). :func:`finish_stats` turns them into
    ``(lse, log-probs, entropy)``. A vocabulary-parallel caller combines its
    shards' ``(m, s, t)`` first: with ``M = max_k m_k``,
    ``s = Σ_k s_k·e^{m_k - M}`` and ``t = Σ_k e^{m_k - M}·(t_k + (m_k - M)·s_k)``.

    Args:
        src: ``(c, V)`` raw logits, any floating dtype and strides (read only).
        ws: scratch buffers (uses ``"y"`` and, for the entropy, ``"e"``).
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
        labels: ``(c, K)`` int64 indices into V, or ``None``.
        entropy: also compute ``t``.
    """
    c = src.shape[0]
    m = scaled_max(src, temperature, ws.dtype)
    y = scaled_shift(src, temperature, m, ws.get("y", c))
    y_labels = y.gather(1, labels) if labels is not None else None
    if entropy:
        e = torch.exp(y, out=ws.get("e", c))
        s = row_sum(e)
        t: torch.Tensor | None = row_nansum(e.mul_(y))
    else:
        s = row_sum(y.exp_())
        t = None
    return m.squeeze(-1), s, t, y_labels


def finish_stats(
    m: torch.Tensor,
    s: torch.Tensor,
    t: torch.Tensor | None = None,
    y_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(lse, log-probs, entropy)`` from :func:`chunk_stats` (any number of rows at once).

    ``lse = m + log s``, ``logp = y_labels - log s``, ``H = log s - t / s``.
    """
    log_s = s.log()
    lse = m + log_s
    logp = y_labels - log_s.unsqueeze(-1) if y_labels is not None else None
    ent = log_s - t / s if t is not None else None
    return lse, logp, ent


def grad_coefficients(
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    inv_temperature: torch.Tensor | float | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-row coefficients ``(alpha, beta, w)`` of the gradient, for all rows at once.

    With ``g_k`` the upstream gradient of log-prob ``k`` and ``g_H`` that of the
    entropy, ``∂logp_k/∂z = onehot(label_k) - p`` and ``∂H/∂z = -p·(ls + H)``
    (``= -p·(z - E_p[z])``), so the gradient w.r.t. the raw logits is::

        grad_j = p_j·(alpha + beta·ls_j) + Σ_k w_k·[j = label_k]
        alpha = -(Σ_k g_k + g_H·H)/T,   beta = -g_H/T,   w_k = g_k/T

    Returns ``alpha (N, 1)``, ``beta (N, 1)`` or ``None``, ``w (N, K)`` or ``None``.
    """
    a: torch.Tensor | None = None
    beta = w = None
    if grad_logp is not None:
        a = grad_logp.sum(-1)
        w = grad_logp if inv_temperature is None else grad_logp * _col(inv_temperature)
    if grad_entropy is not None:
        assert entropy is not None
        ga = grad_entropy * entropy
        a = ga if a is None else a + ga
        beta = -grad_entropy if inv_temperature is None else -grad_entropy * inv_temperature
        beta = beta.unsqueeze(-1)
    assert a is not None
    alpha = -a if inv_temperature is None else -a * inv_temperature
    return alpha.unsqueeze(-1), beta, w


def _col(x: torch.Tensor | float) -> torch.Tensor | float:
    return x.unsqueeze(-1) if isinstance(x, torch.Tensor) else x


def chunk_grad(
    src: torch.Tensor,
    ws: Workspace,
    out: torch.Tensor,
    *,
    lse: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None = None,
    w: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    logp_only: bool = False,
) -> torch.Tensor:
    """Write the gradient of one chunk (see :func:`grad_coefficients`) into ``out``.

    ``p`` and ``ls`` are recomputed from the logits and the saved ``lse``. The
    gradient is formed in the compute dtype and rounded to ``out``'s dtype once,
    at the end. ``out`` may alias ``src`` (the fused head computes the logits
    chunk into a buffer and turns it into its gradient in place).

    Args:
        src: ``(c, V)`` raw logits, any floating dtype and strides.
        ws: scratch buffers (uses ``"y"`` and, when ``out`` is not in the compute
            dtype, ``"g"``).
        out: ``(c, V)`` destination, any floating dtype.
        lse: ``(c, 1)`` saved log-sum-exp of ``src / T``, compute dtype.
        alpha: ``(c, 1)``; beta: ``(c, 1)`` or ``None``; w: ``(c, K)`` or ``None``.
        labels: ``(c, K)`` int64, needed with ``w``.
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` compute-dtype tensor.
        logp_only: the caller guarantees ``beta is None``, ``K == 1`` and
            ``w = -alpha`` (log-probs only, one label per row); then the gradient
            is ``alpha·(p - onehot)``, formed with one pass fewer.

    Returns:
        ``out``.
    """
    c = src.shape[0]
    direct = out.dtype == ws.dtype
    if logp_only:
        assert labels is not None
        work = out if direct else ws.get("y", c)
        p = scaled_shift(src, temperature, lse, work).exp_()
        # p - 1 at the label is exact (Sterbenz) when p >= 1/2: no cancellation later.
        p.scatter_add_(1, labels, _minus_ones(labels, p.dtype))
        return torch.mul(p, alpha, out=out)
    work = out if direct else ws.get("g", c)
    ls = scaled_shift(src, temperature, lse, ws.get("y", c))
    p = torch.exp(ls, out=work)
    if beta is not None:
        # exp(-1e4) is exactly 0 in fp32 and fp64, so this clamp changes no p
        # but keeps alpha + ls·beta finite (clamping to finfo.min overflowed as
        # soon as |beta| > 1, and 0·inf made NaN at -inf logits).
        ls.clamp_min_(_LS_FLOOR)
        p.mul_(torch.addcmul(alpha, ls, beta, out=ls))
    else:
        p.mul_(alpha)
    if w is not None:
        assert labels is not None
        p.scatter_add_(1, labels, w)
    if not direct:
        out.copy_(p)
    return out


def _minus_ones(labels: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((1, 1), -1.0, dtype=dtype, device=labels.device).expand(labels.shape)


def chunk_kl_forward(
    src_z: torch.Tensor,
    src_r: torch.Tensor,
    ws: Workspace,
    *,
    temperature: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact ``KL(softmax(z) ‖ softmax(r))`` per row of one chunk.

    ``KL = Σ_j p_j·(ls^z_j - ls^r_j)``, a weighted sum of per-entry differences
    (not ``Σ p·z - lse_z - (Σ p·r - lse_r)``) so that the small KL of two close
    distributions is not lost to cancellation. Entries with ``p_j = 0``
    contribute 0 even when both logits are ``-inf``; ``p_j > 0`` where the
    reference is ``-inf`` makes the KL ``+inf``. Clamped at 0 (rounding could
    leave a hair below).

    Args:
        src_z: ``(c, V)`` raw policy logits, any floating dtype and strides.
        src_r: ``(c, V)`` raw reference logits, same.
        ws: scratch buffers (uses ``"y"``, ``"e"`` and ``"yr"``).
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.

    Returns:
        ``(kl, lse_z, lse_r)``, each ``(c,)``.
    """
    c = src_z.shape[0]
    e = ws.get("e", c)
    mr = scaled_max(src_r, temperature, ws.dtype)
    yr = scaled_shift(src_r, temperature, mr, ws.get("yr", c))
    sr = row_sum(torch.exp(yr, out=e))
    mz = scaled_max(src_z, temperature, ws.dtype)
    yz = scaled_shift(src_z, temperature, mz, ws.get("y", c))
    sz = row_sum(torch.exp(yz, out=e))
    log_sz, log_sr = sz.log(), sr.log()
    shift = log_sz - log_sr
    # d = ls_z - ls_r = (y_z - y_r) - (log s_z - log s_r); NaN where both are -inf.
    d = yz.sub_(yr).sub_(shift.unsqueeze(-1))
    kl = row_nansum(e.mul_(d)).div_(sz).clamp_min_(0)
    # A NaN in the reference logits only reaches `shift`; keep it visible.
    kl = torch.where(torch.isnan(shift), shift, kl)
    return kl, mz.squeeze(-1) + log_sz, mr.squeeze(-1) + log_sr


def chunk_kl_grad(
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
    temperature: torch.Tensor | None = None,
) -> None:
    """Gradients of ``Σ g·KL``: ``g·p·(ls_z - ls_r - KL)/T`` for ``z`` and ``g·(q - p)/T`` for ``r``.

    Args:
        src_z, src_r: ``(c, V)`` raw policy and reference logits.
        ws: scratch buffers (uses ``"y"``, ``"yr"``, ``"e"``, ``"gz"``, ``"gr"``).
        lse_z, lse_r, kl: ``(c, 1)`` saved by the forward (compute dtype).
        grad: ``(c, 1)`` upstream gradient of the KL, already divided by ``T``.
        out_z: ``(c, V)`` destination for the policy-logits gradient, or ``None``.
        out_r: ``(c, V)`` destination for the reference-logits gradient, or ``None``.
        temperature: ``None`` or ``(c, 1)`` / ``(1, 1)`` tensor in the compute dtype.
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
        lz.clamp_min_(fmin)
        lr.clamp_min_(fmin)
        d = lz.sub_(lr).sub_(kl)
        # p first: p = 0 turns a huge finite d into an exact 0 before g scales it.
        p.mul_(d).mul_(grad)
        if p is not out_z:
            out_z.copy_(p)
