"""The demo's math goes through rlmath's public functions, not copies of them."""

import ast
import functools
from pathlib import Path

import pytest

import rlmath
from rlmath.demo import DemoConfig
from rlmath.demo.runner import run_demo

DEMO_DIR = Path(rlmath.__file__).parent / "demo"

COMMON = [
    "unpad_input",
    "pad_input",
    "log_probs_from_logits_response_rmpad",
    "entropy_from_logits",
    "get_response_mask",
    "kl_penalty",
    "get_policy_loss",
    "agg_loss",
    "get_cosine_schedule_with_warmup",
    "masked_mean",
]
EXPECTED = {
    "ppo": [
        *COMMON,
        "compute_rewards",
        "AdaptiveKLController",
        "compute_gae_advantage_return",
        "compute_value_loss",
    ],
    "grpo": [*COMMON, "get_advantage_estimator"],
}


def _spy(calls: dict[str, int], name: str, fn):
    if isinstance(fn, type):

        class Spied(fn):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **kw):
                calls[name] = calls.get(name, 0) + 1
                super().__init__(*a, **kw)

        return Spied

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)

    return wrapper


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_demo_calls_rlmath_functions(algo, tmp_path, monkeypatch):
    calls: dict[str, int] = {}
    for name in EXPECTED[algo]:
        monkeypatch.setattr(rlmath, name, _spy(calls, name, getattr(rlmath, name)))
    # The policy loss itself is looked up in rlmath's registry: spy on it too.
    real_get = rlmath.get_policy_loss

    def get_policy_loss(name):
        return _spy(calls, f"policy_loss:{name}", real_get(name))

    monkeypatch.setattr(rlmath, "get_policy_loss", _spy(calls, "get_policy_loss", get_policy_loss))
    cfg = DemoConfig(
        algo=algo, steps=2, batch_size=4, group_size=2, out=tmp_path, progress=False,
        d_model=32, n_layers=1, n_heads=2, warmup_steps=1, warmup_examples=4,
    )  # fmt: skip
    run_demo(cfg)
    missing = [n for n in EXPECTED[algo] if calls.get(n, 0) == 0]
    assert not missing, f"the demo did not call rlmath.{missing}"
    assert calls.get("policy_loss:vanilla", 0) > 0


def test_breaking_rlmath_breaks_the_demo(tmp_path, monkeypatch):
    """If the loss came from a private copy, breaking rlmath's would not matter."""

    class Sentinel(Exception):
        pass

    def broken(*a, **kw):
        raise Sentinel

    monkeypatch.setattr(rlmath, "agg_loss", broken)
    cfg = DemoConfig(
        algo="grpo", steps=1, batch_size=2, group_size=2, out=tmp_path, progress=False,
        d_model=32, n_layers=1, n_heads=2, warmup_steps=0,
    )  # fmt: skip
    with pytest.raises(Sentinel):
        run_demo(cfg)


def test_demo_defines_no_copy_of_an_rlmath_function():
    public = set(rlmath.__all__)
    for path in DEMO_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {
            node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)
        }
        clash = defined & public
        assert not clash, f"{path.name} defines {sorted(clash)}, which rlmath provides"
