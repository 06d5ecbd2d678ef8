"""End-to-end smoke tests of the demo loop (a few steps, tiny sizes)."""

import json
import subprocess
import sys

import pytest

from rlmath.demo import DemoConfig
from rlmath.demo.metrics import CORE_KEYS, read_metrics
from rlmath.demo.runner import run_demo
from rlmath.demo.trainer import Trainer

TIMING_KEYS = {"tokens_per_s", "step_time_s"}


def tiny(algo: str, out, **kw) -> DemoConfig:
    base = dict(
        algo=algo,
        steps=3,
        batch_size=4,
        group_size=3,
        seed=0,
        out=out,
        progress=False,
        d_model=32,
        n_layers=1,
        n_heads=2,
        warmup_steps=2,
        warmup_examples=8,
        mini_batches=2,
        ppo_epochs=1,
        lr_warmup_steps=1,
    )
    base.update(kw)
    return DemoConfig(**base)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_loop_runs_and_writes_outputs(algo, tmp_path, capsys):
    result = run_demo(tiny(algo, tmp_path))
    assert not result.interrupted
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert set(CORE_KEYS) <= set(r)
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert 0.0 <= r["success_rate"] <= 1.0
        assert r["kl"] >= 0.0 and r["entropy"] >= 0.0
        assert r["lr"] > 0 and r["tokens_per_s"] > 0
    if algo == "ppo":
        assert all(r["value_loss"] is not None for r in records)
    else:
        assert all(r["value_loss"] is None for r in records)  # no critic
    png = tmp_path / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "success_rate" in out and "greedy success" in out


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_same_seed_same_run(algo, tmp_path):
    a = run_demo(tiny(algo, tmp_path / "a", steps=2)).records
    b = run_demo(tiny(algo, tmp_path / "b", steps=2)).records
    c = run_demo(tiny(algo, tmp_path / "c", steps=2, seed=1)).records

    def strip(rs):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rs]

    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_ctrl_c_keeps_finished_steps(tmp_path, monkeypatch):
    real_step = Trainer.step

    def step(self, n):
        if n == 3:
            raise KeyboardInterrupt
        return real_step(self, n)

    monkeypatch.setattr(Trainer, "step", step)
    result = run_demo(tiny("grpo", tmp_path, steps=5))
    assert result.interrupted
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert (tmp_path / "curves.png").exists()


def test_python_m_rlmath_demo(tmp_path):
    proc = subprocess.run(
        [
            sys.executable, "-m", "rlmath", "demo", "--algo", "grpo", "--steps", "2",
            "--batch-size", "2", "--group-size", "2", "--warmup-steps", "1",
            "--no-progress", "--out", str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2
    assert (tmp_path / "curves.png").exists()


def test_runs_without_the_demo_extras(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import tqdm` / `import matplotlib` raise ImportError.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = run_demo(tiny("grpo", tmp_path, progress=True))
    assert len(result.records) == 3
    out = capsys.readouterr().out
    assert "step 3/3: reward=" in out
    assert "matplotlib is not installed" in out
    assert not (tmp_path / "curves.png").exists()


def test_progress_bar_shows_live_metrics(tmp_path, capsys):
    run_demo(tiny("ppo", tmp_path, progress=True))
    err = capsys.readouterr().err
    assert "PPO" in err and "reward=" in err and "kl=" in err and "entropy=" in err
