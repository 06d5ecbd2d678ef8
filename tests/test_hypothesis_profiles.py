"""The hypothesis profiles of tests/conftest.py: random locally, reproducible in CI."""

import pytest
from hypothesis import settings

from tests import conftest


def test_ci_profile_is_derandomized_without_a_database():
    ci = settings.get_profile("ci")
    assert ci.derandomize is True
    assert ci.database is None  # nothing replays from .hypothesis/
    assert ci.max_examples == settings.get_profile("default").max_examples
    assert settings.get_profile("default").derandomize is False


@pytest.mark.parametrize(
    ("env", "profile"),
    [
        ({}, "default"),
        ({"CI": "true"}, "ci"),
        ({"CI": "1", "HYPOTHESIS_PROFILE": "thorough"}, "thorough"),
        ({"HYPOTHESIS_PROFILE": "ci"}, "ci"),
        ({"CI": ""}, "default"),
    ],
)
def test_profile_choice(env, profile, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert conftest._profile() == profile


def test_hypothesis_database_is_git_ignored():
    from pathlib import Path

    ignored = (Path(__file__).parent.parent / ".gitignore").read_text().split()
    assert ".hypothesis/" in ignored
