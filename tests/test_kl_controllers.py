"""Fixed and adaptive KL controllers against the Ziegler et al. (2019) update written out here."""

import numpy as np
import pytest
import torch

from rlmath import AdaptiveKLController, FixedKLController


def ref_adaptive(beta, target, horizon, updates):
    """β ← β·(1 + clip(kl/target − 1, −0.2, 0.2)·n/horizon), step by step."""
    out = []
    for kl, n in updates:
        error = kl / target - 1
        error = -0.2 if error < -0.2 else 0.2 if error > 0.2 else error
        beta = beta * (1 + error * n / horizon)
        out.append(beta)
    return out


def test_adaptive_matches_reference_sequence():
    updates = [(6.0, 256), (12.0, 256), (0.0, 256), (6.6, 64), (5.1, 1), (100.0, 0)]
    ctrl = AdaptiveKLController(0.2, 6.0, 10000)
    values = []
    for kl, n in updates:
        ctrl.update(kl, n)
        values.append(ctrl.value)
    assert values == pytest.approx(ref_adaptive(0.2, 6.0, 10000, updates), rel=1e-15)
    assert isinstance(ctrl.value, float)


def test_adaptive_clip_boundaries_and_direction():
    high = AdaptiveKLController(1.0, 1.0, 100)
    high.update(50.0, 10)  # error clipped to +0.2: β·(1 + 0.2·0.1)
    assert high.value == pytest.approx(1.02)
    low = AdaptiveKLController(1.0, 1.0, 100)
    low.update(0.0, 10)  # error clipped to −0.2
    assert low.value == pytest.approx(0.98)
    on_target = AdaptiveKLController(0.5, 2.0, 100)
    on_target.update(2.0, 1000)
    assert on_target.value == 0.5
    inside = AdaptiveKLController(1.0, 1.0, 100)
    inside.update(1.1, 100)  # error 0.1, n/horizon 1
    assert inside.value == pytest.approx(1.1)


def test_adaptive_steers_kl_to_target():
    """A KL that falls as β grows (kl = c/β): the controller settles where kl = target."""
    ctrl = AdaptiveKLController(0.05, target_kl=0.1, horizon=1000)
    for _ in range(3000):
        ctrl.update(0.02 / ctrl.value, 64)
    assert 0.02 / ctrl.value == pytest.approx(0.1, rel=1e-3)


def test_tensor_and_numpy_kl_are_accepted():
    a, b, c = (AdaptiveKLController(0.1, 3.0, 500) for _ in range(3))
    a.update(4.5, 32)
    b.update(torch.tensor(4.5, dtype=torch.float64), 32)
    c.update(np.float32(4.5), 32)
    assert a.value == b.value == c.value
    b.update(torch.tensor([4.5]), 32)  # a 1-element tensor is fine too


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        ctrl.update(kl, 128)
        ctrl.update(torch.tensor(kl), 128)
    assert ctrl.value == 0.05 and isinstance(ctrl.value, float)
    assert "0.05" in repr(ctrl)
    assert "AdaptiveKLController" in repr(AdaptiveKLController(0.1, 1.0, 10))


def test_bad_input_messages():
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-0.1)
    with pytest.raises(TypeError, match="kl_coef"):
        FixedKLController("0.1")
    with pytest.raises(ValueError, match="init_kl_coef"):
        AdaptiveKLController(float("nan"), 1.0, 10)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)
    for ctrl in (FixedKLController(0.1), AdaptiveKLController(0.1, 1.0, 10)):
        with pytest.raises(ValueError, match="current_kl"):
            ctrl.update(float("nan"), 1)
        with pytest.raises(ValueError, match="current_kl"):
            ctrl.update(torch.tensor([1.0, 2.0]), 1)
        with pytest.raises(TypeError, match="current_kl"):
            ctrl.update("1.0", 1)
        with pytest.raises(ValueError, match="n_steps"):
            ctrl.update(1.0, -1)
        with pytest.raises(TypeError, match="n_steps"):
            ctrl.update(1.0, 2.5)


