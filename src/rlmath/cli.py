"""The ``rlmath`` command line: ``rlmath demo [--algo ppo|grpo] ...`` and ``rlmath bench [AREA] ...``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["build_parser", "main", "version"]


def version() -> str:
    """rlmath's version (``rlmath/_version.py``, the same as ``rlmath.__version__``)."""
    from rlmath._version import __version__

    return __version__


def _process_start() -> float:
    """The ``time.time()`` at which this process started (Linux), else the import of this module."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22, counted after the command name (which may hold spaces).
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def _number(
    kind: Callable[[str], float],
    low: float,
    high: float,
    *,
    inclusive: bool = True,
) -> Callable[[str], float]:
    """An argparse ``type``: parse with ``kind``, then check ``low < value`` (or ``<=``) ``<= high``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {low:g}, got {text}"
            )
        if value > high:
            bound = f"{int(high)}" if kind is int else f"{high:g}"
            raise argparse.ArgumentTypeError(f"must be <= {bound}, got {text}")
        return value

    return parse


def _range(low: float, high: float, *, inclusive: bool = True) -> str:
    return f"{'[' if inclusive else '('}{low:g}, {high:g}]"


# Upper bounds that keep a run meaningful on the machines the demo targets: a
# step takes about 0.3-0.7 s at the defaults, a rollout row about 25 tokens,
# and larger values only end in an out-of-memory error, a run of days, or a
# diverged policy. Each is listed in ``rlmath demo --help`` and docs/demo.md.
MAX_STEPS = 100_000
MAX_BATCH_SIZE = 4096
MAX_GROUP_SIZE = 64
#: Rollout rows per step: batch size (PPO) or batch size × group size (GRPO).
MAX_ROWS = 4096
MAX_LR = 1.0
MAX_KL_COEF = 100.0
MAX_SEED = 2**32 - 1
MAX_PPO_EPOCHS = 100
MAX_CLIP_RATIO = 1.0
MAX_ENTROPY_COEF = 10.0
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MAX_TOP_K = 1_000_000
MAX_WARMUP_STEPS = 100_000
MAX_THREADS = 256
MAX_DIGITS = 10
MAX_NPROC = 64


