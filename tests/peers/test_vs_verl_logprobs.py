"""Differential tests, log-probs and entropy: rlmath vs verl 0.9.1.

verl's CPU path is ``logprobs_from_logits_v2`` (no flash-attn here). Its rmpad
helpers import ``flash_attn.bert_padding``; the tests install verl's own pure-torch
fallbacks (``verl.utils.attention_utils._fallback_*``) under that name.

Pinned differences (docs/design.md "Vocabulary operations"):
- results are fp32 for bf16 logits, accumulated in fp32 (verl's bf16 path is a
  bf16 ``log_softmax``);
- entropy with ``-inf`` logits is finite (verl: NaN);
- the rmpad helper shifts labels within each sequence (never across sequence
  boundaries, unlike verl's global torch.roll).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.peers.peer_helpers import assert_close, import_verl, randn

verl_F = import_verl("verl.utils.torch_functional")
verl_attn = import_verl("verl.utils.attention_utils")

import rlmath  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """verl's pure-torch bert_padding fallbacks under ``flash_attn.bert_padding``."""
    pkg = types.ModuleType("flash_attn")
    mod = types.ModuleType("flash_attn.bert_padding")
    mod.pad_input = verl_attn._fallback_pad_input
    mod.unpad_input = verl_attn._fallback_unpad_input
    mod.index_first_axis = verl_attn._fallback_index_first_axis
    pkg.bert_padding = mod
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", mod)
    monkeypatch.setattr(verl_F, "get_device_name", lambda: "cuda")  # all_rmpad's import branch
    return mod


def _with_grad(fn, logits, *args, **kw):
    x = logits.clone().requires_grad_(True)
    out = fn(x, *args, **kw)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (out * w.to(out.dtype)).sum().backward()
    return out.detach(), x.grad


# --------------------------------------------------------------------------- log-probs, entropy


