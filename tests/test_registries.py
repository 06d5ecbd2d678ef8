"""The two registries (policy losses, advantage estimators) behave the same way."""

from __future__ import annotations

import pytest

import rlmath

REGISTRIES = [
    (rlmath.list_policy_losses, rlmath.get_policy_loss, rlmath.register_policy_loss, "vanilla"),
    (
        rlmath.list_advantage_estimators,
        rlmath.get_advantage_estimator,
        rlmath.register_advantage_estimator,
        "gae",
    ),
]


@pytest.mark.parametrize(("list_fn", "get_fn", "register", "known"), REGISTRIES)
def test_registries_share_one_behaviour(list_fn, get_fn, register, known):
    names = list_fn()
    assert isinstance(names, list) and names == sorted(names) and known in names
    assert callable(get_fn(known))
    with pytest.raises(ValueError, match=r"unknown .*'nope'.*valid values are: .*" + known):
        get_fn("nope")
    with pytest.raises(TypeError, match="name"):
        register(3)
    with pytest.raises(ValueError, match="already registered"):
        register(known)(lambda *a, **k: None)


@pytest.mark.parametrize(("list_fn", "get_fn", "register", "known"), REGISTRIES)
def test_registration_at_the_definition_returns_the_function(list_fn, get_fn, register, known):
    def custom(*args, **kwargs):
        return None

    name = "rlmath_test_custom_entry"
    assert register(name)(custom) is custom
    try:
        assert get_fn(name) is custom and name in list_fn()
        assert register(name, override=True)(custom) is custom
    finally:
        registry = get_fn.__globals__["_REGISTRY"]
        del registry[name]
