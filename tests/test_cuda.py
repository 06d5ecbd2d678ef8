"""The pure-torch paths on a CUDA device: same values and gradients as on CPU, no host sync.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``. The CPU suite proves the math; these
tests prove the device-independent code really is device independent: every
buffer, constant and index tensor follows the input's device, and the forward
and backward passes never read device data on the host.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import rlmath as R

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"


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
def test_log_probs_and_entropy_values_and_grads(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x_cpu = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x_cpu[..., :7] = float("-inf")  # padded vocabulary
    labels_cpu = torch.randint(7, shape[-1], shape[:-1], generator=g)
    gl, ge = torch.randn(shape[:-1], generator=g), torch.randn(shape[:-1], generator=g)
    temp = 0.7
    x = x_cpu.to(DEV).requires_grad_()
    labels, gl_d, ge_d = labels_cpu.to(DEV), gl.to(DEV), ge.to(DEV)
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_logits(x, labels, temperature=temp)
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


def test_kl_from_logits_and_temperature_tensor():
    g = torch.Generator().manual_seed(1)
    z, r = torch.randn(64, 3001, generator=g), torch.randn(64, 3001, generator=g)
    t = torch.rand(64, generator=g) + 0.5
    zc = z.to(DEV).requires_grad_()
    rc, tc = r.to(DEV), t.to(DEV)
    with no_sync():
        kl = R.kl_from_logits(zc, rc, temperature=tc)
        kl.sum().backward()
    zr = z.double().requires_grad_()
    lz = torch.log_softmax(zr / t.double()[:, None], -1)
    lr = torch.log_softmax(r.double() / t.double()[:, None], -1)
    ref = (lz.exp() * (lz - lr)).sum(-1)
    ref.sum().backward()
    torch.testing.assert_close(kl.cpu().double(), ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(zc.grad.cpu().double(), zr.grad, atol=1e-6, rtol=1e-5)


def test_response_rmpad_matches_dense():
    g = torch.Generator().manual_seed(2)
    B, S, V, Rl = 4, 12, 517, 5
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[2, :1] = 0
    logits = torch.randn(B, S, V, generator=g)
    dense = R.log_probs_from_logits_response(ids.to(DEV), logits.to(DEV), Rl)
    packed_rows = mask.bool().view(-1)
    logits_rmpad = logits.view(B * S, V)[packed_rows]
    packed = R.log_probs_from_logits_response_rmpad(
        ids.to(DEV), mask.to(DEV), logits_rmpad.to(DEV), Rl
    )
    torch.testing.assert_close(packed, dense)
    assert packed.device.type == "cuda"


def test_packed_response_functions_do_not_sync():
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
    R.log_probs_from_logits_response_rmpad(ids_d, mask_d, leaves[0], Rl).sum().backward()  # warm-up
    leaves[0].grad = None
    with no_sync():
        a = R.log_probs_from_logits_response_rmpad(ids_d, mask_d, leaves[0], Rl, temperature=temp_d)
        b = R.log_probs_from_logits_all_rmpad(ids_p, leaves[1], idx_d, B, S, Rl, temperature=temp_d)
        (a.sum() + b.sum()).backward()
    cpu = packed.clone().requires_grad_()
    want = R.log_probs_from_logits_response_rmpad(ids, mask, cpu, Rl, temperature=temp)
    want.sum().backward()
    for got in (a, b):
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    for leaf in leaves:
        torch.testing.assert_close(leaf.grad.cpu(), cpu.grad, atol=1e-5, rtol=1e-5)


def test_ignored_labels_do_not_sync_and_give_zero_gradient():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 1000, generator=g)
    x[5] = float("nan")
    labels = torch.randint(0, 1000, (64,), generator=g)
    labels[5] = -100
    xd = x.to(DEV).requires_grad_()
    with no_sync():
        lp, ent = R.log_probs_and_entropy_from_logits(xd, labels.to(DEV), ignore_index=-100)
        (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(xd.grad).all() and (xd.grad[5] == 0).all()
    assert lp[5] == 0 and ent[5] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_matches_unfused(dtype):
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
            hc, wc, lab_d, bias=bc, temperature=0.9, chunk_size=128
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


def test_memory_is_bounded_on_device():
    """Peak allocation of log-probs + entropy fwd+bwd stays near logits + gradient."""
    N, V = 4096, 32000
    x = torch.randn(N, V, device=DEV).requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = R.log_probs_and_entropy_from_logits(x, labels)
    (lp + ent).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - x.numel() * 4  # minus the gradient
    assert extra <= 0.10 * x.numel() * 4
