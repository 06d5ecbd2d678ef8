"""The demo under data and tensor parallelism equals the one-process run.

With ``--dtype float64`` a run of N processes (DDP, FSDP2, a vocabulary-parallel
head) must write the same ``metrics.jsonl`` as one process, step by step: the
same tokens are sampled (per-sample random streams), every statistic is global
and the losses' aggregation makes the averaged gradient the full mini-batch's.
What differs is only the order of floating-point sums (a rank's rows, the
reductions), ~1e-16 relative per operation; over three steps of training that
stays far below the 1e-9 asserted here (measured: below 1e-13).
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from rlmath.cli import main
from rlmath.demo.metrics import read_metrics

TIMING_KEYS = {"tokens_per_s", "step_time_s"}
RTOL = 1e-9

# Small steps: a GRPO step of 4 prompts x 4 responses; with 4 mini-batches a
# PPO mini-batch is one row, so one of two ranks holds none of it (the rank
# then joins with an empty share).
COMMON = [
    "--steps", "3", "--batch-size", "4", "--group-size", "4", "--warmup-steps", "2",
    "--mini-batches", "4", "--dtype", "float64", "--no-progress",
]  # fmt: skip

_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
needs_cpu_fsdp2 = pytest.mark.skipif(
    _TORCH < (2, 7), reason="FSDP2 on CPU (gloo) needs torch >= 2.7"
)


def run(tmp_path, name, algo, *extra):
    out = tmp_path / name
    assert main(["demo", "--algo", algo, *COMMON, "--out", str(out), *extra]) == 0
    return read_metrics(out / "metrics.jsonl")


def assert_same_metrics(one, many):
    assert [r["step"] for r in many] == [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(one, many, strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - TIMING_KEYS:
            x, y = a[key], b[key]
            if x is None or y is None:
                assert x is y, (a["step"], key, x, y)
            else:
                assert math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-15), (a["step"], key, x, y)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    return {algo: run(root, algo, algo) for algo in ("grpo", "ppo")}


@pytest.mark.integration
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(["--nproc", "2"], id="ddp"),
        pytest.param(["--nproc", "2", "--fsdp"], id="fsdp", marks=needs_cpu_fsdp2),
        pytest.param(["--nproc", "2", "--tp", "2"], id="tp"),
    ],
)
def test_two_processes_write_the_metrics_of_one(algo, layout, one_process, tmp_path):
    assert_same_metrics(one_process[algo], run(tmp_path, "n2", algo, *layout))


@pytest.mark.integration
def test_a_truncating_sampler_over_a_vocabulary_parallel_head(tmp_path):
    # The kept set over the head's two shards is the one-process kept set: the same run.
    sampler = ["--top-p", "0.8", "--top-k", "8"]
    one = run(tmp_path, "one", "grpo", *sampler)
    assert_same_metrics(one, run(tmp_path, "tp", "grpo", "--nproc", "2", "--tp", "2", *sampler))
    assert all(abs(r["rollout_ratio"] - 1) < 1e-12 for r in one)


@pytest.mark.integration
def test_only_rank_zero_writes_and_prints(tmp_path, capfd):
    pytest.importorskip("matplotlib")
    run(tmp_path, "n2", "grpo", "--nproc", "2")
    assert sorted(p.name for p in (tmp_path / "n2").iterdir()) == ["curves.png", "metrics.jsonl"]
    # The processes share this stdout: one header and one summary, from rank 0.
    out = capfd.readouterr().out
    assert out.count("rlmath demo: GRPO") == 1
    assert out.count("2 processes: 2 data-parallel (DDP) x 1 tensor-parallel") == 1
    assert out.count("wall time") == 1


@pytest.mark.integration
def test_nproc_after_a_default_run_gets_its_own_folder(tmp_path, monkeypatch):
    """`rlmath demo` then `rlmath demo --nproc 2`, both without --out, both succeed."""
    monkeypatch.chdir(tmp_path)
    short = ["--algo", "grpo", "--steps", "1", "--batch-size", "4", "--group-size", "2",
             "--warmup-steps", "1", "--no-progress"]  # fmt: skip
    assert main(["demo", *short]) == 0
    (first,) = (tmp_path / "runs").iterdir()
    before = (first / "metrics.jsonl").read_text()
    assert main(["demo", *short, "--nproc", "2"]) == 0
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2
    assert (first / "metrics.jsonl").read_text() == before
    for folder in folders:
        assert len(read_metrics(folder / "metrics.jsonl")) == 1


@pytest.mark.integration
def test_torchrun_runs_the_same_loop(one_process, tmp_path):
    out = tmp_path / "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "-m", "rlmath", "demo", "--algo", "grpo", *COMMON,
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes: 2 data-parallel (DDP)" in proc.stdout
    assert_same_metrics(one_process["grpo"], read_metrics(out / "metrics.jsonl"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "3"], "--batch-size 4 is not divisible by the 3 data-parallel ranks"),
        (["--nproc", "8"], "8 data-parallel ranks but only 4 prompts per step"),
        (["--nproc", "2", "--tp", "3"], "--tp 3 is larger than the number of processes (2)"),
        (["--nproc", "6", "--tp", "4"], "--tp 4 does not divide the number of processes (6)"),
        (["--nproc", "4", "--tp", "4"], "--tp 4 does not divide the vocabulary (14 tokens)"),
        (["--tp", "2"], "--tp 2 is larger than the number of processes (1)"),
        (["--fsdp"], "--fsdp shards the model over data-parallel ranks"),
    ],
)
def test_bad_layouts_fail_before_any_work(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--batch-size", "4", "--out", str(out), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_nproc_under_torchrun_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main(["demo", "--nproc", "2"])
    assert "under torchrun (WORLD_SIZE is set) leave it out" in capsys.readouterr().err


def test_torchrun_layout_is_checked_against_world_size(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        main(["demo", "--batch-size", "4"])
    assert "not divisible by the 3 data-parallel ranks" in capsys.readouterr().err


def test_tp_needs_the_tiny_model(capsys):
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit):
        main(["demo", "--model", "hf-tiny", "--nproc", "2", "--tp", "2"])
    assert "--tp needs --model tiny" in capsys.readouterr().err


def test_fsdp_on_cpu_needs_torch_2_7(monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", "2.6.0+cpu")
    with pytest.raises(SystemExit):
        main(["demo", "--batch-size", "4", "--nproc", "2", "--fsdp"])
    assert "--fsdp on CPU needs torch >= 2.7 (FSDP2 on gloo); this is 2.6.0+cpu" in (
        capsys.readouterr().err
    )


def test_the_vocabulary_parallel_head_takes_a_bias_free_linear():
    from rlmath.demo.parallel import Layout
    from rlmath.demo.vocab_parallel_head import VocabParallelLMHead

    with pytest.raises(ValueError, match="bias-free nn.Linear"):
        VocabParallelLMHead.from_linear(torch.nn.Linear(4, 6), Layout())
    head = VocabParallelLMHead.from_linear(torch.nn.Linear(4, 6, bias=False), Layout())
    assert head.weight.shape == (6, 4) and head.vocab_start == 0 and head.vocab_size == 6
