"""Differential tests against TRL 0.24 (``trl.trainer.utils``): log-probs and entropy.

TRL's math that is importable without building a trainer is
``selective_log_softmax`` (per-row loop for bf16) and ``entropy_from_logits``
(chunked). TRL's GRPO advantages and losses live inside ``GRPOTrainer`` methods
and are compared through verl's equivalents instead.
"""

from __future__ import annotations

import pytest
import torch

from tests.peers.peer_helpers import SKIP_TRL, assert_close, randn

trl_utils = pytest.importorskip("trl.trainer.utils", reason=SKIP_TRL)

import rlmath  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 40), (2, 6, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selective_log_softmax(shape, dtype, gen):
    logits = randn(*shape, gen=gen, dtype=dtype, scale=3.0)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    x1, x2 = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    ours = rlmath.log_probs_from_logits(x1, labels)
    theirs = trl_utils.selective_log_softmax(x2, labels)
    tol = TOL if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert_close(ours, theirs, **tol)
    w = randn(*shape[:-1], gen=gen, dtype=dtype)
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    assert_close(x1.grad, x2.grad, **tol)


@pytest.mark.parametrize("shape", [(7, 50), (3, 4, 200)])
def test_entropy_from_logits(shape, gen):
    logits = randn(*shape, gen=gen, scale=2.0)
    assert_close(
        rlmath.entropy_from_logits(logits),
        trl_utils.entropy_from_logits(logits, chunk_size=3),
        **TOL,
    )


def test_bf16_precision_documented_difference(gen):
    # docs/design.md "Conventions" (precision): fp32 results for bf16 logits; TRL's bf16
    # path is a bf16 log_softmax.
    logits = randn(3, 5, 2000, gen=gen, scale=4.0).to(torch.bfloat16)
    labels = torch.randint(0, 2000, (3, 5), generator=gen)
    exact = trl_utils.selective_log_softmax(logits.double(), labels)
    ours = rlmath.log_probs_from_logits(logits, labels)
    theirs = trl_utils.selective_log_softmax(logits, labels)
    assert (ours.double() - exact).abs().max() < 1e-5
    assert (theirs.double() - exact).abs().max() > 1e-3