def _add_demo_args(p: argparse.ArgumentParser) -> None:
    from rlmath.demo.config import ALGO_DEFAULTS, ALGOS, DemoConfig
    from rlmath.demo.model import MODEL_KINDS

    d = DemoConfig()
    p.add_argument(
        "--algo", choices=ALGOS, default=d.algo, help="RL algorithm (default: %(default)s)"
    )
    p.add_argument(
        "--steps",
        type=_number(int, 1, MAX_STEPS),
        help=f"RL steps, in {_range(1, MAX_STEPS)} (default: {d.steps})",
    )
    batch = ", ".join(f"{ALGO_DEFAULTS[a]['batch_size']} for {a}" for a in ALGOS)
    p.add_argument(
        "--batch-size",
        type=_number(int, 1, MAX_BATCH_SIZE),
        help=(
            f"prompts per step, in {_range(1, MAX_BATCH_SIZE)}; with GRPO batch size x group "
            f"size must be <= {MAX_ROWS} (default: {batch})"
        ),
    )
    p.add_argument(
        "--group-size",
        type=_number(int, 1, MAX_GROUP_SIZE),
        default=d.group_size,
        help=f"GRPO: responses per prompt, in [2, {MAX_GROUP_SIZE}] (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=_number(float, 0.0, MAX_LR, inclusive=False),
        help=f"peak policy learning rate, in {_range(0, MAX_LR, inclusive=False)} "
        f"(default: {d.lr:g})",
    )
    p.add_argument(
        "--kl-coef",
        type=_number(float, 0.0, MAX_KL_COEF),
        help=(
            "PPO: initial coefficient of the adaptive KL reward penalty; GRPO: coefficient "
            f"of the k3 KL loss; in {_range(0, MAX_KL_COEF)} (default: {d.kl_coef:g})"
        ),
    )
    p.add_argument(
        "--seed",
        type=_number(int, 0, MAX_SEED),
        default=d.seed,
        help="random seed, in [0, 2^32 - 1] (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default=d.device,
        help="torch device: cpu, cuda, cuda:N (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="output folder, created if missing; it must not hold a previous run unless "
        "--overwrite is given (default: a new folder runs/demo-<algo>-<date>-<time> for "
        "each run)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --out: replace the metrics.jsonl and curves.png of a previous run there",
    )
    p.add_argument(
        "--model",
        choices=MODEL_KINDS,
        default=d.model,
        help="tiny (defined in rlmath.demo) or hf-tiny (needs transformers)",
    )
    p.add_argument(
        "--threads",
        type=_number(int, 1, MAX_THREADS),
        help=f"torch CPU threads, in {_range(1, MAX_THREADS)} (default: 1, the fastest at "
        "this size)",
    )
    p.add_argument(
        "--ppo-epochs",
        type=_number(int, 1, MAX_PPO_EPOCHS),
        default=d.ppo_epochs,
        help=f"passes over each rollout, in {_range(1, MAX_PPO_EPOCHS)} (default: %(default)s)",
    )
    p.add_argument(
        "--mini-batches",
        type=_number(int, 1, MAX_ROWS),
        default=d.mini_batches,
        help="optimizer steps per pass, at most the rollout rows per step (default: %(default)s)",
    )
    p.add_argument(
        "--clip-ratio",
        type=_number(float, 0.0, MAX_CLIP_RATIO, inclusive=False),
        default=d.clip_ratio,
        help=f"PPO clip ε, in {_range(0, MAX_CLIP_RATIO, inclusive=False)} (default: %(default)s)",
    )
    p.add_argument(
        "--entropy-coef",
        type=_number(float, 0.0, MAX_ENTROPY_COEF),
        default=d.entropy_coef,
        help=f"entropy bonus coefficient, in {_range(0, MAX_ENTROPY_COEF)} (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=_number(float, MIN_TEMPERATURE, MAX_TEMPERATURE),
        default=d.temperature,
        help=f"sampling temperature, in {_range(MIN_TEMPERATURE, MAX_TEMPERATURE)} "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=_number(int, 1, MAX_TOP_K),
        default=None,
        help=f"sample from the k most likely tokens only, in {_range(1, MAX_TOP_K)} "
        "(default: no top-k); the trainer's log-probs use the same kept set",
    )
    p.add_argument(
        "--top-p",
        type=_number(float, 0.0, 1.0, inclusive=False),
        default=None,
        help="sample from the smallest set of most likely tokens whose probability reaches p, "
        "in (0, 1] (default: no top-p); the trainer's log-probs use the same kept set",
    )
    p.add_argument(
        "--min-p",
        type=_number(float, 0.0, 1.0),
        default=None,
        help="sample only tokens at least min-p times as likely as the most likely one, "
        "in [0, 1] (default: no min-p); the trainer's log-probs use the same kept set",
    )
    p.add_argument(
        "--warmup-steps",
        type=_number(int, 0, MAX_WARMUP_STEPS),
        default=d.warmup_steps,
        help=f"supervised format warm-up steps before RL, in {_range(0, MAX_WARMUP_STEPS)}, "
        "0 to skip (default: %(default)s)",
    )
    p.add_argument(
        "--min-len",
        type=_number(int, 1, MAX_DIGITS),
        default=d.min_len,
        help=f"fewest digits in a prompt, in {_range(1, MAX_DIGITS)} (default: %(default)s)",
    )
    p.add_argument(
        "--max-len",
        type=_number(int, 1, MAX_DIGITS),
        default=d.max_len,
        help=f"most digits in a prompt, in {_range(1, MAX_DIGITS)} (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from rlmath.demo.config import DTYPES

    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=d.dtype,
        help="parameters and computations; float64 makes runs comparable to 1e-9 "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--nproc",
        type=_number(int, 1, MAX_NPROC),
        default=1,
        help=f"start this many processes on this machine, as torchrun --nproc-per-node does, "
        f"in {_range(1, MAX_NPROC)}; the step's prompts are shared out over them "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the models with FSDP2 (fully_shard) instead of replicating them with DDP",
    )
    p.add_argument(
        "--tp",
        type=_number(int, 1, MAX_NPROC),
        default=d.tp,
        help="tensor-parallel ranks per data-parallel rank: the policy's LM head is split "
        "over the vocabulary among them (default: %(default)s)",
    )


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    from rlmath.bench import AREAS
    from rlmath.bench.setting import MAX_REPEATS, MIN_REPEATS

    cores = os.cpu_count() or 1
    p.add_argument(
        "area",
        nargs="?",
        choices=(*AREAS, "all"),
        default="all",
        metavar="AREA",
        help=f"what to measure: {', '.join(AREAS)} or all (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where to run; cuda timings synchronize before reading the clock (default: %(default)s)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small shapes (their tables: docs/benchmarks.md, 'The quick shapes')",
    )
    p.add_argument(
        "--busy-cores",
        type=_number(int, 0, cores),
        default=0,
        metavar="K",
        help=f"keep K cores busy with processes of the benchmark's own while it measures, "
        f"in {_range(0, cores)} (os.cpu_count()); 0: no extra load (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=_number(int, MIN_REPEATS, MAX_REPEATS),
        metavar="N",
        help=f"timed runs per implementation, in {_range(MIN_REPEATS, MAX_REPEATS)} "
        "(default: 5 for logprobs and fused-head, 7 for advantages, 15 for small)",
    )
    p.add_argument(
        "--threads",
        type=_number(int, 1, MAX_THREADS),
        metavar="T",
        help=f"torch CPU threads for the run, in {_range(1, MAX_THREADS)} (default: torch's "
        "own setting, shown above each table)",
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="leave out verl, TRL and TorchRL even where they import",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmath", description="rlmath: the math engine of RLHF training."
    )
    parser.add_argument(
        "--version", action="version", version=f"rlmath {version()}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser(
        "demo",
        help="train a tiny language model with PPO or GRPO on CPU, using rlmath for the math",
        description=(
            "Train a tiny transformer language model to sort digits with PPO or GRPO. "
            "Writes metrics.jsonl and curves.png to --out. Every numeric flag is checked "
            "against the range shown before any work starts; a run whose losses turn "
            "NaN or infinite stops (exit status 1) and keeps the metrics of the finished steps."
        ),
    )
    _add_demo_args(demo)
    bench = sub.add_parser(
        "bench",
        help="benchmark rlmath against the straightforward code on this machine",
        description=(
            "Time rlmath against the straightforward code it replaces (and verl, TRL, "
            "TorchRL where they import) on this machine, and print markdown tables: the "
            "median of interleaved runs, the ratio to the baseline in the same run, peak "
            "memory and the error against fp64. --busy-cores K measures while K cores are "
            "kept busy, as on a shared machine."
        ),
    )
    _add_bench_args(bench)
    return parser


