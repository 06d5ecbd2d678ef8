"""The backward pass of the exact KL: gradients for both logits, chunk by chunk.

``∂KL/∂z = p·(ls_z - ls_r - KL)/T`` and ``∂KL/∂r = (q - p)/T``, from the
saved global log-sum-exps and KL of each row (no collective needed for a
vocabulary shard: each rank writes its own columns).
"""

from __future__ import annotations

import torch

from rlmath.engine.execution import run_chunks
from rlmath.engine.policy import auto_chunk_size
from rlmath.engine.torch_backend.buffers import Temperature, TemperatureColumn, Workspace
from rlmath.engine.torch_backend.reductions import scaled_shift
from rlmath.engine.torch_backend.rows import RowBlocks, chunk_ranges, real_columns

__all__ = ["chunk_kl_grad", "kl_grad"]


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
    """Gradients of ``Σ g·KL`` for one chunk, written into ``out_z`` / ``out_r``.

    Args:
        src_z, src_r: ``(c, V)`` raw policy and reference logits.
        ws: scratch buffers (uses ``"y"``, ``"yr"``, ``"e"``, ``"gz"``, ``"gr"``).
        lse_z, lse_r, kl: ``(c, 1)`` saved by the forward (compute dtype).
        grad: ``(c, 1)`` upstream gradient of the KL, already divided by ``T``.
        out_z, out_r: ``(c, V)`` destinations, or ``None``.
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


def _empty_grad(x: torch.Tensor, real: int) -> tuple[torch.Tensor, RowBlocks]:
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if real < x.shape[-1]:
        grad.narrow(-1, real, x.shape[-1] - real).zero_()
    return grad, RowBlocks(real_columns(grad, real))


def kl_grad(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    lse_z: torch.Tensor,
    lse_r: torch.Tensor,
    kl: torch.Tensor,
    grad: torch.Tensor,
    temperature: Temperature,
    need_z: bool,
    need_r: bool,
    real: int,
    chunk: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of both logits (their full shapes; zero on padding columns).

    ``grad`` is the ``(N,)`` upstream gradient already divided by ``T``.
    """
    cdt, dev = kl.dtype, logits.device
    gz, dz = _empty_grad(logits, real) if need_z else (None, None)
    gr, dr = _empty_grad(ref_logits, real) if need_r else (None, None)
    N = kl.shape[0]
    if N == 0 or real == 0:
        for d in (dz, dr):
            for blk in d.blocks if d is not None else []:
                blk.zero_()
        return gz, gr
    chunk = chunk or auto_chunk_size(real, N, device=dev)
    lay_z = RowBlocks(real_columns(logits, real))
    lay_r = RowBlocks(real_columns(ref_logits, real))
    temp = TemperatureColumn(temperature, cdt, dev)
    cols = [x.unsqueeze(-1) for x in (grad, lse_z, lse_r, kl)]
    layouts = [x for x in (lay_z, lay_r, dz, dr) if x is not None]
    ranges = list(chunk_ranges(N, chunk, *layouts))

    def one_chunk(a: int, b: int, ws: Workspace) -> None:
        chunk_kl_grad(
            lay_z.get(a, b),
            lay_r.get(a, b),
            ws,
            grad=cols[0][a:b],
            lse_z=cols[1][a:b],
            lse_r=cols[2][a:b],
            kl=cols[3][a:b],
            out_z=dz.get(a, b) if dz is not None else None,
            out_r=dr.get(a, b) if dr is not None else None,
            temperature=temp.rows(a, b),
        )

    run_chunks(ranges, one_chunk, lambda: Workspace(min(chunk, N), real, cdt, dev), dev)
    return gz, gr
