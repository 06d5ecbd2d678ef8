"""``rlmath bench``: rlmath against the straightforward code, measured on this machine.

Each area prints markdown tables: rlmath, the baseline it replaces
(:mod:`rlmath.bench.baselines`) and, where they import and ``peers`` is on,
verl / TRL / TorchRL; the median of several interleaved runs, the ratio to
the baseline in the same run, peak memory and, for the log-probs and the
fused head, the largest error against fp64 math.

* ``logprobs`` (:mod:`rlmath.bench.logprobs`): log-probs and entropy from logits;
* ``fused-head`` (:mod:`rlmath.bench.fused_head`): log-probs and entropy from
  hidden states and the LM head's weight;
* ``advantages`` (:mod:`rlmath.bench.advantages`): GAE and the outcome estimators;
* ``small`` (:mod:`rlmath.bench.small`): one call of each public function at
  verl's micro-batch shapes, against verl's formulas.

``busy_cores`` (:mod:`rlmath.bench.busy`) keeps that many cores busy with
processes of the benchmark's own while it measures: the load a shared
machine, a data loader or a second rank on the same host puts on a training
job. Every table's header states the load, the thread count and the torch
version.

The area modules, and the peers they look for, are imported only when their
area runs.
"""

from __future__ import annotations

from collections.abc import Callable

from rlmath.bench.setting import BenchSettingError, Setting, check_repeats, session

__all__ = ["AREAS", "BenchSettingError", "Setting", "run", "session"]

#: The benchmark areas, in the order ``"all"`` runs them.
AREAS = ("logprobs", "fused-head", "advantages", "small")


def _area(name: str) -> Callable[..., None]:
    if name == "logprobs":
        from rlmath.bench import logprobs

        return logprobs.run
    if name == "fused-head":
        from rlmath.bench import fused_head

        return fused_head.run
    if name == "small":
        from rlmath.bench import small

        return small.run
    from rlmath.bench import advantages

    return advantages.run


def run(
    area: str = "all",
    *,
    device: str = "cpu",
    quick: bool = False,
    busy_cores: int = 0,
    repeats: int | None = None,
    threads: int | None = None,
    peers: bool = True,
) -> None:
    """Run one area's benchmark, or ``"all"`` of them, and print their tables.

    Args:
        area: One of :data:`AREAS`, or ``"all"``.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``); CUDA timings
            synchronize before each clock reading.
        quick: Smaller shapes than the full tables (docs/benchmarks.md, "The
            quick shapes", shows them and a measured run).
        busy_cores: Processes started to keep that many cores busy while
            measuring, in ``[0, os.cpu_count()]``; 0: none.
        repeats: Timed runs per implementation (at least 5); None: each
            area's default (5 for the log-probs and the fused head, 7 for
            the advantages, 15 for the small calls).
        threads: torch's CPU threads for the run (restored afterwards);
            None: leave torch's setting as it is.
        peers: Include verl / TRL / TorchRL where they import.

    Raises:
        BenchSettingError: an unknown area, a device this machine lacks, or
            a count out of range; raised before any work starts.
    """
    if area != "all" and area not in AREAS:
        raise BenchSettingError(f"unknown area {area!r}; expected one of {[*AREAS, 'all']}")
    if repeats is not None:
        check_repeats(repeats)
    names = AREAS if area == "all" else (area,)
    with session(device=device, busy_cores=busy_cores, threads=threads, peers=peers) as setting:
        for i, name in enumerate(names):
            if i:
                print()
            _area(name)(setting, quick=quick, repeats=repeats)
