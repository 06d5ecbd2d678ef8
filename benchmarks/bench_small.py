"""Benchmark: one call of each public function at verl's micro-batch shapes, against verl's formulas.

A thin wrapper over :mod:`rlmath.bench.small` (the same table as
``rlmath bench small``; the methodology is in that module's docstring) that
runs on one intra-op thread, median of 15.

Usage: ``python benchmarks/bench_small.py [--repeats 15] [--quick] [--threads 1]
[--no-peers] [--busy-cores K]``. Run it with ``.venv-peers/bin/python`` to
include verl's own functions.
"""

from __future__ import annotations

import argparse

from rlmath.bench import BenchSettingError, session, small
from rlmath.bench.busy import check_busy_cores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=small.DEFAULT_REPEATS)
    parser.add_argument("--quick", action="store_true", help="bf16 logits of 32000 tokens, no RSS")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-peers", action="store_true", help="skip verl's own functions")
    parser.add_argument(
        "--busy-cores", type=int, default=0, metavar="K", help="keep K cores busy while measuring"
    )
    args = parser.parse_args(argv)
    try:
        check_busy_cores(args.busy_cores)
    except ValueError as err:
        parser.error(str(err))
    try:
        with session(
            busy_cores=args.busy_cores, threads=args.threads, peers=not args.no_peers
        ) as setting:
            small.run(setting, quick=args.quick, repeats=max(5, args.repeats))
    except BenchSettingError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