def ref_adaptive_substeps(beta, target, horizon, kl, n):
    """The Ziegler update applied once per horizon-sized chunk of the n steps."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    while n > horizon:
        beta *= 1 + error
        n -= horizon
    return beta * (1 + error * n / horizon)


@pytest.mark.parametrize("n_steps", [49, 50, 51, 100, 1000, 10**6])
def test_adaptive_coefficient_stays_positive(n_steps):
    """β ← β·(1 + e·n/horizon) with e = −0.2 is ≤ 0 once n ≥ 5·horizon; sub-steps keep β > 0."""
    ctrl = AdaptiveKLController(0.1, 0.05, 10)
    ctrl.update(0.0, n_steps)
    assert ctrl.value > 0
    if n_steps <= 1000:  # 0.8^100 is still a normal float
        want = ref_adaptive_substeps(0.1, 0.05, 10, 0.0, n_steps)
        assert ctrl.value == pytest.approx(want, rel=1e-12)
    ctrl.update(1.0, 10)  # and it can still grow again
    assert ctrl.value > 0


def test_adaptive_exactly_five_horizons_is_not_zero():
    ctrl = AdaptiveKLController(0.1, 0.05, 10)
    ctrl.update(0.0, 50)
    assert ctrl.value == pytest.approx(0.1 * 0.8**5, rel=1e-12)


def test_adaptive_huge_updates_stay_finite_and_positive():
    up = AdaptiveKLController(1.0, 0.05, 1)
    up.update(1e9, 10**7)  # 1.2^(10^7) overflows a float
    assert 0 < up.value < float("inf")
    down = AdaptiveKLController(1.0, 0.05, 1)
    down.update(0.0, 10**7)  # 0.8^(10^7) underflows to 0
    assert down.value > 0


# ---------------------------------------------------------------- state_dict


def test_adaptive_state_dict_round_trip_resumes_the_run():
    """Save after some updates, load into a fresh controller: the rest of the run is identical."""
    updates = [(0.3, 64), (0.01, 64), (0.2, 32), (0.05, 64), (0.5, 16)]
    ctrl = AdaptiveKLController(0.1, 0.1, 1000)
    for kl, n in updates[:2]:
        ctrl.update(kl, n)
    state = ctrl.state_dict()
    assert state == {"value": ctrl.value, "target": 0.1, "horizon": 1000.0}
    assert all(type(v) is float for v in state.values())
    resumed = AdaptiveKLController(5.0, 1.0, 1)  # other settings: the state restores them
    resumed.load_state_dict(state)
    for kl, n in updates[2:]:
        ctrl.update(kl, n)
        resumed.update(kl, n)
        assert resumed.value == ctrl.value
    assert resumed.state_dict() == ctrl.state_dict()
    state["value"] = 123.0  # the returned dict is a copy
    assert ctrl.value != 123.0


def test_fixed_state_dict_round_trip():
    ctrl = FixedKLController(0.05)
    other = FixedKLController(0.5)
    other.load_state_dict(ctrl.state_dict())
    assert other.state_dict() == {"value": 0.05} and other.value == 0.05


def test_state_dict_survives_torch_save(tmp_path):
    ctrl = AdaptiveKLController(0.2, 0.1, 100)
    ctrl.update(0.3, 10)
    torch.save({"kl_ctrl": ctrl.state_dict()}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)["kl_ctrl"]
    fresh = AdaptiveKLController(0.2, 0.1, 100)
    fresh.load_state_dict(loaded)
    assert fresh.value == ctrl.value


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([("value", 0.1)], TypeError, "expects a dict"),
        ({"value": 0.1}, ValueError, r"missing \['horizon', 'target'\]"),
        (
            {"value": 0.1, "target": 0.1, "horizon": 10, "step": 3},
            ValueError,
            r"unexpected \['step'\]",
        ),
        ({"value": -0.1, "target": 0.1, "horizon": 10}, ValueError, r"state_dict\['value'\]"),
        (
            {"value": float("nan"), "target": 0.1, "horizon": 10},
            ValueError,
            r"state_dict\['value'\]",
        ),
        ({"value": 0.1, "target": 0.0, "horizon": 10}, ValueError, r"state_dict\['target'\]"),
        ({"value": 0.1, "target": 0.1, "horizon": -1}, ValueError, r"state_dict\['horizon'\]"),
        ({"value": "0.1", "target": 0.1, "horizon": 10}, TypeError, r"state_dict\['value'\]"),
    ],
)
def test_adaptive_bad_state_raises_and_changes_nothing(state, error, match):
    ctrl = AdaptiveKLController(0.2, 0.1, 100)
    before = ctrl.state_dict()
    with pytest.raises(error, match=match):
        ctrl.load_state_dict(state)
    assert ctrl.state_dict() == before


def test_fixed_bad_state_raises():
    ctrl = FixedKLController(0.1)
    with pytest.raises(ValueError, match=r"unexpected \['horizon', 'target'\]"):
        ctrl.load_state_dict(AdaptiveKLController(0.1, 0.1, 10).state_dict())
    with pytest.raises(ValueError, match=r"state_dict\['value'\]"):
        ctrl.load_state_dict({"value": float("inf")})
    with pytest.raises(ValueError, match=r"missing \['horizon', 'target'\]"):
        AdaptiveKLController(0.1, 0.1, 10).load_state_dict(ctrl.state_dict())
    assert ctrl.value == 0.1
