"""The demo's main loop: set up, warm up, train with a progress bar, write outputs.

The same loop runs in one process and in each process of a data-parallel
(and tensor-parallel) run: :func:`run_demo` finds its place from the
initialized process group (:func:`rlmath.demo.parallel.current_layout`);
only rank 0 writes ``metrics.jsonl`` and ``curves.png`` and prints.
"""

from __future__ import annotations

import io
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from rlmath.demo.batch import ResponseModel
from rlmath.demo.config import DemoConfig
from rlmath.demo.grpo import GRPOTrainer
from rlmath.demo.metrics import MetricsWriter, NonFiniteError, Record, summary_table
from rlmath.demo.model import ModelConfig, build_model
from rlmath.demo.parallel import Layout, current_layout
from rlmath.demo.plot import plot_curves
from rlmath.demo.ppo import PPOTrainer
from rlmath.demo.rollout import greedy_success_rate
from rlmath.demo.task import SortTask, Vocab
from rlmath.demo.trainer import Trainer
from rlmath.demo.vocab_parallel_head import VocabParallelLMHead
from rlmath.demo.warmup import supervised_warmup

__all__ = [
    "OUTPUT_FILES",
    "DemoOutputError",
    "DemoResult",
    "new_run_folder",
    "prepare_output",
    "run_demo",
    "run_demo_worker",
]

#: What a run writes to its output folder.
OUTPUT_FILES = ("metrics.jsonl", "curves.png")

#: Where runs without ``--out`` get their own folder (relative to the working directory).
RUNS_ROOT = Path("runs")


class DemoOutputError(ValueError):
    """The output folder cannot be used: not a folder, not writable, or holds a run."""


@dataclass
class DemoResult:
    """What a run produced; ``records`` are the lines of ``metrics.jsonl``."""

    out: Path
    records: list[Record] = field(default_factory=list)
    interrupted: bool = False
    #: Why training stopped early (a NaN/inf loss: "step 3: pg_loss is nan ..."), else None.
    diverged: str | None = None
    #: Whether curves.png was written (False without matplotlib or without any step).
    curves_written: bool = False
    greedy_before: float = float("nan")
    greedy_after: float = float("nan")
    seconds: float = 0.0


def _setup(cfg: DemoConfig) -> torch.device:
    # One thread: at this model size more threads add overhead, not speed, and
    # on a busy machine they contend for cores.
    threads = cfg.threads or 1
    torch.set_num_threads(threads)
    # The same seed on every rank: every rank builds the same initial model.
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def _check_output(cfg: DemoConfig, layout: Layout) -> Path:
    """:func:`prepare_output` on rank 0; its folder, or its error, on every rank."""
    answer: tuple[str, str] | None = None
    if layout.is_main:
        try:
            answer = ("ok", str(prepare_output(cfg)))
        except DemoOutputError as err:
            answer = ("error", str(err))
    kind, text = layout.broadcast(answer)
    if kind == "error":
        raise DemoOutputError(text)
    return Path(text)


