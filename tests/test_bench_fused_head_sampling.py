"""``benchmarks/bench_fused_head_sampling.py``: its table, and the three ways agree (nothing is timed)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlmath.bench import fused_head_sampling
from rlmath.bench.sampling import TRUNCATIONS

ROOT = Path(__file__).resolve().parents[1]


def test_the_kept_set_ways_compute_the_same_numbers():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, dtype=torch.float64)
    w = torch.randn(40, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (12,), generator=g)
    impls = fused_head_sampling.implementations(TRUNCATIONS["top_k=50+top_p=0.9"])
    fused = impls["fused, kept set"](h, w, labels)
    logits = impls["logits, kept set"](h, w, labels)
    plain = impls["fused, full softmax"](h, w, labels)
    for a, b in zip(fused, logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.all(fused[0] >= plain[0] - 1e-12)  # renormalised over fewer tokens


@pytest.mark.integration
def test_prints_a_row_per_way():
    script = ROOT / "benchmarks" / "bench_fused_head_sampling.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--shapes", "32x8x256", "--repeats", "3"], cwd=ROOT,
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    lines = proc.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| shape")]
    assert [r.split("|")[4].strip() for r in rows] == list(fused_head_sampling.implementations({}))
