"""``benchmarks/bench_sampling.py``: its table and its sort-based baseline (nothing is timed)."""

from __future__ import annotations

import pytest
import torch

from rlmath import log_probs_from_logits
from rlmath.bench import sampling, session


@pytest.mark.parametrize("truncation", sorted(sampling.TRUNCATIONS))
def test_the_sort_based_baseline_computes_what_rlmath_computes(truncation):
    # Continuous logits: no ties, where the baseline's sort order would decide.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 300, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, 300, (24,), generator=g)
    labels[:12] = x[:12].argmax(-1)
    kw = sampling.TRUNCATIONS[truncation]
    want = log_probs_from_logits(x, labels, **kw)
    got = sampling.naive_log_probs(x.float(), labels, **kw)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)


def test_table_has_a_row_per_implementation(capsys):
    with session(peers=False, rss=False) as setting:
        sampling.run(setting, [(8, 64)], ["float32"], ["top_p=0.9"], repeats=3)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 8×64")]
    impls = [ln.split("|")[5].strip() for ln in lines]
    assert impls == ["rlmath", "plain", "naive sort"]
    assert all(ln.split("|")[7].strip() == "1.00" for ln in lines if "plain" in ln)
    with pytest.raises(ValueError, match="unknown truncation"):
        sampling.run(setting, [(8, 64)], ["float32"], ["top_p=0.5"], repeats=3)
