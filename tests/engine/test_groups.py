"""Process groups travel to the operators by name, and rlmath keeps no reference to them."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from rlmath.engine import groups


@pytest.fixture
def world_of_one():
    """A gloo world of this process alone, destroyed after the test."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_destroyed_group_is_freed(world_of_one, monkeypatch):
    pg = dist.new_group([0])
    # A group of one rank travels as "" (its collectives are the identity): name
    # this one as a group of several ranks is named, the case that needs a lookup.
    monkeypatch.setattr(groups, "is_distributed", lambda group=None: True)
    name = groups.group_name(pg)
    assert name == pg.group_name
    assert groups.resolve_group(name) is pg
    out = groups.all_reduce(torch.ones(3), "sum", groups.resolve_group(name))
    assert torch.equal(out, torch.ones(3))
    alive = weakref.ref(pg)
    dist.destroy_process_group(pg)
    del pg
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="unknown in this process"):
        groups.resolve_group(name)


def test_the_world_group_resolves_by_its_name(world_of_one, monkeypatch):
    monkeypatch.setattr(groups, "is_distributed", lambda group=None: True)
    name = groups.group_name(None)
    assert groups.resolve_group(name) is dist.group.WORLD
    assert groups.resolve_group("") is None


def test_calls_with_a_group_keep_no_reference_to_it(world_of_one, monkeypatch):
    """Public functions given a group (statistics, vocabulary shards, forward and backward)
    leave nothing behind that keeps it alive once destroyed."""
    import rlmath as R
    from rlmath import _collectives

    # Treat the one-rank group as a group of several ranks, so that the calls name it,
    # resolve it and run their collectives over it (gloo, one process).
    for module in (groups, _collectives):
        monkeypatch.setattr(module, "is_distributed", lambda group=None: True)
    pg = dist.new_group([0])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    logits = torch.randn(3, 4, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (3, 4), generator=g)
    R.masked_mean(x, mask, group=pg)
    R.masked_whiten(x, mask, group=pg)
    shard = R.VocabParallel(group=pg)
    lp, ent = R.log_probs_and_entropy_from_logits(logits, labels, vocab_parallel=shard)
    (lp.sum() + ent.sum()).backward()
    del shard, lp, ent
    alive = weakref.ref(pg)
    dist.destroy_process_group(pg)
    del pg
    gc.collect()
    assert alive() is None
