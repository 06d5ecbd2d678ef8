"""``rlmath --version`` and the version the package reports."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

import rlmath
from rlmath import cli


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == f"rlmath {cli.version()}\n"
    assert re.fullmatch(r"rlmath \d+\.\d+\.\d+\S*\n", out)


def test_version_comes_from_the_installed_distribution(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.8.7")
    assert cli.version() == "9.8.7"


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.version() == rlmath.__version__
