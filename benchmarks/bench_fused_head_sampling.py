"""Benchmark: the fused LM head under a sampler's kept set vs the plain head vs the logits.

A thin wrapper over :mod:`rlmath.bench.fused_head_sampling` (the methodology is
in that module's docstring): the median of interleaved forward + backward runs,
the tensor peak and the peak RSS of one call in a fresh process.

Usage: ``python benchmarks/bench_fused_head_sampling.py [--repeats 3]
[--shapes 4096x1024x32000,...] [--dtypes float32,bfloat16] [--truncations top_p=0.9]
[--threads 2] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse

from rlmath.bench import BenchSettingError, fused_head_sampling, session


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", default="4096x1024x32000", help="comma-separated NxHxV")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--truncations", default="top_p=0.9")
    args = parser.parse_args(argv)
    try:
        shapes = _shapes(args.shapes)
    except ValueError as err:
        parser.error(str(err))
    try:
        with session(device=args.device, threads=args.threads, peers=False) as setting:
            fused_head_sampling.run(
                setting,
                shapes=shapes,
                dtypes=args.dtypes.split(","),
                truncations=args.truncations.split(","),
                repeats=max(3, args.repeats),
            )
    except (BenchSettingError, ValueError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
