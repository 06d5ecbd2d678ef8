"""fp64 references and fp32 error bounds shared by the Triton backend's tests (CPU and CUDA).

Written from the definitions (no code shared with rlmath).

Tolerances (fp32 against fp64 of the same inputs), from the rounding of the
kernels' steps: ``z = x·(1/T)`` (2 ulp of ``|z|``), ``y = z - m`` (1 ulp of
``|y|``), ``exp`` (a few ulp), the sums (each partial sum 1 ulp relative) and
the final ``(z - m) - log s`` (2 ulp). So a log-prob, an entropy and every
``ls_j`` of a row are within ``delta = 8·eps·(|z|max + log V + 1)`` of the
exact values (``eps = 2^-24``, ``|z|max`` over the row's finite logits:
:func:`row_delta`), and ``p_j = exp(ls_j)`` within ``delta·p_j`` relative. A
gradient entry ``p·c/T`` (``c = alpha + beta·ls``) is then within
``delta·p·|c|/T``, plus the rounding of the label's ``p - 1`` and ``+ w``
(``4·eps·(Σ|g|)/T``); the KL and the fused head's sums follow from these
(:class:`KLRef`, the head test). Half-precision results add one rounding to
their dtype. The bounds sit 2 to 30 times above what the kernels reach and
orders of magnitude below a wrong formula.
"""

from __future__ import annotations

import math

import torch

from tests.logprobs.reference import log_softmax64

EPS = 2.0**-24
"""fp32 unit roundoff."""


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def logits_with_hard_cases(n: int, v: int, seed: int, *, scale: float = 3.0) -> torch.Tensor:
    """fp32 logits with the hard cases: padded (-inf) columns, an all-negative row."""
    g = gen(seed)
    x = torch.randn(n, v, generator=g) * scale
    x[0] = -1000.0 - 50.0 * torch.rand(v, generator=g)  # all-negative: max identity must be -inf
    x[:, v - 3 :] = float("-inf")  # padded vocabulary
    x[:, 1] = float("-inf")
    return x


def _temp_col(temp, n: int) -> torch.Tensor:
    """The temperature of each of ``n`` rows as an fp64 ``(n, 1)`` column."""
    if isinstance(temp, torch.Tensor):
        return temp.double().reshape(-1, 1).expand(n, 1)
    return torch.full((n, 1), float(temp), dtype=torch.float64)


def row_delta(z: torch.Tensor) -> torch.Tensor:
    """Per-row bound on the fp32 error of any ``ls_j`` or log-prob of scaled logits ``z`` (fp64).

    ``8·eps·(|z|max + log V + 1)``, from the rounding of the kernels' steps (module docstring).
    """
    zmax = torch.where(torch.isfinite(z), z.abs(), 0).amax(-1)
    return 8 * EPS * (zmax + math.log(z.shape[-1]) + 1)


def check(got: torch.Tensor, ref: torch.Tensor, tol, what: str) -> None:
    """``|got - ref| <= tol`` entrywise (``tol`` broadcasts; a NaN fails)."""
    err = (got.detach().cpu().double() - ref).abs()
    tol = torch.as_tensor(tol, dtype=torch.float64).expand_as(err)
    ok = err <= tol
    if not bool(ok.all()):
        worst = torch.where(ok, 0, err / tol.clamp_min(1e-300)).argmax()
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} entries beyond tolerance; worst "
            f"error {err.reshape(-1)[worst]:.3g} vs {tol.reshape(-1)[worst]:.3g}"
        )


class LogitsRef:
    """fp64 log-probs, entropy and gradient of ``Σ gl·logp + Σ ge·H``, with their fp32 bounds.

    From the definitions: ``∂logp_k/∂z = onehot_k - p``, ``∂H/∂z = -p·(ls + H)``,
    ``z = x / T``; ignored labels give 0, rows whose labels are all ignored
    give 0 and no gradient. ``extra`` adds a per-row error already in the
    logits (the fused head's matmul). Bounds: a log-prob or entropy is off by
    ``delta`` (:func:`row_delta`); a gradient entry ``p·c/T`` by ``delta·p·|c|/T``
    (the relative error of ``p`` and of ``ls`` in ``c``) plus the rounding of the
    label's ``p - 1`` and ``+ w``, ``4·eps·(Σ|gl| + |ge|)/T``.
    """

    def __init__(self, x, labels, temp, gl, ge, *, ignore=None, extra=None):
        labels = labels if labels.dim() == 2 else labels[:, None]
        n = x.shape[0]
        t = _temp_col(temp, n)
        z = x.double() / t
        ls = log_softmax64(z)
        p = ls.exp()
        H = -torch.where(p > 0, p * ls, 0).sum(-1)
        valid = torch.ones_like(labels, dtype=torch.bool) if ignore is None else labels != ignore
        live = valid.any(-1)
        safe = torch.where(valid, labels, 0)
        glv = torch.where(valid, gl.double().reshape(labels.shape), 0)
        ge_l = torch.where(live, ge.double(), 0)[:, None]
        onehot = torch.zeros_like(p).scatter_add_(-1, safe, glv)
        ls0 = torch.where(p > 0, ls, 0)
        gz = onehot - p * glv.sum(-1, keepdim=True) - p * (ls0 + H[:, None]) * ge_l
        self.lp = torch.where(valid, ls.gather(-1, safe), 0)
        self.H = torch.where(live, H, 0)
        self.grad = torch.where(live[:, None], gz, 0) / t
        delta = row_delta(z) + (extra if extra is not None else 0)
        self.tol = torch.where(live, delta, 0)
        a, b = glv.abs().sum(-1, keepdim=True), ge_l.abs()
        c = a + b * (ls0.abs() + H.abs()[:, None] + 2)
        self.grad_tol = (delta[:, None] * p * c + 4 * EPS * (a + b)) / t
        self.p = p


class KLRef:
    """fp64 KL and its gradients, ``∂/∂z = g·p·(ls_z - ls_r - KL)/T``, ``∂/∂r = g·(q - p)/T``.

    Bounds: the KL is off by the errors of both rows' ``ls`` (:func:`row_delta`)
    plus the cancellation in ``a/s - (log s_z - log s_r)``, a few ulp of
    ``log V``; ``∂/∂z`` by ``|g|·p·(δ_z·(|d| + 1) + δ_r + tol_KL)/T``; ``∂/∂r``
    by ``|g|·(q·δ_r + p·δ_z + eps·max(p, q))/T``.
    """

    def __init__(self, z, r, temp, gk):
        t = _temp_col(temp, z.shape[0])
        zz, rr = z.double() / t, r.double() / t
        lz, lr = log_softmax64(zz), log_softmax64(rr)
        p, q = lz.exp(), lr.exp()
        d = torch.where(p > 0, lz - lr, 0)
        self.kl = (p * d).sum(-1)
        gcol = gk.double()[:, None]
        dd = d - self.kl[:, None]
        self.gz = torch.where(p > 0, p * dd, 0) * gcol / t
        self.gr = (q - p) * gcol / t
        dz, dr = row_delta(zz)[:, None], row_delta(rr)[:, None]
        self.tol = (dz + dr)[:, 0] + 8 * EPS * math.log(z.shape[-1])
        ga = gcol.abs() / t
        self.gz_tol = ga * p * (dz * (dd.abs() + 1) + dr + self.tol[:, None])
        self.gr_tol = ga * (q * dr + p * dz + EPS * torch.maximum(p, q))
