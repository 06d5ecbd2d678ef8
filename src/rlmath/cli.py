"""The ``rlmath`` command line: ``rlmath demo [--algo ppo|grpo] ...``."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["build_parser", "main"]


def _number(kind: Callable[[str], float], low: float, *, inclusive: bool) -> Callable[[str], float]:
    """An argparse ``type`` that parses with ``kind`` and checks ``> low`` (or ``>=``)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if inclusive else '>'} {low:g}, got {text}"
            )
        return value

    return parse


_pos_int = _number(int, 1, inclusive=True)
_nonneg_int = _number(int, 0, inclusive=True)
_pos_float = _number(float, 0.0, inclusive=False)
_nonneg_float = _number(float, 0.0, inclusive=True)


def _add_demo_args(p: argparse.ArgumentParser) -> None:
    from rlmath.demo.config import ALGO_DEFAULTS, ALGOS, DemoConfig
    from rlmath.demo.model import MODEL_KINDS

    d = DemoConfig()
    p.add_argument(
        "--algo", choices=ALGOS, default=d.algo, help="RL algorithm (default: %(default)s)"
    )
    p.add_argument("--steps", type=_pos_int, help=f"RL steps (default: {d.steps})")
    batch = ", ".join(f"{ALGO_DEFAULTS[a]['batch_size']} for {a}" for a in ALGOS)
    p.add_argument("--batch-size", type=_pos_int, help=f"prompts per step (default: {batch})")
    p.add_argument(
        "--group-size",
        type=_pos_int,
        default=d.group_size,
        help="GRPO: responses per prompt, >= 2 (default: %(default)s)",
    )
    p.add_argument("--lr", type=_pos_float, help=f"peak policy learning rate (default: {d.lr:g})")
    p.add_argument(
        "--kl-coef",
        type=_nonneg_float,
        help=(
            "PPO: initial coefficient of the adaptive KL reward penalty; GRPO: coefficient "
            f"of the k3 KL loss (default: {d.kl_coef:g})"
        ),
    )
    p.add_argument(
        "--seed", type=_nonneg_int, default=d.seed, help="random seed (default: %(default)s)"
    )
    p.add_argument(
        "--device",
        default=d.device,
        help="torch device: cpu, cuda, cuda:N (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, help="output folder (default: runs/demo-<algo>)")
    p.add_argument(
        "--model",
        choices=MODEL_KINDS,
        default=d.model,
        help="tiny (defined in rlmath.demo) or hf-tiny (needs transformers)",
    )
    p.add_argument(
        "--threads", type=_pos_int, help="torch CPU threads (default: 1, the fastest at this size)"
    )
    p.add_argument(
        "--ppo-epochs",
        type=_pos_int,
        default=d.ppo_epochs,
        help="passes over each rollout (default: %(default)s)",
    )
    p.add_argument(
        "--mini-batches",
        type=_pos_int,
        default=d.mini_batches,
        help="optimizer steps per pass (default: %(default)s)",
    )
    p.add_argument(
        "--clip-ratio",
        type=_pos_float,
        default=d.clip_ratio,
        help="PPO clip ε (default: %(default)s)",
    )
    p.add_argument(
        "--entropy-coef",
        type=_nonneg_float,
        default=d.entropy_coef,
        help="entropy bonus coefficient (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=_pos_float,
        default=d.temperature,
        help="sampling temperature (default: %(default)s)",
    )
    p.add_argument(
        "--warmup-steps",
        type=_nonneg_int,
        default=d.warmup_steps,
        help="supervised format warm-up steps before RL, 0 to skip (default: %(default)s)",
    )
    p.add_argument(
        "--min-len",
        type=_pos_int,
        default=d.min_len,
        help="fewest digits in a prompt (default: %(default)s)",
    )
    p.add_argument(
        "--max-len",
        type=_pos_int,
        default=d.max_len,
        help="most digits in a prompt (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmath", description="rlmath: the math engine of RLHF training."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser(
        "demo",
        help="train a tiny language model with PPO or GRPO on CPU, using rlmath for the math",
        description=(
            "Train a tiny transformer language model to sort digits with PPO or GRPO. "
            "Writes metrics.jsonl and curves.png to --out."
        ),
    )
    _add_demo_args(demo)
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
    if args.max_len > 10:
        parser.error(f"--max-len must be <= 10, got {args.max_len}")
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
    )
    n_rows = cfg.batch_size * (cfg.group_size if args.algo == "grpo" else 1)
    if cfg.mini_batches > n_rows:
        parser.error(f"--mini-batches ({cfg.mini_batches}) exceeds the rows per step ({n_rows})")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rlmath`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        cfg = _demo_config(args, parser)
        from rlmath.demo.runner import run_demo

        try:
            result = run_demo(cfg)
        except KeyboardInterrupt:
            # Ctrl-C outside the RL loop (set-up, warm-up, final evaluation):
            # the loop itself stops cleanly and keeps its metrics.
            print("\nrlmath demo: interrupted", file=sys.stderr)
            return 130
        return 130 if result.interrupted else 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
