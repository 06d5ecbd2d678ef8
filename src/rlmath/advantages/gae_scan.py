"""The GAE recurrence as a ``torch.library`` operator (``torch.ops.rlmath.gae_scan``).

One opaque node for ``torch.compile`` (the scan writes into strided views of
private buffers, which a compiler cannot trace), with a ``vmap`` rule that
folds vmapped dims into rows (every row is independent). The annotations are
runtime objects in the forms every supported torch infers a schema from.
"""

from typing import List, Optional, Tuple  # noqa: F401  (schema inference reads them)

import torch
from torch.library import register_vmap

from rlmath._operators import operator
from rlmath._threads import call_with_threads, threads_for
from rlmath._validation import result_dtype
from rlmath.advantages._common import ValidTokens
from rlmath.advantages.scan import _reverse_scan

__all__ = ["gae_scan"]


@operator("rlmath::gae_scan")
def gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, gamma_lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwhitened GAE ``(advantages, returns)`` of ``(B, T)`` inputs (``valid`` a bool mask).

    A ``torch.library`` operator: one opaque node for ``torch.compile`` (the
    scan writes into strided views of private buffers), with a ``vmap`` rule
    that folds vmapped dims into rows (every row is independent).
    """
    # Hundreds of small ops: one thread for small inputs (see rlmath._threads).
    threads = threads_for(rewards.numel(), rewards.device)
    return call_with_threads(threads, _gae_scan, rewards, values, valid, gamma, gamma_lam)  # type: ignore[no-any-return]


def _gae_scan(
    rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, gamma: float, gamma_lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = result_dtype(rewards, values)
    # Pack each row's valid tokens to the left (masked entries never reach a
    # valid column), so the recursion below is a plain constant-coefficient
    # recurrence over packed columns; column T stays 0 throughout.
    tokens = ValidTokens(valid)
    r_packed, v_packed = tokens.pack(rewards, dtype), tokens.pack(values, dtype)
    length = tokens.length
    # δ[k] = r[k] + γ·V[k+1] − V[k] (packed column k+1 holds the next valid
    # value), then A = scan(δ) and returns A + V, all in the packed buffers.
    delta = r_packed
    torch.add(r_packed[:, :length], v_packed[:, 1:], alpha=gamma, out=delta[:, :length])
    delta[:, :length].sub_(v_packed[:, :length])
    adv_packed = _reverse_scan(delta, gamma_lam, inplace=True)
    advantages = tokens.unpack(adv_packed)
    returns = tokens.unpack(v_packed.add_(adv_packed))
    return advantages, returns


@gae_scan.register_fake
def _(rewards, values, valid, gamma, gamma_lam):
    dtype = result_dtype(rewards, values)
    return rewards.new_empty(rewards.shape, dtype=dtype), rewards.new_empty(
        rewards.shape, dtype=dtype
    )


def _gae_scan_vmap(info, in_dims, rewards, values, valid, gamma, gamma_lam):
    def batched(x, d):
        return x.movedim(d, 0) if d is not None else x.expand(info.batch_size, *x.shape)

    r, v, m = (batched(x, d) for x, d in zip((rewards, values, valid), in_dims[:3], strict=True))
    shape = r.shape
    adv, ret = gae_scan(*(x.reshape(-1, x.shape[-1]) for x in (r, v, m)), gamma, gamma_lam)
    return (adv.view(shape), ret.view(shape)), (0, 0)


register_vmap(gae_scan, _gae_scan_vmap)
