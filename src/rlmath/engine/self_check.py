"""The check a backend passes before ``backend="auto"`` chooses it: agreement with pure torch.

A backend registered with ``checked=True`` (the Triton backend) runs each
family of its kernels once per process, device and dtype on a small input,
forward and backward through the public functions, and compares values and
gradients with the pure-torch backend's. ``"auto"`` chooses it for that
family only when they agree; when they do not, or when a kernel fails to
compile or run, ``"auto"`` takes the next backend (pure torch) and warns
once. The families are the groups of passes one public function uses:

- ``"logits"``: log-probs and entropy from logits (dense rows, rows read
  through an offset table, the packed rows of a response),
- ``"kept"``: the same under a sampler's kept set (a threshold search with
  ``top_k`` and ``top_p``, a replayed set of token ids),
- ``"kl"``: the exact KL and both gradients,
- ``"pi_squared"``: ``Σ π²``,
- ``"head"``: the fused LM head, forward and backward.

Tolerances: both backends compute in fp32 from the same inputs, so values
agree to a few fp32 roundings of ``log V`` and ``|z|`` (``1e-4`` relative
and absolute is 800 ulps there, orders of magnitude below a wrong formula);
gradients in half precision are each rounded once to the input's dtype by
both backends, so they agree within two of its units in the last place
relative to the row's largest entry. The check costs a few milliseconds on
a GPU (a few kernel compilations the first time) and synchronizes with the
host once, when it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FAMILIES", "compare", "run_self_check"]

Outputs = list[torch.Tensor | None]


def _data(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int, scale: float = 2.0
) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


def _logits(backend: str, dtype: torch.dtype, device: torch.device) -> Outputs:
    import rlmath as R

    B, S, V = 2, 5, 4160  # a width over one block of fp32 and a multiple of 16
    x = _data((B, S, V), dtype, device, 1)
    x[0, 0, 7] = float("-inf")
    labels = torch.randint(0, V, (B, S - 1), generator=torch.Generator().manual_seed(2)).to(device)
    temp = (torch.rand(B, S - 1, generator=torch.Generator().manual_seed(3)) + 0.5).to(device)
    leaf = x.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(
        leaf[:, :-1], labels, temperature=temp, backend=backend
    )
    (lp.sum() + 0.5 * ent.sum()).backward()
    flat = x.reshape(B * S, V).clone().requires_grad_()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones(B, S, dtype=torch.long, device=device)
    lp_packed = R.log_probs_from_logits_response_rmpad(ids, mask, flat, 3, backend=backend)
    lp_packed.sum().backward()
    return [lp, ent, leaf.grad, lp_packed, flat.grad]


def _kl(backend: str, dtype: torch.dtype, device: torch.device) -> Outputs:
    import rlmath as R

    z = _data((6, 4160), dtype, device, 5).requires_grad_()
    r = _data((6, 4160), dtype, device, 6).requires_grad_()
    kl = R.kl_from_logits(z, r, temperature=0.8, backend=backend)
    kl.sum().backward()
    return [kl, z.grad, r.grad]


def _pi_squared(backend: str, dtype: torch.dtype, device: torch.device) -> Outputs:
    import rlmath as R

    x = _data((6, 4160), dtype, device, 7)
    return [R.sum_pi_squared_from_logits(x, temperature=0.9, backend=backend)]


def _head(backend: str, dtype: torch.dtype, device: torch.device) -> Outputs:
    import rlmath as R

    N, H, V = 16, 64, 4160
    h = _data((N, H), dtype, device, 8, 1.0).requires_grad_()
    w = _data((V, H), dtype, device, 9, 0.125).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(10)).to(device)
    lp, ent = R.log_probs_and_entropy_from_hidden(
        h, w, labels, vocab_chunk_size=1024, backend=backend
    )
    assert ent is not None
    (lp.sum() + 0.5 * ent.sum()).backward()
    return [lp, ent, h.grad, w.grad]


def _kept(backend: str, dtype: torch.dtype, device: torch.device) -> Outputs:
    import rlmath as R

    B, S, V = 2, 5, 4160
    x = _data((B, S, V), dtype, device, 11)
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(12)).to(device)
    temp = (torch.rand(B, S, generator=torch.Generator().manual_seed(13)) + 0.5).to(device)
    leaf = x.clone().requires_grad_()
    out = R.log_probs_and_entropy_from_logits(
        leaf, labels, temperature=temp, top_k=200, top_p=0.9, kept_stats=True, backend=backend
    )
    assert out.entropy is not None
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    ids = torch.randint(0, V, (B, S, 40), generator=torch.Generator().manual_seed(14)).to(device)
    flat = x.reshape(B * S, V).clone().requires_grad_()
    lp = R.log_probs_from_logits(
        flat, labels.reshape(-1), kept=ids.reshape(B * S, 40), backend=backend
    )
    lp.sum().backward()
    return [out.log_probs, out.entropy, out.kept_count.double(), leaf.grad, lp, flat.grad]


FAMILIES: dict[str, Callable[[str, torch.dtype, torch.device], Outputs]] = {
    "logits": _logits,
    "kept": _kept,
    "kl": _kl,
    "pi_squared": _pi_squared,
    "head": _head,
}
"""Each family's small run: ``(backend, dtype, device) -> [values..., gradients...]``."""


def compare(got: Outputs, want: Outputs) -> str | None:
    """``None`` when ``got`` matches ``want`` (the pure-torch outputs) entry by entry, else why not.

    fp32 tensors within ``1e-4·(1 + |want|)``; half-precision ones within two
    units in the last place of their dtype times the tensor's largest entry
    (see the module docstring).
    """
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None or b is None or a.shape != b.shape:
            shapes = [None if t is None else tuple(t.shape) for t in (a, b)]
            return f"output {i}: shape {shapes[0]} != {shapes[1]}"
        a64, b64 = a.detach().double(), b.detach().double()
        if a.dtype in (torch.float16, torch.bfloat16):
            ulp = torch.finfo(a.dtype).eps
            scale = b64.abs().nan_to_num(posinf=0.0).amax() if b64.numel() else 0.0
            tol = 2 * ulp * (scale + b64.abs().nan_to_num(posinf=0.0))
        else:
            tol = 1e-4 * (1 + b64.abs().nan_to_num(posinf=0.0))
        same_special = (a64.isnan() & b64.isnan()) | (a64.isinf() & (a64 == b64))
        bad = ~(same_special | ((a64 - b64).abs() <= tol))
        if bool(bad.any()):
            j = int(bad.reshape(-1).nonzero()[0])
            return (
                f"output {i}: {int(bad.sum())} of {bad.numel()} entries differ "
                f"(first: {float(a64.reshape(-1)[j]):.6g} vs {float(b64.reshape(-1)[j]):.6g})"
            )
    return None


def run_self_check(
    backend: str, family: str, dtype: torch.dtype, device: torch.device
) -> str | None:
    """Run ``family`` on ``backend`` and on the pure-torch backend: ``None`` if they agree, else why not."""
    run = FAMILIES[family]
    try:
        got = run(backend, dtype, device)
    except Exception as exc:  # a compile or launch failure: the reason, then the fallback
        first = str(exc).strip().splitlines()[:1]
        return f"{type(exc).__name__}: {first[0] if first else ''}"
    want = run("torch", dtype, device)
    return compare(got, want)
