"""The ``rlmath`` command line rejects bad flags with argparse errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlmath.cli import build_parser, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--algo", "dpo"], "invalid choice: 'dpo'"),
        (["demo", "--steps", "0"], "--steps: must be >= 1, got 0"),
        (["demo", "--steps", "ten"], "--steps: expected an integer, got 'ten'"),
        (["demo", "--batch-size", "-4"], "--batch-size: must be >= 1"),
        (["demo", "--lr", "0"], "--lr: must be > 0"),
        (["demo", "--lr", "nan"], "--lr: expected a finite number"),
        (["demo", "--kl-coef", "-0.1"], "--kl-coef: must be >= 0"),
        (["demo", "--algo", "grpo", "--group-size", "1"], "--group-size must be >= 2 for grpo"),
        (["demo", "--min-len", "5", "--max-len", "3"], "--min-len (5) must be <= --max-len (3)"),
        (["demo", "--device", "tpu"], "--device"),
        (["demo", "--mini-batches", "100", "--batch-size", "4"], "--mini-batches (100) exceeds"),
        (["demo", "--unknown-flag"], "unrecognized arguments: --unknown-flag"),
        # absurd values are refused up front, with the bound
        (["demo", "--lr", "1e30"], "--lr: must be <= 1, got 1e30"),
        (["demo", "--kl-coef", "1e300"], "--kl-coef: must be <= 100, got 1e300"),
        (["demo", "--seed", "99999999999999999999"], "--seed: must be <= 4294967295"),
        (["demo", "--seed", "-1"], "--seed: must be >= 0"),
        (["demo", "--batch-size", "100000000"], "--batch-size: must be <= 4096"),
        (["demo", "--ppo-epochs", "1000000"], "--ppo-epochs: must be <= 100"),
        (["demo", "--steps", "1000001"], "--steps: must be <= 100000"),
        (["demo", "--group-size", "65"], "--group-size: must be <= 64"),
        (["demo", "--batch-size", "1024", "--group-size", "8"], "must be <= 4096"),
        (["demo", "--temperature", "0.001"], "--temperature: must be >= 0.01"),
        (["demo", "--temperature", "1e9"], "--temperature: must be <= 100"),
        (["demo", "--clip-ratio", "5"], "--clip-ratio: must be <= 1"),
        (["demo", "--entropy-coef", "1e6"], "--entropy-coef: must be <= 10"),
        (["demo", "--warmup-steps", "1e9"], "--warmup-steps: expected an integer"),
        (["demo", "--threads", "100000"], "--threads: must be <= 256"),
        (["demo", "--max-len", "11"], "--max-len: must be <= 10"),
        (["demo", "--top-p", "0"], "--top-p: must be > 0, got 0"),
        (["demo", "--top-p", "1.5"], "--top-p: must be <= 1, got 1.5"),
        (["demo", "--top-k", "0"], "--top-k: must be >= 1, got 0"),
        (["demo", "--min-p", "-0.1"], "--min-p: must be >= 0"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_flags_exit_with_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_unavailable_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "cuda"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_hf_tiny_without_transformers_is_a_clear_error(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )  # as if transformers were not installed
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model", "hf-tiny"])
    assert exc.value.code == 2
    assert "pip install transformers" in capsys.readouterr().err


def test_build_model_hf_tiny_without_transformers_raises(monkeypatch):
    from rlmath.demo.model import ModelConfig, build_model

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(RuntimeError, match="transformers"):
        build_model("hf-tiny", ModelConfig(vocab_size=14))


@pytest.mark.integration
def test_help_lists_the_documented_flags():
    text = build_parser().parse_known_args(["demo"])[0]
    assert text.command == "demo"
    out = subprocess.run(
        [sys.executable, "-m", "rlmath", "demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--algo",
        "--steps",
        "--batch-size",
        "--group-size",
        "--lr",
        "--kl-coef",
        "--seed",
        "--device",
        "--out",
        "--top-k",
        "--top-p",
        "--min-p",
    ):
        assert flag in out


def test_ctrl_c_outside_the_loop_exits_130(monkeypatch, capsys):
    import rlmath.demo.runner as runner

    def interrupted(cfg, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_demo", interrupted)
    assert main(["demo", "--steps", "1"]) == 130
    assert "interrupted" in capsys.readouterr().err


def _no_work(monkeypatch):
    """Make any model building or warm-up fail the test: a refusal must come first."""
    import rlmath.demo.runner as runner

    def work(*args, **kwargs):
        raise AssertionError("the demo started working before checking --out")

    monkeypatch.setattr(runner, "build_model", work)
    monkeypatch.setattr(runner, "supervised_warmup", work)


def _out_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_out_pointing_at_a_file_fails_first(tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    f = tmp_path / "file.txt"
    f.write_text("not a folder")
    err = _out_error(["demo", "--out", str(f)], capsys)
    assert f"--out: {f} exists and is not a folder" in err
    assert f.read_text() == "not a folder"


def test_out_below_a_file_fails_first(tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    f = tmp_path / "file.txt"
    f.write_text("x")
    err = _out_error(["demo", "--out", str(f / "sub" / "run")], capsys)
    assert f"--out: {f / 'sub' / 'run'} is below {f}, which is a file" in err


def test_out_in_an_unwritable_place_fails_first(monkeypatch, capsys):
    _no_work(monkeypatch)
    err = _out_error(["demo", "--out", "/proc/rlmath-demo-test/run"], capsys)
    assert "--out: cannot write to /proc/rlmath-demo-test/run" in err


@pytest.mark.parametrize("previous", ["metrics.jsonl", "curves.png"])
def test_rerun_into_a_run_folder_is_refused_and_names_overwrite(
    tmp_path, monkeypatch, capsys, previous
):
    _no_work(monkeypatch)
    lines = '{"step": 1}\n{"step": 2}\n'
    (tmp_path / previous).write_text(lines)
    err = _out_error(["demo", "--out", str(tmp_path)], capsys)
    assert "already holds a run" in err and "--overwrite" in err and previous in err
    assert (tmp_path / previous).read_text() == lines  # nothing truncated


def test_empty_metrics_file_is_not_a_run(tmp_path, monkeypatch):
    """A run stopped during warm-up leaves an empty metrics.jsonl: nothing to protect."""
    from rlmath.demo.config import DemoConfig
    from rlmath.demo.runner import prepare_output

    (tmp_path / "metrics.jsonl").write_text("")
    assert prepare_output(DemoConfig(out=tmp_path)) == tmp_path


def test_overwrite_flag_reaches_the_config():
    from rlmath.cli import _demo_config

    parser = build_parser()
    args = parser.parse_args(["demo", "--overwrite"])
    assert _demo_config(args, parser).overwrite is True
    args = parser.parse_args(["demo"])
    assert _demo_config(args, parser).overwrite is False


def test_help_shows_the_ranges():
    text = build_parser()._subparsers._group_actions[0].choices["demo"].format_help()
    for fragment in (
        "RL steps, in [1, 100000]",
        "in [1, 4096]",
        "in (0, 1]",
        "in [0, 100]",
        "in [0, 2^32 - 1]",
        "in [1, 100]",
        "in [0.01, 100]",
        "--overwrite",
    ):
        assert fragment in " ".join(text.split()), fragment


def test_diverged_run_exits_1(monkeypatch, capsys):
    import rlmath.demo.runner as runner

    def diverged(cfg, **kwargs):
        return runner.DemoResult(out=Path("unused"), diverged="step 3: pg_loss is nan (not finite)")

    monkeypatch.setattr(runner, "run_demo", diverged)
    assert main(["demo", "--steps", "5"]) == 1
    assert "step 3: pg_loss is nan" in capsys.readouterr().err
