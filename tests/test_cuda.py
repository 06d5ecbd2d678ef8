"""The vocabulary functions on a CUDA device: same values and gradients as on CPU, no host sync.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``. The CPU suite proves the math; the
first tests prove the device-independent code really is device independent
(every buffer, constant and index tensor follows the input's device, and the
forward and backward passes never read device data on the host), for the
pure-torch backend and, where ``triton`` imports, the Triton one. The last
section tests the Triton kernels themselves: every kernel against fp64 in
fp32, bf16 and fp16, determinism, batch invariance, the memory bound, large
vocabularies and row counts, and that a new temperature never recompiles.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os

import pytest
import torch

import rlmath as R
from rlmath.engine import available_backends
from tests.engine.triton_reference import EPS, KLRef, LogitsRef, check, gen, row_delta

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"

BACKENDS = ["torch"]
if importlib.util.find_spec("triton") is not None and not os.environ.get("TRITON_INTERPRET"):
    BACKENDS.append("triton")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Each backend that can run here (the Triton one where triton imports)."""
    if request.param not in available_backends(torch.empty(1, device=DEV)):
        pytest.skip(f"the {request.param!r} backend cannot run on this device")
    return request.param


@contextlib.contextmanager
def no_sync():
    """Raise on any synchronizing CUDA call (``.item()``, ``nonzero``, ...)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _ref_lp_ent(x: torch.Tensor, labels: torch.Tensor, temperature=1.0):
    ls = torch.log_softmax(x.double() / temperature, -1)
    plogp = torch.where(ls == float("-inf"), 0.0, ls.exp() * ls)  # 0·log 0 = 0
    return ls.gather(-1, labels[..., None]).squeeze(-1), -plogp.sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 1000), (5, 151936), (2, 9, 50257)])
def test_log_probs_and_entropy_values_and_grads(dtype, shape, backend):
    g = torch.Generator().manual_seed(0)
    x_cpu = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x_cpu[..., :7] = float("-inf")  # padded vocabulary
    labels_cpu = torch.randint(7, shape[-1], shape[:-1], generator=g)
    gl, ge = torch.randn(shape[:-1], generator=g), torch.randn(shape[:-1], generator=g)
    temp = 0.7
    x = x_cpu.to(DEV).requires_grad_()
    labels, gl_d, ge_d = labels_cpu.to(DEV), gl.to(DEV), ge.to(DEV)
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_logits(x, labels, temperature=temp, backend=backend)
        (lp * gl_d + ent * ge_d).sum().backward()
    rlp, rent = _ref_lp_ent(x_cpu, labels_cpu, temp)
    # d logp/dz = onehot - p, dH/dz = -p·(ls + H), and z = x / T (written out: autograd
    # through the reference's 0·log 0 would give NaN at the -inf logits).
    ls = torch.log_softmax(x_cpu.double() / temp, -1)
    p = ls.exp()
    onehot = torch.zeros_like(p).scatter_(-1, labels_cpu[..., None], 1.0)
    lsf = ls.clamp_min(-1e4)
    gref = (
        gl.double()[..., None] * (onehot - p) - ge.double()[..., None] * p * (lsf + rent[..., None])
    ) / temp
    assert lp.dtype == torch.float32 and lp.device.type == "cuda"
    torch.testing.assert_close(lp.cpu().double(), rlp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.cpu().double(), rent, atol=2e-5, rtol=0)
    gref = gref.to(dtype).double()  # the gradient is returned in the logits' dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.cpu().double(), gref, atol=tol, rtol=tol)


def test_kl_from_logits_and_temperature_tensor(backend):
    g = torch.Generator().manual_seed(1)
    z, r = torch.randn(64, 3001, generator=g), torch.randn(64, 3001, generator=g)
    t = torch.rand(64, generator=g) + 0.5
    zc = z.to(DEV).requires_grad_()
    rc, tc = r.to(DEV), t.to(DEV)
    with no_sync():
        kl = R.kl_from_logits(zc, rc, temperature=tc, backend=backend)
        kl.sum().backward()
    zr = z.double().requires_grad_()
    lz = torch.log_softmax(zr / t.double()[:, None], -1)
    lr = torch.log_softmax(r.double() / t.double()[:, None], -1)
    ref = (lz.exp() * (lz - lr)).sum(-1)
    ref.sum().backward()
    torch.testing.assert_close(kl.cpu().double(), ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(zc.grad.cpu().double(), zr.grad, atol=1e-6, rtol=1e-5)


def test_response_rmpad_matches_dense(backend):
    g = torch.Generator().manual_seed(2)
    B, S, V, Rl = 4, 12, 517, 5
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    logits = torch.randn(B, S, V, generator=g)
    dense = R.log_probs_from_logits_response(ids.to(DEV), logits.to(DEV), Rl, backend=backend)
    packed_rows = mask.bool().view(-1)
    logits_rmpad = logits.view(B * S, V)[packed_rows]
    packed = R.log_probs_from_logits_response_rmpad(
        ids.to(DEV), mask.to(DEV), logits_rmpad.to(DEV), Rl, backend=backend
    )
    torch.testing.assert_close(packed, dense)
    assert packed.device.type == "cuda"


def test_packed_response_functions_do_not_sync(backend):
    g = torch.Generator().manual_seed(5)
    B, S, V, Rl = 3, 10, 313, 4
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    mask[2, 4] = 0
    nnz = int(mask.sum())
    packed = torch.randn(nnz, V, generator=g)
    idx = mask.view(-1).nonzero().squeeze(1)
    temp = torch.rand(B, 1, generator=g) + 0.5
    ids_d, mask_d, idx_d, temp_d = (t.to(DEV) for t in (ids, mask, idx, temp))
    ids_p = ids_d.view(-1)[idx_d]
    leaves = [packed.to(DEV).requires_grad_() for _ in range(2)]
    kw = {"temperature": temp_d, "backend": backend}
    R.log_probs_from_logits_response_rmpad(ids_d, mask_d, leaves[0], Rl, **kw).sum().backward()
    leaves[0].grad = None  # that was the warm-up
    with no_sync():
        a = R.log_probs_from_logits_response_rmpad(ids_d, mask_d, leaves[0], Rl, **kw)
        b = R.log_probs_from_logits_all_rmpad(ids_p, leaves[1], idx_d, B, S, Rl, **kw)
        (a.sum() + b.sum()).backward()
    cpu = packed.clone().requires_grad_()
    want = R.log_probs_from_logits_response_rmpad(
        ids, mask, cpu, Rl, temperature=temp, backend="torch"
    )
    want.sum().backward()
    for got in (a, b):
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    for leaf in leaves:
        torch.testing.assert_close(leaf.grad.cpu(), cpu.grad, atol=1e-5, rtol=1e-5)


def test_ignored_labels_do_not_sync_and_give_zero_gradient(backend):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 1000, generator=g)
    x[5] = float("nan")
    labels = torch.randint(0, 1000, (64,), generator=g)
    labels[5] = -100
    xd = x.to(DEV).requires_grad_()
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_logits(
            xd, labels.to(DEV), ignore_index=-100, backend=backend
        )
        (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(xd.grad).all() and (xd.grad[5] == 0).all()
    assert lp[5] == 0 and ent[5] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_matches_unfused(dtype, backend):
    g = torch.Generator().manual_seed(3)
    N, H, V = 300, 64, 5003
    h = (torch.randn(N, H, generator=g)).to(dtype)
    w = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    hc, wc, bc = (t.to(DEV).requires_grad_() for t in (h, w, b))
    lab_d, gl_d, ge_d = labels.to(DEV), gl.to(DEV), ge.to(DEV)
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_hidden(
            hc, wc, lab_d, bias=bc, temperature=0.9, chunk_size=128, backend=backend
        )
        (lp * gl_d + ent * ge_d).sum().backward()
    hr, wr, br = (t.double().requires_grad_() for t in (h, w, b))
    valid = labels != -100
    logits = hr @ wr.T + br
    rlp, rent = _ref_lp_ent(logits, labels.clamp_min(0), 0.9)
    rlp, rent = rlp * valid, rent * valid
    (rlp * gl.double() + rent * ge.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(lp.cpu().double(), rlp.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(ent.cpu().double(), rent.detach(), atol=tol, rtol=tol)
    for got, ref in ((hc, hr), (wc, wr), (bc, br)):
        scale = ref.grad.abs().max().item()
        err = (got.grad.cpu().double() - ref.grad).abs().max().item()
        assert err <= (1e-5 if dtype == torch.float32 else 3e-2) * max(scale, 1.0)


def test_advantages_match_cpu():
    g = torch.Generator().manual_seed(4)
    B, T = 16, 33
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    rd, vd, md = rewards.to(DEV), values.to(DEV), mask.to(DEV)
    with no_sync():
        adv, ret = R.compute_gae_advantage_return(rd, vd, md, 0.99, 0.95)
    cadv, cret = R.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv.cpu(), cadv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu(), cret, atol=1e-5, rtol=1e-5)
    index = torch.arange(B) // 4
    a_gpu, _ = R.compute_grpo_outcome_advantage(rewards.to(DEV), mask.to(DEV), index.to(DEV))
    a_cpu, _ = R.compute_grpo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(a_gpu.cpu(), a_cpu, atol=1e-5, rtol=1e-5)


def test_memory_is_bounded_on_device(backend):
    """Peak allocation of log-probs + entropy fwd+bwd stays near logits + gradient."""
    N, V = 4096, 32000
    x = torch.randn(N, V, device=DEV).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = R.log_probs_and_entropy_from_logits(x, labels, backend=backend)
    (lp + ent).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.numel() * 4  # minus the gradient
    assert extra <= 0.10 * x.numel() * 4


# ------------------------------------------------------------------ the Triton kernels

HALF_UNIT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
"""Unit roundoff of a result rounded to the dtype (gradients come back in the logits' dtype)."""


def rounded_tol(ref: torch.Tensor, tol: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bound ``tol`` of an fp32 result, after that result is rounded to ``dtype``.

    Round to nearest moves a value ``y`` by at most ``u·|y|`` (``u`` the unit
    roundoff), or half the subnormal spacing below the smallest normal number;
    ``|y| <= |ref| + tol``.
    """
    u = HALF_UNIT[dtype]
    if u == 0.0:
        return tol
    return tol + u * (ref.abs() + tol) + torch.finfo(dtype).smallest_normal * u


needs_triton = pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not installed")


@pytest.fixture
def triton_kernels():
    """The compiled (not interpreted) Triton backend, or a skip saying why not."""
    if "triton" not in available_backends(torch.empty(1, device=DEV)):
        pytest.skip("the Triton backend cannot run on this device")
    import rlmath.engine.triton_backend as tb

    if tb.INTERPRETED:
        pytest.skip("the Triton backend was imported under TRITON_INTERPRET=1")
    return tb


def _hard_logits(n: int, v: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = gen(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype)
    x[0] = (-60.0 - 5 * torch.rand(v, generator=g)).to(dtype)  # all-negative (fp16-safe)
    x[:, -5:] = float("-inf")  # padded vocabulary
    return x


@needs_triton
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("how", ["top_k top_p", "min_p", "ids"])
def test_triton_kept_sets_match_the_torch_backend(triton_kernels, dtype, how):
    """A sampler's kept set on the compiled kernels: the same kept set as the torch backend's
    search (sizes and ``outside`` equal), values and gradients within the fp32 bounds."""
    n, v = 16, 151936
    x = _hard_logits(n, v, 32, dtype)
    g = gen(33)
    labels = torch.randint(0, v - 5, (n,), generator=g)
    temp = torch.rand(n, generator=g) + 0.5
    kw = {
        "top_k top_p": dict(top_k=50, top_p=0.9),
        "min_p": dict(min_p=0.05),
        "ids": dict(kept=torch.randint(0, v - 5, (n, 40), generator=g).to(DEV)),
    }[how]
    out = {}
    for be in ("torch", "triton"):
        xd = x.to(DEV).requires_grad_()
        res = R.log_probs_and_entropy_from_logits(
            xd, labels.to(DEV), temperature=temp.to(DEV), kept_stats=True, backend=be, **kw
        )
        (res.log_probs.sum() + 0.5 * res.entropy.sum()).backward()
        out[be] = res, xd.grad
    (a, ga), (b, gb) = out["triton"], out["torch"]
    assert torch.equal(a.kept_count, b.kept_count) and torch.equal(a.outside, b.outside)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        ga.float(), gb.float(), atol=2e-3 if dtype != torch.float32 else 1e-5, rtol=1e-2
    )


@needs_triton
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("n,v", [(64, 1000), (8, 151936), (4, 262144)])
def test_triton_log_probs_entropy_against_fp64(triton_kernels, dtype, n, v):
    x = _hard_logits(n, v, 30, dtype)
    g = gen(31)
    labels = torch.randint(0, v - 5, (n,), generator=g)
    labels[3 % n] = -100
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    temp = torch.rand(n, generator=g) + 0.5
    xd = x.to(DEV).requires_grad_()
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_logits(
            xd, labels.to(DEV), temperature=temp.to(DEV), ignore_index=-100, backend="triton"
        )
        (lp * gl.to(DEV) + ent * ge.to(DEV)).sum().backward()
    ref = LogitsRef(x.double(), labels, temp, gl, ge, ignore=-100)
    check(lp, ref.lp[:, 0], ref.tol, f"{dtype} log-probs")
    check(ent, ref.H, ref.tol, f"{dtype} entropy")
    assert xd.grad.dtype == dtype
    check(xd.grad, ref.grad, rounded_tol(ref.grad, ref.grad_tol, dtype), f"{dtype} gradient")
    assert (xd.grad[:, -5:] == 0).all() and (xd.grad[3 % n] == 0).all()


@needs_triton
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_triton_kl_and_sum_pi_squared_against_fp64(triton_kernels, dtype):
    n, v = 48, 50000
    g = gen(32)
    z = (torch.randn(n, v, generator=g) * 2).to(dtype)
    r = (z.float() + 0.3 * torch.randn(n, v, generator=g)).to(dtype)
    z[:, -4:] = r[:, -4:] = float("-inf")
    temp = torch.rand(n, generator=g) + 0.5
    gk = torch.randn(n, generator=g)
    zd, rd = z.to(DEV).requires_grad_(), r.to(DEV).requires_grad_()
    with no_sync():
        kl = R.kl_from_logits(zd, rd, temperature=temp.to(DEV), backend="triton")
        (kl * gk.to(DEV)).sum().backward()
        pi2 = R.sum_pi_squared_from_logits(zd.detach(), temperature=temp.to(DEV), backend="triton")
    ref = KLRef(z.double(), r.double(), temp, gk)
    check(kl, ref.kl, ref.tol, f"{dtype} KL")
    check(zd.grad, ref.gz, rounded_tol(ref.gz, ref.gz_tol, dtype), f"{dtype} KL grad z")
    check(rd.grad, ref.gr, rounded_tol(ref.gr, ref.gr_tol, dtype), f"{dtype} KL grad r")
    zz = z.double() / temp.double()[:, None]
    p = torch.log_softmax(zz, -1).exp()
    want = (p * p).sum(-1)
    check(pi2, want, 4 * row_delta(zz) * want, f"{dtype} Σπ²")


def _head_case(n, h, v, dtype, seed):
    g = gen(seed)
    hid = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) / h**0.5 * 2).to(dtype)
    b = torch.randn(v, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::9] = -100
    return hid, w, b, labels, torch.randn(n, generator=g), torch.randn(n, generator=g)


@needs_triton
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_triton_fused_head_against_fp64(triton_kernels, dtype, monkeypatch):
    # Full-precision reductions inside cuBLAS (torch's default allows half-precision
    # ones in split-K half GEMMs, whose error the bounds below do not cover).
    for flag in (
        "allow_bf16_reduced_precision_reduction",
        "allow_fp16_reduced_precision_reduction",
    ):
        monkeypatch.setattr(torch.backends.cuda.matmul, flag, False)
    n, H, v = 700, 128, 20011
    hid, w, b, labels, gl, ge = _head_case(n, H, v, dtype, 33)
    temp = 0.9
    leaves = [t.to(DEV).requires_grad_() for t in (hid, w, b)]
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_hidden(
            *leaves[:2], labels.to(DEV), bias=leaves[2], temperature=temp, backend="triton"
        )
        (lp * gl.to(DEV) + ent * ge.to(DEV)).sum().backward()
    live = (labels != -100)[:, None]
    h64, w64, b64 = torch.where(live, hid.double(), 0), w.double(), b.double()
    x = h64 @ w64.T + b64
    # A logits block comes out of the matmul rounded to the inputs' dtype (as
    # `hidden @ weight.T` would), after H products summed in fp32.
    u = HALF_UNIT[dtype]
    mm = H * EPS * ((h64.abs() @ w64.abs().T) + b64.abs()).amax(-1) + u * x.abs().amax(-1)
    ref = LogitsRef(x, labels, temp, gl, ge, ignore=-100, extra=2 * mm / temp)
    check(lp, ref.lp[:, 0], ref.tol, f"{dtype} head log-probs")
    check(ent, ref.H, ref.tol, f"{dtype} head entropy")
    # The logits gradient is rounded to the dtype before the matmuls (in E), whose
    # sums over V (or N) terms accumulate in fp32; a half result is rounded once more.
    G, E = ref.grad, rounded_tol(ref.grad, ref.grad_tol, dtype)
    for got, want, tol, what in (
        (leaves[0].grad, G @ w64, E @ w64.abs() + (v + 1) * EPS * (G.abs() @ w64.abs()), "grad hidden"),
        (leaves[1].grad, G.T @ h64, E.T @ h64.abs() + (n + 1) * EPS * (G.abs().T @ h64.abs()), "grad weight"),
        (leaves[2].grad, G.sum(0), E.sum(0) + (n + 1) * EPS * G.abs().sum(0), "grad bias"),
    ):  # fmt: skip
        assert got.dtype == dtype
        check(got, want, rounded_tol(want, tol, dtype), f"{dtype} head {what}")


@needs_triton
def test_triton_is_deterministic(triton_kernels):
    """Two runs give bitwise equal values and gradients (no atomics anywhere)."""
    x = _hard_logits(512, 32000, 34, torch.bfloat16).to(DEV)
    labels = torch.randint(0, 31995, (512,), device=DEV)
    hid, w, b, lab_h, _, _ = _head_case(2048, 256, 32000, torch.bfloat16, 35)
    outs = []
    for _ in range(2):
        xd = x.clone().requires_grad_()
        lp, ent = R.log_probs_and_entropy_from_logits(xd, labels, backend="triton")
        (lp.sum() + ent.sum()).backward()
        kl = R.kl_from_logits(x, x.flip(0), backend="triton")
        leaves = [t.to(DEV).requires_grad_() for t in (hid, w, b)]
        hlp, hent = R.log_probs_and_entropy_from_hidden(
            *leaves[:2], lab_h.to(DEV), bias=leaves[2], backend="triton"
        )
        (hlp.sum() + hent.sum()).backward()
        outs.append([lp, ent, xd.grad, kl, hlp, hent, *(t.grad for t in leaves)])
    for a, c in zip(*outs, strict=True):
        assert torch.equal(a, c)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_results_of_a_row_do_not_depend_on_the_batch(triton_kernels, dtype):
    """A row's values and gradient are bitwise the same alone (N = 1) and among 4096 rows."""
    N, V = 4096, 32000
    x = _hard_logits(N, V, 36, dtype).to(DEV)
    labels = torch.randint(0, V - 5, (N,), device=DEV)
    full = x.clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(full, labels, backend="triton")
    (lp.sum() + ent.sum()).backward()
    kl = R.kl_from_logits(x, x.roll(1, 0), backend="triton")
    hid, w, _, lab_h, _, _ = _head_case(N, 256, V, dtype, 37)
    hd, wd = hid.to(DEV), w.to(DEV)
    hlp, hent = R.log_probs_and_entropy_from_hidden(hd, wd, lab_h.to(DEV), backend="triton")
    for i in (0, 1, 2047, N - 1):
        one = x[i : i + 1].clone().requires_grad_()
        lp1, ent1 = R.log_probs_and_entropy_from_logits(one, labels[i : i + 1], backend="triton")
        (lp1.sum() + ent1.sum()).backward()
        assert torch.equal(lp1[0], lp[i]) and torch.equal(ent1[0], ent[i])
        assert torch.equal(one.grad[0], full.grad[i])
        kl1 = R.kl_from_logits(x[i : i + 1], x.roll(1, 0)[i : i + 1], backend="triton")
        assert torch.equal(kl1[0], kl[i])
        h1, e1 = R.log_probs_and_entropy_from_hidden(
            hd[i : i + 1], wd, lab_h[i : i + 1].to(DEV), backend="triton"
        )
        # The vocabulary tiles do not depend on N; the logits come from cuBLAS.
        assert torch.equal(h1[0], hlp[i]) and torch.equal(e1[0], hent[i])


@needs_triton
def test_triton_many_rows_and_a_large_vocabulary(triton_kernels):
    """70000 rows (more than a 65535-wide grid dimension) and V = 262144, against the torch pass."""
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(70000, 512, device=DEV, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 512, (70000,), device=DEV, generator=g)
    lp_t, ent_t = R.log_probs_and_entropy_from_logits(x, labels, backend="triton")
    lp_r, ent_r = R.log_probs_and_entropy_from_logits(x, labels, backend="torch")
    torch.testing.assert_close(lp_t, lp_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_t, ent_r, atol=1e-5, rtol=0)
    assert torch.isfinite(lp_t[-1000:]).all()  # the last rows were computed
    big = torch.randn(16, 262144, device=DEV, generator=g)
    lab = torch.randint(0, 262144, (16,), device=DEV, generator=g)
    lp_t = R.log_probs_from_logits(big, lab, backend="triton")
    lp_64 = torch.log_softmax(big.double(), -1).gather(-1, lab[:, None]).squeeze(-1)
    assert (lp_t.double() - lp_64).abs().max().item() <= 8 * EPS * (6 + math.log(262144) + 1)


@needs_triton
def test_triton_memory_bounds(triton_kernels):
    """Logits: nothing beyond the gradient and O(N) statistics. Head: blocks within 10 % of fp32 logits."""
    N, V = 4096, 32000
    x = torch.randn(N, V, device=DEV).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)
    R.log_probs_and_entropy_from_logits(x[:8], labels[:8], backend="triton")  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = R.log_probs_and_entropy_from_logits(x, labels, backend="triton")
    (lp + ent).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.numel() * 4  # minus the gradient
    assert extra <= 64 * N * 4  # a few (N,) vectors
    del x, lp, ent
    n, H, v = 8192, 1024, 65536
    hid, w, _, lab, gl, ge = _head_case(n, H, v, torch.bfloat16, 38)
    hd, wd, lab = hid.to(DEV).requires_grad_(), w.to(DEV).requires_grad_(), lab.to(DEV)
    R.log_probs_and_entropy_from_hidden(hd[:8], wd, lab[:8], backend="triton")  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = R.log_probs_and_entropy_from_hidden(hd, wd, lab, backend="triton")
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    grads = (hd.numel() + wd.numel()) * 2
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert extra <= min(0.10 * n * v * 4, 512 * 2**20)


def _compiled_count(kernel) -> int | None:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    cache = getattr(kernel, "cache", None)
    return sum(len(c) for c in cache.values()) if isinstance(cache, dict) else None


@needs_triton
def test_triton_new_temperatures_do_not_recompile(triton_kernels):
    from rlmath.engine.triton_backend import logits_backward, logits_forward

    x = torch.randn(32, 1000, device=DEV).requires_grad_()
    labels = torch.randint(0, 1000, (32,), device=DEV)
    kernels = (logits_forward._logits_stats_kernel, logits_backward._logits_grad_kernel)

    def run(temp):
        R.log_probs_and_entropy_from_logits(x, labels, temperature=temp, backend="triton")[
            0
        ].sum().backward()

    run(0.7)
    run(torch.full((32,), 0.7, device=DEV))
    before = [_compiled_count(k) for k in kernels]
    if None in before:
        pytest.skip("this triton version does not expose its kernel cache")
    for t in (0.3, 1.7, torch.rand(32, device=DEV) + 0.5, torch.rand(32, device=DEV) + 2):
        run(t)
    assert [_compiled_count(k) for k in kernels] == before
