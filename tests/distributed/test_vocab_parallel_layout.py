"""The shards' layout is checked on every call, without ``validate=True``.

A world of one (no process group) holds the whole vocabulary: a
``vocab_start_index`` or ``vocab_size`` that describes a shard of a larger one
is a ``ValueError`` (it used to normalize over the local columns only). With a
group, the shards' ``(start, width)`` ride in the engine's first collective:
a gap or an overlap raises :class:`rlmath.engine.stats.ShardLayoutError` on
every rank where reading the check is free (a CPU) and makes every result NaN
where it is not (an accelerator; simulated here).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import rlmath as R
from rlmath import VocabParallel, _device
from rlmath.distributed import run_distributed
from rlmath.engine.stats import ShardLayoutError


def _x() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_parallel": VocabParallel(start=8)},
        {"vocab_parallel": VocabParallel(start=4)},
        {"vocab_parallel": VocabParallel(), "vocab_size": 16},
    ],
    ids=["start 8", "start 4", "vocab_size 16"],
)
def test_world_of_one_refuses_a_shard_of_a_larger_vocabulary(kwargs):
    x, labels = _x(), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="no other process holds the rest"):
        R.log_probs_from_logits(x, labels, **kwargs)
    with pytest.raises(ValueError, match="no other process holds the rest"):
        R.entropy_from_logits(x, **kwargs)
    with pytest.raises(ValueError, match="no other process holds the rest"):
        R.kl_from_logits(x, x, **kwargs)
    with pytest.raises(ValueError, match="no other process holds the rest"):
        R.sum_pi_squared_from_logits(x, **kwargs)
    h, w = torch.randn(3, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match="no other process holds the rest"):
        R.log_probs_and_entropy_from_hidden(h, w, labels, **kwargs)


def test_one_process_refuses_a_vocab_size_above_the_width():
    with pytest.raises(ValueError, match="vocab_size=16 is more than the 8 columns of logits"):
        R.entropy_from_logits(_x(), vocab_size=16)


def test_world_of_one_accepts_the_whole_vocabulary_with_padding():
    x = _x()
    one = VocabParallel()
    full = R.entropy_from_logits(x, vocab_parallel=VocabParallel(start=0))
    assert torch.equal(full, R.entropy_from_logits(x))
    padded = R.entropy_from_logits(x, vocab_size=6, vocab_parallel=one)
    torch.testing.assert_close(padded, R.entropy_from_logits(x[:, :6]), rtol=0, atol=0)
    torch.testing.assert_close(R.entropy_from_logits(x, vocab_size=6), padded, rtol=0, atol=0)


def _calls(x: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    labels = torch.tensor([0, 1, 2])
    h = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    w = torch.randn(x.shape[-1], 4, generator=torch.Generator().manual_seed(2))
    vp = VocabParallel(group=dist.group.WORLD, start=start)
    return {
        "lp": R.log_probs_from_logits(x, labels, vocab_parallel=vp),
        "ent": R.entropy_from_logits(x, vocab_parallel=vp),
        "kl": R.kl_from_logits(x, x.flip(0), vocab_parallel=vp),
        "pi2": R.sum_pi_squared_from_logits(x, vocab_parallel=vp),
        "head": R.log_probs_and_entropy_from_hidden(h, w, labels, vocab_parallel=vp)[0],
    }


def _layout_worker(simulate_accelerator: bool) -> dict[str, object]:
    rank = dist.get_rank()
    x = _x()
    out: dict[str, object] = {}
    if simulate_accelerator:
        _device.reads_host = lambda device: False  # type: ignore[assignment]
    # Both ranks claim columns [0, 8): an overlap, and [8, 16) is missing.
    for layout, start in (("overlap", 0), ("gap", 16 * rank), ("good", 8 * rank)):
        try:
            out[layout] = _calls(x, start)
        except ShardLayoutError as e:
            out[layout] = str(e)
    return out


@pytest.mark.integration
def test_a_bad_layout_raises_on_every_rank_on_a_cpu():
    for out in run_distributed(_layout_worker, 2, False):
        for layout in ("overlap", "gap"):
            assert isinstance(out[layout], str), layout
            assert "must tile [0, V)" in out[layout] and "(0, 8)" in out[layout]
        assert all(torch.isfinite(v).all() for v in out["good"].values())


@pytest.mark.integration
def test_a_bad_layout_gives_nan_without_a_host_read():
    for out in run_distributed(_layout_worker, 2, True):
        for layout in ("overlap", "gap"):
            assert isinstance(out[layout], dict), out[layout]
            for name, value in out[layout].items():
                assert torch.isnan(value).all(), (layout, name)
        assert all(torch.isfinite(v).all() for v in out["good"].values())
