"""FSDP2 (``fully_shard``) on 2 gloo ranks: values and gradients equal the unwrapped model's.

The model, its head, or both are wrapped; ``rlmath.hf.response_log_probs`` and
``FusedLMHeadLogProbs`` run through the wrapped modules' forward, so FSDP2
gathers the head's parameters in forward and backward and reduce-scatters
their gradients.
"""

from __future__ import annotations

import pytest
import torch

from rlmath.distributed import run_distributed
from tests.hf.models import transformers  # noqa: F401  (skips without transformers)

from .fsdp_workers import worker

pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2 (torch.distributed.fsdp)")
if torch.__version__ < (2, 7):
    # torch 2.6's FSDP2 records events on a CPU stream, which has no record_event.
    pytest.skip("FSDP2 on CPU (gloo) needs torch 2.7 or newer", allow_module_level=True)

# fp32 models: the sharded and unsharded sums round differently (a few ulps).
TOL = 2e-5


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2)


@pytest.mark.integration
def test_response_log_probs_under_fsdp2(results):
    for rank in results:
        for case, diffs in rank.items():
            worst = max(diffs.values())
            assert worst < TOL, (case, {k: v for k, v in diffs.items() if v >= TOL})
    assert {"qwen2-root", "gemma2-root", "llama-head", "llama-both", "granite-both"} <= set(
        results[0]
    )


@pytest.mark.integration
def test_fused_module_under_fsdp2(results):
    for rank in results:
        for case in ("fused-head", "fused-parent"):
            assert max(rank[case].values()) < TOL, (case, rank[case])
