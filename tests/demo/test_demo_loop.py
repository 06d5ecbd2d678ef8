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
    pytest.importorskip("matplotlib")  # curves.png
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
    pytest.importorskip("matplotlib")  # curves.png
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


@pytest.mark.integration
def test_python_m_rlmath_demo(tmp_path):
    pytest.importorskip("matplotlib")  # curves.png
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
    pytest.importorskip("tqdm")  # the bar; without it plain lines (test above)
    run_demo(tiny("ppo", tmp_path, progress=True))
    err = capsys.readouterr().err
    assert "PPO" in err and "reward=" in err and "kl=" in err and "entropy=" in err


def test_rerun_refuses_then_overwrites(tmp_path):
    from rlmath.demo.runner import DemoOutputError

    first = run_demo(tiny("grpo", tmp_path, steps=3))
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(DemoOutputError, match="already holds a run .*--overwrite"):
        run_demo(tiny("grpo", tmp_path, steps=1))
    assert (tmp_path / "metrics.jsonl").read_text() == before  # not truncated
    second = run_demo(tiny("grpo", tmp_path, steps=2, seed=1, overwrite=True))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert len(first.records) == 3 and len(second.records) == 2


def test_non_finite_loss_stops_the_run_and_keeps_the_metrics(tmp_path, monkeypatch, capsys):
    """A NaN loss at step 2 stops training there: step 1 stays on disk, the message names both."""
    real_step, real_loss = Trainer.step, Trainer.actor_loss

    def step(self, n):
        self.current_step = n
        return real_step(self, n)

    def actor_loss(self, mb, out_log_prob, entropy, info):
        loss, metrics = real_loss(self, mb, out_log_prob, entropy, info)
        if self.current_step == 2:
            metrics["pg_loss"] = metrics["pg_loss"] * float("nan")
        return loss, metrics

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(Trainer, "actor_loss", actor_loss)
    result = run_demo(tiny("ppo", tmp_path, steps=4))
    assert result.diverged == "step 2: pg_loss is nan (not finite)"
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    out = capsys.readouterr().out
    assert "training diverged at step 2: pg_loss is nan" in out
    assert "after" not in out.split("greedy success")[1]  # no evaluation of a diverged policy


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_a_huge_learning_rate_stops_with_a_named_metric(algo, tmp_path):
    """lr 1e30 (allowed in the Python API, refused by the CLI) diverges: no traceback."""
    result = run_demo(tiny(algo, tmp_path, steps=3, lr=1e30))
    assert result.diverged is not None and result.diverged.startswith("step ")
    assert "(not finite)" in result.diverged
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert len(lines) == len(result.records) < 3


def test_without_matplotlib_no_stale_curves_are_listed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "curves.png").write_bytes(b"an older run's plot")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    result = run_demo(tiny("grpo", tmp_path, steps=2, overwrite=True))
    assert not result.curves_written
    assert not (tmp_path / "curves.png").exists()  # the stale plot was removed
    out = capsys.readouterr().out
    summary = out.split("outputs in")[1]
    assert "metrics.jsonl" in summary
    assert "curves.png not written: matplotlib is not installed" in summary
    assert f"{tmp_path / 'curves.png'}" not in summary


def test_each_run_without_out_gets_a_fresh_folder(tmp_path, monkeypatch, capsys):
    """`rlmath demo` typed twice: two folders under runs/, the first one untouched."""
    from rlmath.cli import main

    monkeypatch.chdir(tmp_path)
    argv = [
        "demo", "--algo", "grpo", "--steps", "1", "--batch-size", "2", "--group-size", "2",
        "--warmup-steps", "1", "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    first_out = capsys.readouterr().out
    (first,) = (tmp_path / "runs").iterdir()
    before = (first / "metrics.jsonl").read_text()
    assert main(argv) == 0
    second_out = capsys.readouterr().out
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2 and first in folders
    (second,) = (f for f in folders if f != first)
    assert (first / "metrics.jsonl").read_text() == before
    assert len(read_metrics(second / "metrics.jsonl")) == 1
    for text, folder in ((first_out, first), (second_out, second)):
        name = str(folder.relative_to(tmp_path))
        assert name.startswith("runs/demo-grpo-")
        # Named at the start and at the end.
        assert text.index(f"outputs: {name}/") < text.index(f"outputs in {name}/")


def test_run_folders_started_in_the_same_second_differ(tmp_path, monkeypatch):
    import rlmath.demo.runner as runner

    monkeypatch.setattr(runner.time, "strftime", lambda fmt: "20260101-000000")
    made = [runner.new_run_folder("ppo", tmp_path) for _ in range(3)]
    assert [p.name for p in made] == [
        "demo-ppo-20260101-000000",
        "demo-ppo-20260101-000000-2",
        "demo-ppo-20260101-000000-3",
    ]
    assert all(p.is_dir() for p in made)


def test_the_printed_wall_time_starts_at_the_given_start(tmp_path, capsys):
    import time

    result = run_demo(tiny("grpo", tmp_path, steps=1), started=time.time() - 1000.0)
    assert result.seconds >= 1000.0
    assert f"wall time {result.seconds:.1f} s" in capsys.readouterr().out
