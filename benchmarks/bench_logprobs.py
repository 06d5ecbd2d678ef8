"""Benchmark: chunked log-probs (and entropy) from logits vs naive log_softmax + gather.

A thin wrapper over :mod:`rlmath.bench.logprobs` (the same tables as
``rlmath bench logprobs``; the methodology is in that module's docstring)
that keeps this script's flags and defaults: 2 intra-op threads, shapes
8192x32000 and 4096x151936, float32 and bfloat16, both functions.

Usage: ``python benchmarks/bench_logprobs.py [--repeats 5] [--quick] [--shapes 8192x32000,...]
[--dtypes float32,bfloat16] [--functions log_probs,log_probs_and_entropy] [--no-peers]
[--threads 2] [--busy-cores K]``. Run it with ``.venv-peers/bin/python`` to include
verl and TRL.
"""

from __future__ import annotations

import argparse

from rlmath.bench import BenchSettingError, logprobs, session
from rlmath.bench.busy import check_busy_cores


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            n, v = (int(s) for s in item.split("x"))
        except ValueError:
            raise ValueError(f"--shapes: expected NxV[,NxV...], got {item!r}") from None
        shapes.append((n, v))
    return shapes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=logprobs.DEFAULT_REPEATS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="8192x32000,4096x151936", help="comma-separated NxV")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--functions", default="log_probs,log_probs_and_entropy")
    parser.add_argument("--no-peers", action="store_true", help="skip verl / trl")
    parser.add_argument("--quick", action="store_true", help="small shapes, 5 repeats (smoke)")
    parser.add_argument(
        "--busy-cores", type=int, default=0, metavar="K", help="keep K cores busy while measuring"
    )
    args = parser.parse_args(argv)
    try:
        check_busy_cores(args.busy_cores)
        shapes = logprobs.QUICK_SHAPES if args.quick else _shapes(args.shapes)
    except ValueError as err:
        parser.error(str(err))
    try:
        with session(
            busy_cores=args.busy_cores, threads=args.threads, peers=not args.no_peers
        ) as setting:
            logprobs.run(
                setting,
                repeats=max(5, args.repeats),
                shapes=shapes,
                dtypes=args.dtypes.split(","),
                functions=args.functions.split(","),
            )
    except BenchSettingError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
