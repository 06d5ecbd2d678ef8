"""Benchmark: advantage estimators vs Python loops (and verl / TorchRL when importable).

A thin wrapper over :mod:`rlmath.bench.advantages` (the same tables as
``rlmath bench advantages``; the methodology is in that module's docstring)
that keeps this script's flags and defaults: 2 intra-op threads, median of 7.

Usage: ``python benchmarks/bench_advantages.py [--repeats 7] [--quick] [--threads 2]
[--stat median|min] [--no-peers] [--busy-cores K]``. Run it with
``.venv-peers/bin/python`` to include verl.
"""

from __future__ import annotations

import argparse

from rlmath.bench import BenchSettingError, advantages, session
from rlmath.bench.busy import check_busy_cores


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=advantages.DEFAULT_REPEATS)
    parser.add_argument("--quick", action="store_true", help="T ≤ 1024 and a smaller batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="min is robust to other jobs on a shared machine; median is the default",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip verl / TorchRL")
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
            advantages.run(setting, quick=args.quick, repeats=max(5, args.repeats), stat=args.stat)
    except BenchSettingError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
