"""``benchmarks/bench_sampling_vocab_parallel.py`` runs and prints its table (timings not checked)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_prints_a_row_per_call():
    script = ROOT / "benchmarks" / "bench_sampling_vocab_parallel.py"
    proc = subprocess.run(
        [sys.executable, str(script), "64", "512"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows[2:]]
    assert names == ["plain", "top_p=0.9", "top_k=50", "min_p=0.05"]
    for row in rows[2:]:
        cells = [c.strip() for c in row.split("|")[2:-1]]
        assert all(float(c) > 0 for c in cells)