@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 50), (2, 4, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_from_logits(shape, dtype, gen):
    logits = randn(*shape, gen=gen, dtype=dtype, scale=3.0)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    ours, g = _with_grad(rlmath.log_probs_from_logits, logits, labels)
    theirs, gv = _with_grad(verl_F.logprobs_from_logits, logits, labels)
    assert ours.dtype == dtype
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert_close(ours, theirs, **tol)
    assert_close(g, gv, **tol)
    assert_close(rlmath.log_probs_from_logits(logits, labels), theirs, **tol)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_logprobs_temperature_equals_verl_on_scaled_logits(temperature, gen):
    # verl applies temperature in place on the logits before calling logprobs_from_logits.
    logits = randn(3, 6, 40, gen=gen, scale=2.0)
    labels = torch.randint(0, 40, (3, 6), generator=gen)
    ours = rlmath.log_probs_from_logits(logits, labels, temperature=temperature)
    theirs = verl_F.logprobs_from_logits(logits / temperature, labels)
    assert_close(ours, theirs, **TOL)
    per_row = torch.full((3, 6), temperature)
    assert_close(rlmath.log_probs_from_logits(logits, labels, temperature=per_row), theirs, **TOL)


def test_logprobs_bf16_documented_difference(gen):
    # docs/design.md "Conventions" (precision): log-probs are fp32 whatever the input dtype,
    # reductions in fp32.
    logits = randn(4, 8, 3000, gen=gen, scale=4.0).to(torch.bfloat16)
    labels = torch.randint(0, 3000, (4, 8), generator=gen)
    exact = verl_F.logprobs_from_logits(logits.double(), labels)
    ours = rlmath.log_probs_from_logits(logits, labels)
    theirs = verl_F.logprobs_from_logits(logits, labels)
    assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
    assert (ours.double() - exact).abs().max() < 1e-5
    assert (theirs.double() - exact).abs().max() > 1e-3


@pytest.mark.parametrize("shape", [(9, 31), (2, 5, 64), (3, 2, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_from_logits(shape, dtype, gen):
    logits = randn(*shape, gen=gen, dtype=dtype, scale=3.0)
    ours, g = _with_grad(rlmath.entropy_from_logits, logits)
    theirs, gv = _with_grad(verl_F.entropy_from_logits, logits)
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-11)
    assert_close(ours, theirs, **tol)
    assert_close(g, gv, **tol)
    if len(shape) == 2:
        assert_close(ours, verl_F.entropy_from_logits_with_chunking(logits, chunk_size=4), **TOL)


def test_logprobs_and_entropy_one_pass(gen):
    logits = randn(3, 7, 90, gen=gen, scale=2.0)
    labels = torch.randint(0, 90, (3, 7), generator=gen)
    lp, ent = rlmath.log_probs_and_entropy_from_logits(logits, labels)
    assert_close(lp, verl_F.logprobs_from_logits(logits, labels), **TOL)
    assert_close(ent, verl_F.entropy_from_logits(logits), **TOL)


def test_entropy_neg_inf_logits_documented_difference(gen):
    # docs/design.md: -inf logits (masked/padded vocabulary) give no NaN in forward or backward.
    logits = randn(4, 20, gen=gen)
    logits[:, 15:] = float("-inf")
    ours, g = _with_grad(rlmath.entropy_from_logits, logits)
    theirs = verl_F.entropy_from_logits(logits)
    assert torch.isnan(theirs).all()
    assert torch.isfinite(ours).all() and torch.isfinite(g).all()
    assert_close(ours, verl_F.entropy_from_logits(logits[:, :15]), **TOL)
    # Log-probs of the finite labels agree (verl's logsumexp handles -inf).
    labels = torch.randint(0, 15, (4,), generator=gen)
    assert_close(
        rlmath.log_probs_from_logits(logits, labels),
        verl_F.logprobs_from_logits(logits, labels),
        **TOL,
    )


# --------------------------------------------------------------------------- response helpers


def _batch(gen, b=4, prompt=5, resp=6, v=29):
    """verl's layout: left-padded prompts, right-padded responses."""
    seqlen = prompt + resp
    p_len = torch.randint(1, prompt + 1, (b,), generator=gen)
    r_len = torch.randint(1, resp + 1, (b,), generator=gen)
    r_len[0] = resp  # one full-length response
    r_len[1] = 1  # one length-1 response
    pos = torch.arange(seqlen)
    attn = (
        (pos[None] >= (prompt - p_len)[:, None]) & (pos[None] < (prompt + r_len)[:, None])
    ).long()
    ids = torch.randint(0, v, (b, seqlen), generator=gen)
    ids = torch.where(attn.bool(), ids, 0)
    logits = randn(b, seqlen, v, gen=gen, scale=2.0)
    resp_mask = attn[:, prompt:].bool()
    return ids, attn, logits, resp, resp_mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_log_probs_from_logits_response(seed):
    ids, _, logits, resp, _ = _batch(torch.Generator().manual_seed(seed))
    ours = rlmath.log_probs_from_logits_response(ids, logits, resp)
    theirs = verl_F.log_probs_from_logits_response(ids, logits, resp)
    assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_log_probs_from_logits_response_rmpad(seed, fake_flash_attn):
    ids, attn, logits, resp, resp_mask = _batch(torch.Generator().manual_seed(seed))
    packed_logits = logits[attn.bool()]
    ours = rlmath.log_probs_from_logits_response_rmpad(ids, attn, packed_logits, resp)
    theirs = verl_F.log_probs_from_logits_response_rmpad(ids, attn, packed_logits, resp)
    dense = verl_F.log_probs_from_logits_response(ids, logits, resp)
    # Every valid response token: rlmath rmpad == verl rmpad == dense.
    assert_close(ours[resp_mask], dense[resp_mask], **TOL)
    assert_close(theirs[resp_mask], dense[resp_mask], **TOL)
    # docs/design.md: rmpad equals the dense result token for token.
    assert_close(ours, torch.where(resp_mask, dense, ours), **TOL)


def test_rmpad_verl_roll_crosses_sequences_documented_difference(fake_flash_attn):
    # docs/design.md: verl's global torch.roll scores the last token of each sequence against
    # the first token of the next one. In verl's own layout that position is never a
    # valid response token; it becomes one when the slice covers every position
    # (response_length = seqlen - 1, as for a packed "all tokens" computation).
    gen = torch.Generator().manual_seed(3)
    b, seqlen, v = 3, 7, 23
    lengths = torch.tensor([7, 4, 6])
    attn = (torch.arange(seqlen)[None] >= (seqlen - lengths)[:, None]).long()  # left-padded
    ids = torch.where(attn.bool(), torch.randint(1, v, (b, seqlen), generator=gen), 0)
    logits = randn(b, seqlen, v, gen=gen)
    packed = logits[attn.bool()]
    resp = seqlen - 1
    ours = rlmath.log_probs_from_logits_response_rmpad(ids, attn, packed, resp)
    theirs = verl_F.log_probs_from_logits_response_rmpad(ids, attn, packed, resp)
    dense = verl_F.log_probs_from_logits_response(ids, logits, resp)
    valid = attn[:, 1:].bool() & attn[:, :-1].bool()  # predicted token and predictor valid
    assert_close(ours[valid], dense[valid], **TOL)
    assert_close(theirs[valid], dense[valid], **TOL)  # inside a sequence verl is right too


@pytest.mark.parametrize("seed", [0, 1])
def test_log_probs_from_logits_all_rmpad(seed, fake_flash_attn):
    ids, attn, logits, resp, resp_mask = _batch(torch.Generator().manual_seed(seed))
    b, seqlen = ids.shape
    ids_rmpad, indices, *_ = rlmath.unpad_input(ids.unsqueeze(-1), attn)
    ids_rmpad = ids_rmpad.transpose(0, 1)  # [1, nnz] as verl passes it
    packed_logits = logits[attn.bool()]
    ours = rlmath.log_probs_from_logits_all_rmpad(
        ids_rmpad, packed_logits, indices, b, seqlen, resp
    )
    theirs = verl_F.log_probs_from_logits_all_rmpad(
        ids_rmpad, packed_logits, indices, b, seqlen, resp
    )
    assert_close(ours[resp_mask], theirs[resp_mask], **TOL)


@pytest.mark.parametrize("upstream", [0.5, 1.0, 2.0, -3.0])
def test_entropy_grad_finite_with_neg_inf_logits(upstream):
    # docs/design.md: -inf logits give no NaN in forward or backward; gradient -p·(z - E_p[z])
    # (0 on a -inf column). Minimal repro of a mismatch found here: with an upstream
    # gradient of magnitude > 1 the -inf column's gradient came out NaN.
    z = torch.tensor([[1.0, 2.0, float("-inf")]], requires_grad=True)
    (rlmath.entropy_from_logits(z) * upstream).sum().backward()
    ref = torch.tensor([[1.0, 2.0]], requires_grad=True)
    (verl_F.entropy_from_logits(ref) * upstream).sum().backward()
    assert torch.isfinite(z.grad).all(), z.grad
    assert_close(z.grad[:, :2], ref.grad, **TOL)
    assert z.grad[0, 2] == 0
