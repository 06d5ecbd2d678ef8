"""The ``rlmath`` command line rejects bad flags with argparse errors."""

import subprocess
import sys

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


def test_hf_tiny_without_transformers_is_a_clear_error(capsys):
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model", "hf-tiny"])
    assert exc.value.code == 2
    assert "pip install transformers" in capsys.readouterr().err


def test_build_model_hf_tiny_without_transformers_raises():
    import importlib.util

    from rlmath.demo.model import ModelConfig, build_model

    if importlib.util.find_spec("transformers") is not None:
        pytest.skip("transformers is installed here")
    with pytest.raises(RuntimeError, match="transformers"):
        build_model("hf-tiny", ModelConfig(vocab_size=14))


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
    ):
        assert flag in out


def test_ctrl_c_outside_the_loop_exits_130(monkeypatch, capsys):
    import rlmath.demo.runner as runner

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_demo", interrupted)
    assert main(["demo", "--steps", "1"]) == 130
    assert "interrupted" in capsys.readouterr().err
