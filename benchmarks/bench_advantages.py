"""Benchmark: advantage estimators vs Python loops (and verl / TorchRL when importable).

Prints two markdown tables:

1. GAE, B = 64, T ∈ {1024, 4096, 16384}, masks with interior gaps (tool spans),
   (γ, λ) ∈ {(1, 1), (0.99, 0.95)}: rlmath's tree scan vs the backward Python
   loop over T (same multi-turn semantics), plus verl's
   ``compute_gae_advantage_return`` and TorchRL's
   ``vec_generalized_advantage_estimate`` when they can be imported (TorchRL
   sees the same rewards and values without the gaps: it has no skip-masked
   semantics).
2. Outcome estimators, B = 8192 in 1024 shuffled groups of 8: rlmath vs the
   per-sample loops of ``tests.advantages.reference`` (plain Python) and a
   verl-style loop over torch scalars for GRPO, plus verl's own functions when
   importable.

Median (``--stat min``: minimum) of ``--repeats`` runs (≥ 5) after a warm-up,
2 CPU threads (``--threads``). Peak memory
is the growth of the process's resident set during one call (Linux; glibc is
told to return freed blocks to the OS so that the peak is not hidden by reuse).

Usage: ``python benchmarks/bench_advantages.py [--repeats 5] [--quick]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import rlmath as R

# The per-sample loops are the test suite's oracles (tests/advantages/reference.py).
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from tests.advantages import reference as ref

try:  # optional peers, never dependencies
    from verl.trainer.ppo import core_algos as verl_core  # type: ignore[import-not-found]
except Exception:  # pragma: no cover - depends on the environment
    verl_core = None
try:
    from torchrl.objectives.value.functional import (  # type: ignore[import-not-found]
        vec_generalized_advantage_estimate,
    )
except Exception:  # pragma: no cover
    vec_generalized_advantage_estimate = None


# ----------------------------------------------------------------------------- measurement


def _setup_malloc() -> bool:
    """Make glibc return large freed blocks to the OS so RSS peaks are per call.

    Only for the memory-measuring child process: it makes every large
    allocation a fresh mmap, which would distort timings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD, fixed (no dynamic growth)
    except OSError:
        return False


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_mb(fn: Callable[[], Any]) -> float | None:
    """Growth of the resident set (MB) during one call, or None where unsupported."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM
    except OSError:
        return None
    base = _status_kb("VmRSS")
    fn()
    peak = _status_kb("VmHWM")
    if base is None or peak is None:
        return None
    return max(0.0, (peak - base) / 1024)


def gae_peaks(lengths: list[int]) -> dict[str, float | None]:
    """Peak memory of one GAE call per configuration, measured in a child process."""
    cmd = [sys.executable, __file__, "--measure-gae-peaks", ",".join(map(str, lengths))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:
        return {}


def _measure_gae_peaks(lengths: list[int]) -> None:
    torch.set_num_threads(2)
    exact = _setup_malloc()
    result: dict[str, float | None] = {}
    with torch.no_grad():
        for t in lengths:
            rewards, values, mask = gae_inputs(64, t)
            for gamma, lam in GAMMA_LAM:
                args = (rewards, values, mask, gamma, lam)

                def ours(args=args):
                    return R.compute_gae_advantage_return(*args)

                def loop(args=args):
                    return ref.compute_gae_advantage_return_reference(*args)

                ours()
                result[f"ours/{t}/{gamma}/{lam}"] = peak_mb(ours) if exact else None
                result[f"loop/{t}/{gamma}/{lam}"] = peak_mb(loop) if exact else None
    print(json.dumps(result))


STAT = {"name": "median"}


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median (or, with ``--stat min``, minimum) wall time of ``repeats`` calls, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    pick = min if STAT["name"] == "min" else statistics.median
    return pick(times) * 1e3


def fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------- inputs


def gae_inputs(b: int, t: int, seed: int = 0):
    """fp32 rewards and values; a mask with a ragged valid prefix and 3 interior gaps."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(t).expand(b, t)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen)
    mask = pos < lengths[:, None]
    for _ in range(3):
        start = torch.randint(0, t, (b, 1), generator=gen)
        width = torch.randint(1, max(2, t // 16), (b, 1), generator=gen)
        mask &= ~((pos >= start) & (pos < start + width))
    rewards = torch.randn(b, t, generator=gen) * 0.1
    values = torch.randn(b, t, generator=gen)
    return rewards, values, mask


def outcome_inputs(b: int, group: int, t: int, seed: int = 0):
    """Outcome rewards (0/1 on the last valid token), ragged masks, shuffled group ids."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randperm(b, generator=gen) // group
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).expand(b, t) < lengths[:, None]
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.randint(0, 2, (b,), generator=gen).float()
    return rewards, mask, index


# ----------------------------------------------------------------------------- baselines


def verl_style_grpo_loop(rewards, mask, index, epsilon=1e-6):
    """GRPO the way a per-sample loop over torch scalars does it (verl's pre-vectorized style)."""
    scores = torch.where(mask, rewards, 0).sum(-1)
    by_group: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        by_group[index[i]].append(scores[i])
    mean, std = {}, {}
    for key, xs in by_group.items():
        if len(xs) == 1:
            mean[key], std[key] = xs[0], torch.tensor(1.0)
        else:
            stacked = torch.stack(xs)
            mean[key], std[key] = stacked.mean(), stacked.std()
    out = scores.clone()
    for i in range(scores.shape[0]):
        out[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + epsilon)
    return torch.where(mask, out[:, None], 0)


def torchrl_gae(rewards, values, gamma, lam):
    """TorchRL's vectorized GAE on [B, T, 1] (no masks: it has no skip semantics)."""
    b, t = rewards.shape
    next_values = torch.cat([values[:, 1:], values.new_zeros(b, 1)], 1)
    done = torch.zeros(b, t, 1, dtype=torch.bool)
    done[:, -1] = True
    return vec_generalized_advantage_estimate(
        gamma,
        lam,
        values.unsqueeze(-1),
        next_values.unsqueeze(-1),
        rewards.unsqueeze(-1),
        done=done,
        terminated=done,
        time_dim=-2,
    )


# ----------------------------------------------------------------------------- tables


GAMMA_LAM = ((1.0, 1.0), (0.99, 0.95))


def bench_gae(repeats: int, lengths: list[int]) -> None:
    peaks = gae_peaks(lengths)
    print("\n### GAE (B = 64, fp32, masks with interior gaps)\n")
    head = "| T | γ, λ | rlmath ms | loop ms | speed-up | rlmath peak MB | loop peak MB |"
    sep = "|---|---|---|---|---|---|---|"
    if verl_core is not None:
        head += " verl ms |"
        sep += "---|"
    if vec_generalized_advantage_estimate is not None:
        head += " TorchRL ms |"
        sep += "---|"
    print(head)
    print(sep)
    for t in lengths:
        rewards, values, mask = gae_inputs(64, t)
        for gamma, lam in GAMMA_LAM:

            def ours(gamma=gamma, lam=lam, rewards=rewards, values=values, mask=mask):
                return R.compute_gae_advantage_return(rewards, values, mask, gamma, lam)

            def loop(gamma=gamma, lam=lam, rewards=rewards, values=values, mask=mask):
                return ref.compute_gae_advantage_return_reference(rewards, values, mask, gamma, lam)

            ours_ms = median_ms(ours, repeats)
            loop_ms = median_ms(loop, max(5, repeats // 2))
            row = (
                f"| {t} | {gamma:g}, {lam:g} | {ours_ms:.2f} | {loop_ms:.1f} | "
                f"{loop_ms / ours_ms:.0f}× | {fmt(peaks.get(f'ours/{t}/{gamma}/{lam}'), 1)} | "
                f"{fmt(peaks.get(f'loop/{t}/{gamma}/{lam}'), 1)} |"
            )
            if verl_core is not None:
                m = mask.float()

                def verl(gamma=gamma, lam=lam, rewards=rewards, values=values, m=m):
                    return verl_core.compute_gae_advantage_return(rewards, values, m, gamma, lam)

                row += f" {median_ms(verl, max(5, repeats // 2)):.1f} |"
            if vec_generalized_advantage_estimate is not None:

                def trl(gamma=gamma, lam=lam, rewards=rewards, values=values):
                    return torchrl_gae(rewards, values, gamma, lam)

                row += f" {median_ms(trl, repeats):.1f} |"
            print(row, flush=True)


OUTCOME = [
    # (name, rlmath call, reference-loop call, verl call or None)
    (
        "grpo",
        lambda r, m, i, s: R.compute_grpo_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.grpo_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_grpo_outcome_advantage(r, m, s),
    ),
    (
        "grpo (uid strings)",
        lambda r, m, i, s: R.compute_grpo_outcome_advantage(r, m, s),
        lambda r, m, i, s: ref.grpo_reference(r, m, s),
        lambda r, m, i, s: verl_core.compute_grpo_outcome_advantage(r, m, s),
    ),
    (
        "grpo_passk",
        lambda r, m, i, s: R.compute_grpo_passk_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.grpo_passk_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_grpo_passk_outcome_advantage(r, m, s, config={}),
    ),
    (
        "rloo",
        lambda r, m, i, s: R.compute_rloo_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.rloo_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_rloo_outcome_advantage(r, m, s),
    ),
    (
        "opo",
        lambda r, m, i, s: R.compute_opo_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.opo_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_opo_outcome_advantage(r, m, s),
    ),
    (
        "gpg",
        lambda r, m, i, s: R.compute_gpg_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.gpg_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_gpg_outcome_advantage(r, m, s),
    ),
    (
        "reinforce_plus_plus_baseline",
        lambda r, m, i, s: R.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.reinforce_plus_plus_baseline_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_reinforce_plus_plus_baseline_outcome_advantage(
            r, m, s
        ),
    ),
    (
        "gdpo",
        lambda r, m, i, s: R.compute_gdpo_outcome_advantage(r, m, i),
        lambda r, m, i, s: ref.gdpo_reference(r, m, i),
        lambda r, m, i, s: verl_core.compute_gdpo_outcome_advantage(r, m, s),
    ),
]


def bench_outcome(repeats: int, b: int, group: int, t: int) -> None:
    rewards, mask, index = outcome_inputs(b, group, t)
    uids = [f"uid-{k}" for k in index.tolist()]
    if verl_core is not None:
        import numpy as np

        uids_arg: Any = np.array(uids, dtype=object)
    else:
        uids_arg = uids
    print(f"\n### Outcome estimators (B = {b}, {b // group} shuffled groups of {group}, T = {t})\n")
    head = "| estimator | rlmath ms | reference loop ms | speed-up |"
    sep = "|---|---|---|---|"
    if verl_core is not None:
        head += " verl ms | speed-up vs verl |"
        sep += "---|---|"
    print(head)
    print(sep)
    for name, ours_fn, loop_fn, verl_fn in OUTCOME:

        def ours(fn=ours_fn):
            return fn(rewards, mask, index, uids_arg)

        def loop(fn=loop_fn):
            return fn(rewards, mask, index, uids_arg)

        ours_ms = median_ms(ours, repeats)
        loop_ms = median_ms(loop, 5)
        row = f"| {name} | {ours_ms:.2f} | {loop_ms:.0f} | {loop_ms / ours_ms:.0f}× |"
        if verl_core is not None:

            def theirs(fn=verl_fn):
                return fn(rewards.clone(), mask.float(), index, uids_arg)

            verl_ms = median_ms(theirs, 5)
            row += f" {verl_ms:.0f} | {verl_ms / ours_ms:.0f}× |"
        print(row, flush=True)
    gl = index.tolist()
    ours_ms = median_ms(lambda: R.compute_grpo_outcome_advantage(rewards, mask, index), repeats)
    loop_ms = median_ms(lambda: verl_style_grpo_loop(rewards, mask, gl), 5)
    print(
        f"| grpo vs a per-sample loop over torch scalars | {ours_ms:.2f} | {loop_ms:.0f} | "
        f"{loop_ms / ours_ms:.0f}× |" + (" | |" if verl_core is not None else "")
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="T ≤ 4096 and a smaller batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--stat",
        choices=["median", "min"],
        default="median",
        help="min is robust to other jobs on a shared machine; median is the default",
    )
    parser.add_argument("--measure-gae-peaks", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_gae_peaks:
        _measure_gae_peaks([int(x) for x in args.measure_gae_peaks.split(",")])
        return
    torch.set_num_threads(args.threads)
    STAT["name"] = args.stat
    repeats = max(5, args.repeats)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.stat} of "
        f"{repeats} runs, "
        f"python {sys.version.split()[0]}, verl: {'yes' if verl_core else 'not importable'}, "
        f"TorchRL: {'yes' if vec_generalized_advantage_estimate else 'not importable'}"
    )
    with torch.no_grad():
        bench_gae(repeats, [1024, 4096] if args.quick else [1024, 4096, 16384])
        bench_outcome(repeats, 2048 if args.quick else 8192, 8, 128)


if __name__ == "__main__":
    main()
