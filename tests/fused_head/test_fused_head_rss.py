"""Memory as the operating system counts it: the peak RSS of the fused head, fresh process.

:func:`rlmath.bench.memory.peak_rss_bytes` runs one forward+backward of
``log_probs_and_entropy_from_hidden`` at 8192×1024×32000 in a fresh process,
after the same call on 64 rows, and reports the peak RSS beyond the resident
set before the call and what the call returns (log-probs, entropy and the
gradients of hidden and weight).
"""

from __future__ import annotations

import pytest
import torch

from rlmath.bench.memory import peak_rss_bytes, rss_measurable
from rlmath.engine.torch_backend import cpu_matmul

N, H, V = 8192, 1024, 32000  # 1000 MiB of fp32 logits


@pytest.mark.integration
@pytest.mark.skipif(not rss_measurable(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_rss_of_the_fused_head_is_at_most_5_percent_of_the_logits(dtype):
    case = {"n": N, "h": H, "v": V, "dtype": dtype, "impl": "rlmath fused", "peers": False}
    choice = "onednn" if cpu_matmul.uses_onednn(torch.float32, torch.device("cpu")) else "blas"
    extra = peak_rss_bytes(
        "rlmath.bench.fused_head", case, threads=2, env={cpu_matmul.ENV_VAR: choice}
    )
    assert extra is not None
    # Half-precision weights need one fp32 buffer of the weight's shape (the
    # gradient summed before it is rounded): left out of the bound, as in the
    # benchmark. What is left, from what the pass holds: per worker the fp32
    # copy of a weight tile (≤ 2432 × 1024 × 4 = 9.5 MiB), a logits block and its
    # fp32 gradient, the fp32 copy of a block's hidden rows (≤ 9 MiB together);
    # for half-precision hidden states a band of fp32 grad_hidden rows (8 MiB);
    # the saved per-row statistics (< 1 MiB). Measured on 2 cores: 33-43 MiB
    # fp32, 14-25 MiB bf16 beyond the weight-shaped buffer; 5 % of the fp32
    # logits is 50 MiB.
    allowance = 4 * V * H if dtype != "float32" else 0
    assert extra - allowance <= 0.05 * 4 * N * V, f"{(extra - allowance) / 2**20:.1f} MiB"
