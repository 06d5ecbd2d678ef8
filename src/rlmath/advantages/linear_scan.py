"""Reverse linear recurrences with a coefficient per element, by a pairwise (tree) scan.

:mod:`rlmath.advantages.scan` solves ``y[t] = x[t] + c · y[t+1]`` for one
scalar ``c``. Two estimators need a coefficient that varies: VAPO's
length-adaptive GAE (``c = γλ_i``, one ``λ`` per response) and GiGPO's
discounted step returns (``c = γ`` inside a trajectory and 0 where the next
row starts another trajectory). This module solves

    y[..., t] = x[..., t] + c[..., t] · y[..., t+1],      y[..., T] = 0

for any ``c`` broadcastable to ``x``, with the same halving structure as the
scalar scan: neighbours pair up into a half-length problem

    y[2i] = (x[2i] + c[2i]·x[2i+1]) + (c[2i]·c[2i+1]) · y[2i+2]

whose coefficients are the products of the pair's; solving it gives the even
slots, and each odd slot follows from its right neighbour. ``O(T)`` work,
``O(log T)`` sequential steps, only products and sums of coefficients (no
division), so ``c = 0`` (a segment boundary) and ``c = 1`` are exact in
structure. Products below the dtype's smallest normal number are flushed to
0, as in the scalar scan. Short tails are solved by a triangular product of
cumulative coefficient products. Nothing is read on the host.
"""

from __future__ import annotations

import torch

__all__ = ["reverse_linear_scan"]

# Below this length the recurrence is solved by one small triangular product.
_BASE_LENGTH = 32


def reverse_linear_scan(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``y[..., t] = x[..., t] + c[..., t] · y[..., t+1]`` (``y`` past the end is 0).

    A trusting core (the estimators validate): ``x`` is fp32 or fp64 of shape
    ``(*, T)``; ``c`` is broadcastable to it and in the same dtype (values in
    ``[0, 1]`` in every use here; ``c[..., T-1]`` multiplies nothing). Returns
    a new tensor of ``x``'s shape and dtype.
    """
    coef = torch.broadcast_to(c.to(x.dtype), x.shape)
    out = torch.empty_like(x)
    if x.shape[-1] > 0:
        _scan_into(x, coef, out)
    return out


def _flush(c: torch.Tensor) -> torch.Tensor:
    """``c`` with the magnitudes below the smallest normal number set to 0 (no denormals)."""
    return torch.where(c.abs() >= torch.finfo(c.dtype).tiny, c, torch.zeros_like(c))


def _base_solve(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``y[s] = Σ_{t ≥ s} (Π_{s ≤ k < t} c[k]) · x[t]`` for a short last axis."""
    n = x.shape[-1]
    steps = torch.arange(n, device=x.device)
    upper = steps[None, :] >= steps[:, None]  # [s, k]: k ≥ s
    # Row s of ``running`` is Π_{s ≤ k ≤ t} c[k] at column t (1 before s), so the
    # product that carries x[t] back to s, which stops at k = t − 1, is its
    # column t − 1 (and 1 at t = s).
    factors = torch.where(upper, c.unsqueeze(-2), torch.ones_like(c).unsqueeze(-2))
    running = _flush(torch.cumprod(factors, dim=-1))
    shifted = torch.cat([torch.ones_like(running[..., :1]), running[..., :-1]], dim=-1)
    matrix = torch.where(upper, shifted, torch.zeros_like(shifted))
    # A broadcast product and sum rather than a matmul: no TF32 or bf16 BLAS paths.
    return (matrix * x.unsqueeze(-2)).sum(-1)


def _scan_into(x: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> None:
    """Write the solution for ``(x, c)`` into ``out`` (same shape, possibly a strided view)."""
    n = x.shape[-1]
    if n <= _BASE_LENGTH:
        out.copy_(_base_solve(x, c))
        return
    n_even, n_odd = (n + 1) // 2, n // 2
    pairs = x.new_empty((*x.shape[:-1], n_even))
    pair_c = c.new_empty((*c.shape[:-1], n_even))
    x_even, x_odd = x[..., 0 : 2 * n_odd : 2], x[..., 1 : 2 * n_odd : 2]
    c_even, c_odd = c[..., 0 : 2 * n_odd : 2], c[..., 1 : 2 * n_odd : 2]
    torch.addcmul(x_even, c_even, x_odd, out=pairs[..., :n_odd])
    pair_c[..., :n_odd] = _flush(c_even * c_odd)
    if n_even > n_odd:
        pairs[..., n_odd] = x[..., n - 1]
        pair_c[..., n_odd] = c[..., n - 1]
    y_even = out[..., 0::2]
    _scan_into(pairs, pair_c, y_even)
    y_odd = out[..., 1::2]
    # Odd slots with an even slot to their right; for even n the last odd slot
    # is the sequence end and has none.
    k = n_odd if n_even > n_odd else n_odd - 1
    torch.addcmul(
        x[..., 1 : 2 * k : 2], c[..., 1 : 2 * k : 2], y_even[..., 1 : k + 1], out=y_odd[..., :k]
    )
    if k < n_odd:
        y_odd[..., k] = x[..., n - 1]