def _demo_config(args: argparse.Namespace, parser: argparse.ArgumentParser):  # type: ignore[no-untyped-def]
    import torch

    from rlmath.demo.config import DemoConfig

    if args.model == "hf-tiny" and importlib.util.find_spec("transformers") is None:
        parser.error(
            "--model hf-tiny needs the optional 'transformers' package, which is not installed "
            "(pip install transformers), or use --model tiny"
        )
    if args.algo == "grpo" and args.group_size < 2:
        parser.error("--group-size must be >= 2 for grpo (advantages compare responses in a group)")
    if args.min_len > args.max_len:
        parser.error(f"--min-len ({args.min_len}) must be <= --max-len ({args.max_len})")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: unknown device {args.device!r} (expected cpu, cuda or cuda:N)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: only cpu and cuda are supported, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    cfg = DemoConfig.for_algo(
        args.algo,
        steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        lr=args.lr,
        kl_coef=args.kl_coef,
        seed=args.seed,
        device=args.device,
        out=args.out,
        overwrite=args.overwrite,
        model=args.model,
        threads=args.threads,
        progress=not args.no_progress,
        min_len=args.min_len,
        max_len=args.max_len,
        warmup_steps=args.warmup_steps,
        ppo_epochs=args.ppo_epochs,
        mini_batches=args.mini_batches,
        clip_ratio=args.clip_ratio,
        entropy_coef=args.entropy_coef,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        dtype=args.dtype,
        fsdp=args.fsdp,
        tp=args.tp,
    )
    _check_processes(args, parser, cfg, device)
    n_rows = cfg.batch_size * (cfg.group_size if args.algo == "grpo" else 1)
    if n_rows > MAX_ROWS:
        parser.error(
            f"--batch-size x --group-size ({cfg.batch_size} x {cfg.group_size} = {n_rows} "
            f"rollout rows per step) must be <= {MAX_ROWS}"
        )
    if cfg.mini_batches > n_rows:
        parser.error(f"--mini-batches ({cfg.mini_batches}) exceeds the rows per step ({n_rows})")
    return cfg


