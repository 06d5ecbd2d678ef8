"""rlmath.compat.trl against TRL 0.24 itself: signatures, values in fp32/fp64, the half-precision dtype.

(TRL's GRPO loss is a trainer method, not an importable function; ``grpo_loss``
is tested against float64 references of TRL's definitions in
``tests/compat/test_trl_compat.py``.)
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.peers.peer_helpers import SKIP_TRL, assert_close

trl_utils = pytest.importorskip("trl.trainer.utils", reason=SKIP_TRL)

from rlmath.compat import trl as ct  # noqa: E402


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(
    "name", ["selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy"]
)
def test_signatures_are_trls(name):
    # rlmath's functions take the newest TRL's arguments; an older TRL's are a prefix of them.
    if not hasattr(trl_utils, name):
        pytest.skip(f"this TRL has no {name}")
    theirs = _params(getattr(trl_utils, name))
    assert _params(getattr(ct, name))[: len(theirs)] == theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_match_trl(dtype, gen):
    logits = (torch.randn(3, 7, 130, generator=gen, dtype=torch.float64) * 3).to(dtype)
    index = torch.randint(0, 130, (3, 7), generator=gen)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    ours, theirs = (
        ct.selective_log_softmax(logits, index),
        trl_utils.selective_log_softmax(logits, index),
    )
    assert ours.dtype == theirs.dtype == dtype
    assert_close(ours, theirs, **tol)
    for chunk in (1, 5, 128):
        ours = ct.entropy_from_logits(logits, chunk)
        theirs = trl_utils.entropy_from_logits(logits, chunk)
        assert ours.dtype == theirs.dtype == dtype
        assert_close(ours, theirs, **tol)


def test_half_precision_returns_fp32_documented_difference(gen):
    logits64 = torch.randn(4, 9, 200, generator=gen, dtype=torch.float64) * 3
    index = torch.randint(0, 200, (4, 9), generator=gen)
    logits = logits64.to(torch.bfloat16)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    ours = ct.selective_log_softmax(logits, index)
    theirs = trl_utils.selective_log_softmax(logits, index)
    assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16
    ours_err = (ours.double() - exact).abs().max()
    theirs_err = (theirs.double() - exact).abs().max()
    assert ours_err < 1e-5 < theirs_err
