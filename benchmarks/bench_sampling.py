"""Benchmark: log-probs under a sampler's kept set vs plain log-probs vs a sort-based reference.

A thin wrapper over :mod:`rlmath.bench.sampling` (the methodology is in that
module's docstring): the median of interleaved runs of forward and
forward + backward, the tensor peak and the peak RSS of one forward + backward.

Usage: ``python benchmarks/bench_sampling.py [--repeats 5] [--shapes 8192x32000,...]
[--dtypes float32,bfloat16] [--truncations top_p=0.9,top_k=50] [--logits normal|peaky]
[--no-naive] [--threads 2]
[--busy-cores K] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse

from rlmath.bench import BenchSettingError, sampling, session
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="8192x32000", help="comma-separated NxV")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--truncations", default="top_p=0.9,top_k=50")
    parser.add_argument("--logits", default="normal", choices=sampling.LOGITS)
    parser.add_argument("--no-naive", action="store_true", help="skip the sort-based reference")
    parser.add_argument(
        "--busy-cores", type=int, default=0, metavar="K", help="keep K cores busy while measuring"
    )
    args = parser.parse_args(argv)
    try:
        check_busy_cores(args.busy_cores)
        shapes = _shapes(args.shapes)
    except ValueError as err:
        parser.error(str(err))
    try:
        with session(
            device=args.device, busy_cores=args.busy_cores, threads=args.threads, peers=False
        ) as setting:
            sampling.run(
                setting,
                shapes=shapes,
                dtypes=args.dtypes.split(","),
                truncations=args.truncations.split(","),
                repeats=max(3, args.repeats),
                naive=not args.no_naive,
                logits=args.logits,
            )
    except (BenchSettingError, ValueError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