def new_run_folder(algo: str, root: Path = RUNS_ROOT) -> Path:
    """Create and return a fresh folder ``root/demo-<algo>-<YYYYmmdd-HHMMSS>``.

    Two runs started in the same second get different folders: the folder is
    created with ``mkdir`` (which fails when it exists), and a taken name gets
    the suffix ``-2``, ``-3``, ... . No existing folder is ever reused.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = root / f"demo-{algo}-{stamp}"
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise DemoOutputError(f"no free run folder named {base}-N in {root}")


def prepare_output(cfg: DemoConfig) -> Path:
    """Check and create the output folder before any work; return it.

    Without ``cfg.out`` a fresh folder is created by :func:`new_run_folder`
    (``runs/demo-<algo>-<timestamp>``), so a run never touches an earlier
    one. With ``cfg.out``, raises :class:`DemoOutputError` when the path is a
    file, lies below a file, cannot be created or written, or already holds a
    run's outputs (:data:`OUTPUT_FILES`; an empty ``metrics.jsonl`` does not
    count) and ``cfg.overwrite`` is false. With ``overwrite`` the previous
    outputs are deleted here, so no file of an older run can be mistaken for
    this one's.
    """
    if cfg.out is None:
        try:
            out = new_run_folder(cfg.algo)
        except OSError as err:
            raise DemoOutputError(
                f"cannot create a run folder in {RUNS_ROOT}: {err.strerror or err}"
            ) from None
    else:
        out = cfg.out
    if out.exists() and not out.is_dir():
        raise DemoOutputError(f"{out} exists and is not a folder")
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise DemoOutputError(f"{out} is below {ancestor}, which is a file, not a folder")
    previous = [
        name
        for name in OUTPUT_FILES
        if (out / name).is_file() and (name != "metrics.jsonl" or (out / name).stat().st_size > 0)
    ]
    if previous and not cfg.overwrite:
        raise DemoOutputError(
            f"{out} already holds a run ({', '.join(previous)}); pass --overwrite to replace "
            "it, or choose another --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUT_FILES:
            (out / name).unlink(missing_ok=True)
        probe = out / f".rlmath-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DemoOutputError(f"cannot write to {out}: {err.strerror or err}") from None
    return out


def run_demo(
    cfg: DemoConfig, *, stream: TextIO | None = None, started: float | None = None
) -> DemoResult:
    """Run one demo end to end; returns the records also written to the output folder.

    The output folder is checked (and created) first, before any work: see
    :func:`prepare_output`; ``DemoResult.out`` names it. ``started`` is the
    ``time.time()`` at which the command started (the printed wall time runs
    from it; default: now). Ctrl-C (``KeyboardInterrupt``) during training
    stops the loop after the steps already finished: their metrics are on
    disk (each line is flushed), and the plot and summary are still produced
    from them. A NaN or infinite loss, gradient norm or rollout statistic
    stops training the same way, with ``DemoResult.diverged`` naming the step
    and the metric.
    """
    t_start = time.time() if started is None else started
    device = _setup(cfg)
    layout = current_layout(cfg.tp, device)
    out_dir = _check_output(cfg, layout)
    # Only rank 0 speaks.
    stream = (stream or sys.stdout) if layout.is_main else io.StringIO()
    vocab = Vocab()
    task = SortTask(vocab, min_len=cfg.min_len, max_len=cfg.max_len)
    model_cfg = ModelConfig(
        vocab_size=vocab.size,
        max_len=task.max_prompt_len + task.max_response_len,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        d_ff=4 * cfg.d_model,
    )
    policy = build_model(cfg.model, model_cfg).to(device, getattr(torch, cfg.dtype))
    gen = torch.Generator().manual_seed(cfg.seed)
    print(
        f"rlmath demo: {cfg.algo.upper()} on 'sort {cfg.min_len}-{cfg.max_len} digits', "
        f"{sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M-parameter {cfg.model} "
        f"transformer, {vocab.size}-token vocabulary, device {device}, {cfg.dtype}, "
        f"seed {cfg.seed}",
        file=stream,
    )
    print(f"outputs: {out_dir}/", file=stream)
    if layout.distributed:
        print(
            f"{layout.world_size} processes: {layout.dp} data-parallel "
            f"({'FSDP2' if cfg.fsdp else 'DDP'}) x {layout.tp} tensor-parallel; "
            f"{cfg.batch_size // layout.dp} of {cfg.batch_size} prompts per rank and step",
            file=stream,
        )
    # Every rank runs the same warm-up (same data, same seed), so every rank
    # starts RL from the same weights without a broadcast.
    losses = supervised_warmup(
        policy,
        task,
        steps=cfg.warmup_steps,
        examples=cfg.warmup_examples,
        batch_size=64,
        lr=1e-3,
        generator=gen,
        device=device,
    )
    eval_gen = torch.Generator().manual_seed(cfg.seed + 100)
    result = DemoResult(out=out_dir)
    result.greedy_before = greedy_success_rate(
        ResponseModel(policy), task, n_prompts=256, generator=eval_gen, device=device,
        layout=layout,
    )  # fmt: skip
    if losses:
        print(
            f"format warm-up: {len(losses)} supervised steps on {cfg.warmup_examples} prompts "
            f"(targets: the prompt's digits in random order), loss {losses[0]:.2f} → "
            f"{losses[-1]:.2f}; greedy success on fresh prompts {result.greedy_before:.2f}",
            file=stream,
        )
    if layout.tp > 1:
        # Each tensor-parallel rank keeps its slice of the warmed-up head.
        assert isinstance(policy.lm_head, torch.nn.Linear)
        policy.lm_head = VocabParallelLMHead.from_linear(policy.lm_head, layout)
    trainer: Trainer = (PPOTrainer if cfg.algo == "ppo" else GRPOTrainer)(
        cfg, policy, task, device, layout
    )
    writer = MetricsWriter(out_dir / "metrics.jsonl" if layout.is_main else Path(os.devnull))
    bar = _Progress(cfg, stream) if cfg.progress and layout.is_main else None
    try:
        for step in range(1, cfg.steps + 1):
            try:
                record = trainer.step(step)
            except NonFiniteError as err:
                result.diverged = f"step {step}: {err}"
                break
            writer.write(record)
            if bar is not None:
                bar.update(record)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    result.records = writer.records
    if result.interrupted:
        print(f"interrupted after {len(result.records)} steps; metrics kept", file=stream)
    elif result.diverged:
        print(
            f"training diverged at {result.diverged}; stopped. The {len(result.records)} "
            f"finished steps are kept in {out_dir / 'metrics.jsonl'} (try a smaller --lr)",
            file=stream,
        )
    else:
        result.greedy_after = greedy_success_rate(
            trainer.actor, task, n_prompts=256, generator=eval_gen, device=device, layout=layout
        )
    if result.records and layout.is_main:
        try:
            plot_curves(
                result.records,
                out_dir / "curves.png",
                title=f"rlmath demo: {cfg.algo.upper()}, seed {cfg.seed}",
            )
        except ImportError:
            print(
                "matplotlib is not installed: no curves.png (pip install matplotlib, or rlmath's demo extra)",
                file=stream,
            )
        else:
            result.curves_written = True
    result.seconds = time.time() - t_start
    _print_summary(cfg, result, stream)
    return result


def run_demo_worker(cfg: DemoConfig, started: float | None = None) -> DemoResult:
    """:func:`run_demo` in a process started by ``rlmath.distributed.run_distributed``."""
    return run_demo(cfg, started=started)


class _Progress:
    """A tqdm bar with live reward / success / KL / entropy; plain lines without tqdm."""

    def __init__(self, cfg: DemoConfig, stream: TextIO) -> None:
        self.stream = stream
        self.every = max(1, cfg.steps // 20)
        self.total = cfg.steps
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=cfg.steps, desc=cfg.algo.upper(), unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, float]) -> None:
        live = {
            "reward": f"{record['reward_mean']:.3f}",
            "success": f"{record['success_rate']:.2f}",
            "kl": f"{record['kl']:.4f}",
            "entropy": f"{record['entropy']:.3f}",
        }
        if self.bar is not None:
            self.bar.set_postfix(live, refresh=False)
            self.bar.update(1)
        elif record["step"] % self.every == 0 or record["step"] == self.total:
            text = ", ".join(f"{k}={v}" for k, v in live.items())
            print(f"step {int(record['step'])}/{self.total}: {text}", file=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_summary(cfg: DemoConfig, result: DemoResult, stream: TextIO) -> None:
    print("", file=stream)
    print(summary_table(result.records), file=stream)
    line = f"greedy success on 256 fresh prompts: {result.greedy_before:.2f} before RL"
    if not result.interrupted and not result.diverged:
        line += f", {result.greedy_after:.2f} after"
    print(line, file=stream)
    print(f"wall time {result.seconds:.1f} s; outputs in {result.out}/", file=stream)
    if result.records:
        print(f"  {result.out / 'metrics.jsonl'}", file=stream)
        if result.curves_written:
            print(f"  {result.out / 'curves.png'}", file=stream)
        else:
            print("  (curves.png not written: matplotlib is not installed)", file=stream)
