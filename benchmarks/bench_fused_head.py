"""Benchmark: the fused LM head vs ``hidden @ weight.T`` followed by rlmath's log-probs + entropy.

A thin wrapper over :mod:`rlmath.bench.fused_head` (the same table as
``rlmath bench fused-head``; the methodology is in that module's docstring)
that keeps this script's flags and defaults: 2 intra-op threads, shapes
8192x1024x32000 and 4096x2048x151936, float32 and bfloat16.

Usage: ``python benchmarks/bench_fused_head.py [--quick] [--shapes 8192x1024x32000,...]
[--dtypes float32,bfloat16] [--repeats 5] [--no-peers] [--threads 2] [--busy-cores K]``.
The full shapes take minutes per run on a 2-core CPU; ``--quick`` runs small ones.
Run it with ``.venv-peers/bin/python`` to include verl.
"""

from __future__ import annotations

import argparse

from rlmath.bench import BenchSettingError, fused_head, session
from rlmath.bench.busy import check_busy_cores

FULL_SHAPES = ",".join("x".join(map(str, s)) for s in fused_head.FULL_SHAPES)
QUICK_SHAPES = ",".join("x".join(map(str, s)) for s in fused_head.QUICK_SHAPES)


def _shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            n, h, v = (int(s) for s in item.split("x"))
        except ValueError:
            raise ValueError(f"--shapes: expected NxHxV[,NxHxV...], got {item!r}") from None
        shapes.append((n, h, v))
    return shapes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=fused_head.DEFAULT_REPEATS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=FULL_SHAPES, help="comma-separated NxHxV")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--no-peers", action="store_true", help="skip verl")
    parser.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}")
    parser.add_argument(
        "--busy-cores", type=int, default=0, metavar="K", help="keep K cores busy while measuring"
    )
    args = parser.parse_args(argv)
    try:
        check_busy_cores(args.busy_cores)
        shapes = _shapes(QUICK_SHAPES if args.quick else args.shapes)
    except ValueError as err:
        parser.error(str(err))
    try:
        with session(
            busy_cores=args.busy_cores, threads=args.threads, peers=not args.no_peers
        ) as setting:
            fused_head.run(
                setting, repeats=max(5, args.repeats), shapes=shapes, dtypes=args.dtypes.split(",")
            )
    except BenchSettingError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
