"""The main namespace has one name per thing, spelled ``log_probs``; other spellings live in compat."""

from __future__ import annotations

import collections

import pytest

import rlmath
import rlmath.distributed
import rlmath.fused_head
import rlmath.hf
import rlmath.log_probs

NAMESPACES = [rlmath, rlmath.distributed, rlmath.fused_head, rlmath.log_probs, rlmath.hf]


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_no_two_public_names_for_one_object(module):
    names = collections.defaultdict(list)
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, (str, int, float, tuple, frozenset)):
            continue  # constants may share a value
        names[id(obj)].append(name)
    aliases = [group for group in names.values() if len(group) > 1]
    assert not aliases, f"{module.__name__} exports one object under several names: {aliases}"


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_log_probs_is_spelled_log_probs(module):
    # Functions and constants (snake_case); a class is CamelCase (FusedLMHeadLogProbs).
    assert not [n for n in module.__all__ if "logprob" in n], module.__all__


def test_every_public_name_resolves():
    for module in NAMESPACES:
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)


def test_verl_spellings_live_in_compat():
    import rlmath.compat.verl as verl

    for name in ("logprobs_from_logits", "get_policy_loss_fn", "distributed_masked_mean"):
        assert hasattr(verl, name) and not hasattr(rlmath, name), name
