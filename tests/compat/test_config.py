"""rlmath.compat.config_get: one accessor for dataclasses, dicts, DictConfig and plain objects."""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from rlmath.compat import config_get


@dataclass
class Policy:
    dro_beta: float | None = None
    clip_cov_ratio: float = 0.0002


@dataclass
class MappingConfig(collections.abc.Mapping):
    """Like verl's BaseConfig: a dataclass that is a Mapping whose __getitem__ is getattr."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    policy_loss: Policy = field(default_factory=Policy)

    def __getitem__(self, key):
        return getattr(self, key)  # raises AttributeError, not KeyError

    def __iter__(self):
        return iter(("clip_ratio", "clip_ratio_low", "policy_loss"))

    def __len__(self):
        return 3


@dataclass
class PlainConfig:
    clip_ratio: float = 0.3
    policy_loss: Policy | None = None


FORMS = {
    "mapping-dataclass": MappingConfig(clip_ratio=0.25, policy_loss=Policy(dro_beta=0.5)),
    "dict": {"clip_ratio": 0.25, "clip_ratio_low": None, "policy_loss": {"dro_beta": 0.5}},
    "namespace": SimpleNamespace(
        clip_ratio=0.25, clip_ratio_low=None, policy_loss=SimpleNamespace(dro_beta=0.5)
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_reads_fields_and_dotted_paths(form):
    cfg = FORMS[form]
    assert config_get(cfg, "clip_ratio") == 0.25
    assert config_get(cfg, "policy_loss.dro_beta") == 0.5
    # Present with the value None: None (verl gives None its own meaning).
    assert config_get(cfg, "clip_ratio_low", 0.9) is None
    # Absent: the default.
    assert config_get(cfg, "clip_ratio_c", 3.0) == 3.0
    assert config_get(cfg, "policy_loss.kl_cov_ratio", 7) == 7
    assert config_get(cfg, "nothing.deeper.still", "d") == "d"


def test_plain_dataclass_and_none_along_the_path():
    cfg = PlainConfig()
    assert config_get(cfg, "clip_ratio") == 0.3
    assert config_get(cfg, "policy_loss.dro_beta", 1.5) == 1.5  # policy_loss is None
    assert config_get(None, "clip_ratio", 0.2) == 0.2


def test_missing_without_default_names_the_key():
    with pytest.raises(KeyError, match="kl_ctrl has no field 'horizon'"):
        config_get({"type": "adaptive"}, "horizon", owner="kl_ctrl")
    with pytest.raises(KeyError, match="policy_loss.dro_beta"):
        config_get({"policy_loss": {}}, "policy_loss.dro_beta")


@pytest.mark.parametrize("key", ["", 3, None])
def test_bad_key(key):
    with pytest.raises(TypeError, match="key"):
        config_get({}, key)


def test_omegaconf_when_available():
    omegaconf = pytest.importorskip(
        "omegaconf", reason="OmegaConf is not installed here (it is in .venv-peers)"
    )
    cfg = omegaconf.OmegaConf.create({"clip_ratio": 0.3, "policy_loss": {"dro_beta": None}})
    assert config_get(cfg, "clip_ratio") == 0.3
    assert config_get(cfg, "policy_loss.dro_beta", 1.0) is None
    assert config_get(cfg, "policy_loss.missing", 4) == 4
    omegaconf.OmegaConf.set_struct(cfg, True)
    assert config_get(cfg, "absent", 5) == 5
