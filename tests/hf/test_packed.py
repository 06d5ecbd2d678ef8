"""The padding-free (packed) path equals the padded one.

No CPU attention of ``transformers`` separates packed sequences, so the test
uses one (``tests.hf.attention.varlen_attention``: causal attention within
each sequence of ``cu_seq_lens_q``, the keyword flash-attention's varlen path
reads) and declares it packing-capable.
"""

from __future__ import annotations

import pytest
import torch

import rlmath.hf as rhf
from rlmath.hf import response_log_probs
from tests.hf.attention import VARLEN
from tests.hf.models import batch, model

R = 6


@pytest.fixture
def varlen(monkeypatch):
    monkeypatch.setattr(rhf.response, "PACKED_ATTENTION", rhf.PACKED_ATTENTION | {VARLEN})
    return VARLEN


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_packed_equals_padded(varlen, name):
    padded = model(name)
    packed = model(name, attn_implementation=varlen)
    packed.load_state_dict(padded.state_dict())
    ids, mask = batch(response=R)
    lp, ent = response_log_probs(padded, ids, mask, R, temperature=0.8, packed=False)
    plp, pent = response_log_probs(packed, ids, mask, R, temperature=0.8)  # packed=None chooses
    torch.testing.assert_close(plp, lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pent, ent, rtol=1e-10, atol=1e-10)
    (lp.sum() + ent.sum()).backward()
    (plp.sum() + pent.sum()).backward()
    # Gemma's RMSNorm computes in fp32 even in an fp64 model, and packing changes the
    # order of its sums over the batch: its weights' gradients agree to fp32 rounding.
    tol = 1e-6 if name == "gemma2" else 1e-8
    for (n, a), (_, b) in zip(padded.named_parameters(), packed.named_parameters()):
        if a.grad is not None:
            scale = a.grad.abs().max().item()
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=tol * max(scale, 1.0), msg=n)