def _check_processes(
    args: argparse.Namespace, parser: argparse.ArgumentParser, cfg, device
) -> None:  # type: ignore[no-untyped-def]
    """Layout errors (processes, --tp, --fsdp) before any work, on every rank alike."""
    import torch

    from rlmath.demo.parallel import LayoutError, check_layout, world_from_env
    from rlmath.demo.task import Vocab

    world = world_from_env()
    if world is not None and args.nproc > 1:
        parser.error(
            "--nproc starts its own processes: under torchrun (WORLD_SIZE is set) leave it out"
        )
    if cfg.tp > 1 and cfg.model != "tiny":
        parser.error(
            f"--tp needs --model tiny (the {cfg.model} model ties its LM head to the embedding)"
        )
    try:
        check_layout(
            world_size=world if world is not None else args.nproc,
            tp=cfg.tp,
            batch_size=cfg.batch_size,
            vocab_size=Vocab().size,
            fsdp=cfg.fsdp,
        )
    except LayoutError as err:
        parser.error(str(err))
    if cfg.fsdp and device.type == "cpu" and _release(torch.__version__) < (2, 7):
        parser.error(
            f"--fsdp on CPU needs torch >= 2.7 (FSDP2 on gloo); this is {torch.__version__}"
        )


def _run_demo(args: argparse.Namespace, cfg, started: float | None = None):  # type: ignore[no-untyped-def]
    """Run the demo in this process, in each torchrun process, or in ``--nproc`` new ones."""
    import torch

    from rlmath.demo.parallel import world_from_env
    from rlmath.demo.runner import prepare_output, run_demo, run_demo_worker

    backend = "nccl" if torch.device(cfg.device).type == "cuda" else "gloo"
    if world_from_env() is not None:
        import torch.distributed as dist

        from rlmath.distributed import init_from_env

        init_from_env(backend)
        try:
            result = run_demo(cfg, started=started)
            dist.barrier()  # every rank leaves together
        except BaseException:
            dist.destroy_process_group()
            raise
        if _release(torch.__version__) < (2, 7):
            # torch 2.6's gloo group can deadlock in its destructor (it holds the
            # GIL while joining a worker thread that waits for it): end the
            # process here, after the last collective, without tearing it down.
            status = _demo_status(result)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        dist.destroy_process_group()
        return result
    if args.nproc > 1:
        from rlmath.distributed import run_distributed

        # The folder is made before starting anything; the workers write to it.
        cfg = dataclasses.replace(cfg, out=prepare_output(cfg))
        # No time limit: a run takes as long as it takes; a rank that fails
        # ends the others.
        return run_distributed(
            run_demo_worker, args.nproc, cfg, started, backend=backend, timeout=None
        )[0]
    return run_demo(cfg, started=started)


def _run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``rlmath bench``: settings checked before any work, then the tables on stdout."""
    import torch

    from rlmath.bench import BenchSettingError, run

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    try:
        run(
            args.area,
            device=args.device,
            quick=args.quick,
            busy_cores=args.busy_cores,
            repeats=args.repeats,
            threads=args.threads,
            peers=not args.no_peers,
        )
    except BenchSettingError as err:
        parser.error(str(err))
    except KeyboardInterrupt:
        # The busy processes are ended on the way out of the benchmark.
        print("\nrlmath bench: interrupted", file=sys.stderr)
        return 130
    return 0


def _release(version: str) -> tuple[int, ...]:
    """``(major, minor)`` of a torch version string such as ``"2.6.0+cu124"``."""
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2])


def _demo_status(result) -> int:  # type: ignore[no-untyped-def]
    """The exit status of a finished demo run (1: diverged, 130: interrupted)."""
    if result.diverged:
        print(f"rlmath demo: training diverged at {result.diverged}", file=sys.stderr)
        return 1
    return 130 if result.interrupted else 0


def main(argv: Sequence[str] | None = None, *, started: float | None = None) -> int:
    """The ``rlmath`` command line; returns the exit status.

    ``started``: the ``time.time()`` at which the command started (the demo's
    wall time runs from it); default: the start of this process.
    """
    if started is None:
        started = _process_start()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        cfg = _demo_config(args, parser)
        from rlmath.demo.runner import DemoOutputError

        try:
            result = _run_demo(args, cfg, started)
        except DemoOutputError as err:
            # Raised before any work: the output folder is checked first.
            parser.error(f"--out: {err}")
        except KeyboardInterrupt:
            # Ctrl-C outside the RL loop (set-up, warm-up, final evaluation):
            # the loop itself stops cleanly and keeps its metrics.
            print("\nrlmath demo: interrupted", file=sys.stderr)
            return 130
        return _demo_status(result)
    if args.command == "bench":
        return _run_bench(args, parser)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
