"""Benchmark: advantage estimators vs Python loops (and verl / TorchRL when importable).

Prints two markdown tables:

1. GAE, B = 64, masks with interior gaps (tool spans), (γ, λ) ∈ {(1, 1),
   (0.99, 0.95)}: rlmath's tree scan vs the backward Python loop over T with
   the same multi-turn semantics (:func:`~rlmath.bench.baselines.gae_loop`),
   plus verl's ``compute_gae_advantage_return`` and TorchRL's
   ``vec_generalized_advantage_estimate`` when peers are on and they import
   (TorchRL sees the same rewards and values without the gaps: it has no
   skip-masked semantics).
2. Outcome estimators, B responses in shuffled groups of 8: rlmath vs the
   per-group Python loops of :data:`~rlmath.bench.baselines.OUTCOME_LOOPS`
   and, for GRPO, a per-sample loop over torch scalars, plus verl's own
   functions when peers are on and verl imports.

Median (``stat="min"``: minimum) of the repeats, interleaved run by run
after a warm-up. Peak memory of one GAE call: on CPU the growth of the
resident set, measured in a child process (Linux; glibc is told to return
freed blocks to the OS there so that the peak is not hidden by reuse); on
CUDA ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

import rlmath as R
from rlmath.bench import baselines
from rlmath.bench.memory import peak_bytes
from rlmath.bench.setting import (
    STATS,
    BenchSettingError,
    Setting,
    check_repeats,
    header,
    interleaved,
)
from rlmath.bench.tables import print_header, print_rows

__all__ = [
    "DEFAULT_REPEATS",
    "GAE_BATCH",
    "GAMMA_LAM",
    "bench_gae",
    "bench_outcome",
    "gae_inputs",
    "outcome_inputs",
    "run",
]

GAE_BATCH = 64
GAE_LENGTHS = (1024, 4096, 16384)
GAE_LENGTHS_QUICK = (256, 1024)
GAMMA_LAM = ((1.0, 1.0), (0.99, 0.95))
#: (batch, group size, response length) of the outcome table.
OUTCOME_SHAPE = (8192, 8, 128)
OUTCOME_SHAPE_QUICK = (1024, 8, 128)
DEFAULT_REPEATS = 7

Fn = Callable[[], object]


# ----------------------------------------------------------------------------- inputs


def gae_inputs(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def outcome_inputs(
    b: int, group: int, t: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Outcome rewards (0/1 on the last valid token), ragged masks, shuffled group ids."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randperm(b, generator=gen) // group
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).expand(b, t) < lengths[:, None]
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = torch.randint(0, 2, (b,), generator=gen).float()
    return rewards, mask, index


# ----------------------------------------------------------------------------- peers


def _verl_core(enabled: bool) -> Any:
    if not enabled:
        return None
    try:  # an optional peer, never a dependency: absent or broken reads the same here
        from verl.trainer.ppo import core_algos  # type: ignore[import-not-found]
    except Exception:
        return None
    return core_algos


def _torchrl_gae(enabled: bool) -> Callable[..., torch.Tensor] | None:
    if not enabled:
        return None
    try:
        from torchrl.objectives.value.functional import (  # type: ignore[import-not-found]
            vec_generalized_advantage_estimate,
        )
    except Exception:
        return None
    gae: Callable[..., torch.Tensor] = vec_generalized_advantage_estimate
    return gae


def _torchrl_call(
    gae: Callable[..., torch.Tensor],
    rewards: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """TorchRL's vectorized GAE on ``[B, T, 1]`` (no masks: it has no skip semantics)."""
    b, t = rewards.shape
    next_values = torch.cat([values[:, 1:], values.new_zeros(b, 1)], 1)
    done = torch.zeros(b, t, 1, dtype=torch.bool, device=rewards.device)
    done[:, -1] = True
    return gae(
        gamma,
        lam,
        values.unsqueeze(-1),
        next_values.unsqueeze(-1),
        rewards.unsqueeze(-1),
        done=done,
        terminated=done,
        time_dim=-2,
    )


# ----------------------------------------------------------------------------- GAE peak memory


def _return_freed_memory_to_os() -> bool:
    """Make glibc return large freed blocks to the OS, so that resident-set peaks are per call.

    Only for the memory-measuring child process: it makes every large
    allocation a fresh mmap, which would distort timings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD, fixed (no dynamic growth)
    except (OSError, AttributeError):
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


def _rss_growth_mb(fn: Fn) -> float | None:
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


def _gae_calls(t: int, device: torch.device) -> dict[str, Fn]:
    """``"ours/T/γ/λ"`` and ``"loop/T/γ/λ"``: one GAE call each, on ``gae_inputs(64, T)``."""
    rewards, values, mask = (x.to(device) for x in gae_inputs(GAE_BATCH, t))
    calls: dict[str, Fn] = {}
    for gamma, lam in GAMMA_LAM:
        args = (rewards, values, mask, gamma, lam)
        calls[f"ours/{t}/{gamma}/{lam}"] = partial(R.compute_gae_advantage_return, *args)
        calls[f"loop/{t}/{gamma}/{lam}"] = partial(baselines.gae_loop, *args)
    return calls


def print_gae_rss_peaks(lengths: Sequence[int], threads: int) -> None:
    """In a child process: print, as JSON, the resident-set growth of each GAE call."""
    torch.set_num_threads(threads)
    exact = _return_freed_memory_to_os()
    result: dict[str, float | None] = {}
    with torch.no_grad():
        for t in lengths:
            for key, fn in _gae_calls(t, torch.device("cpu")).items():
                fn()  # the first call's one-time allocations are not the call's peak
                result[key] = _rss_growth_mb(fn) if exact else None
    print(json.dumps(result))


def gae_peaks(setting: Setting, lengths: Sequence[int]) -> dict[str, float | None]:
    """Peak memory (MB) of one call per configuration: CPU in a child process, CUDA here."""
    if setting.device.type == "cuda":
        peaks: dict[str, float | None] = {}
        for t in lengths:
            for key, fn in _gae_calls(t, setting.device).items():
                fn()
                _, peak = peak_bytes(fn, setting.device)
                peaks[key] = peak / 2**20
        return peaks
    code = (
        "import sys\nfrom rlmath.bench.advantages import print_gae_rss_peaks\n"
        "print_gae_rss_peaks([int(t) for t in sys.argv[1].split(',')], int(sys.argv[2]))\n"
    )
    # The child imports the same rlmath as this process, installed or not.
    package_root = str(Path(R.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-c", code, ",".join(map(str, lengths)), str(torch.get_num_threads())]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True, env=env)
        parsed: dict[str, float | None] = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        # The table shows n/a: a peak that could not be measured is not guessed.
        print(f"GAE peak memory not measured: {type(err).__name__}: {err}", file=sys.stderr)
        return {}
    return parsed


# ----------------------------------------------------------------------------- tables


def _fmt(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def bench_gae(setting: Setting, repeats: int, lengths: Sequence[int], *, stat: str) -> None:
    """Print the GAE table."""
    device = setting.device
    verl = _verl_core(setting.peers)
    torchrl = _torchrl_gae(setting.peers)
    peaks = gae_peaks(setting, lengths)
    columns = ["T", "γ, λ", "rlmath ms", "loop ms", "speed-up", "rlmath peak MB", "loop peak MB"]
    if verl is not None:
        columns.append("verl ms")
    if torchrl is not None:
        columns.append("TorchRL ms")
    found = f"verl: {'yes' if verl else 'no'}, TorchRL: {'yes' if torchrl else 'no'}"
    print(f"### GAE (B = {GAE_BATCH}, fp32, masks with interior gaps)\n")
    print(header(setting, repeats, stat=stat, peers=found) + "\n")
    print_header(columns)
    with torch.no_grad():
        for t in lengths:
            rewards, values, mask = (x.to(device) for x in gae_inputs(GAE_BATCH, t))
            for gamma, lam in GAMMA_LAM:
                args = (rewards, values, mask, gamma, lam)
                runs: dict[str, Fn] = {
                    "rlmath": partial(R.compute_gae_advantage_return, *args),
                    "loop": partial(baselines.gae_loop, *args),
                }
                if verl is not None:
                    runs["verl"] = partial(
                        verl.compute_gae_advantage_return, rewards, values, mask.float(), gamma, lam
                    )
                if torchrl is not None:
                    runs["torchrl"] = partial(_torchrl_call, torchrl, rewards, values, gamma, lam)
                ms = {
                    k: s * 1e3
                    for k, s in interleaved(runs, device, repeats, stat=stat, collect=False).items()
                }
                key = f"{t}/{gamma}/{lam}"
                row = [
                    str(t),
                    f"{gamma:g}, {lam:g}",
                    f"{ms['rlmath']:.2f}",
                    f"{ms['loop']:.1f}",
                    f"{ms['loop'] / ms['rlmath']:.0f}×",
                    _fmt(peaks.get(f"ours/{key}"), 1),
                    _fmt(peaks.get(f"loop/{key}"), 1),
                ]
                row += [f"{ms[k]:.1f}" for k in ("verl", "torchrl") if k in ms]
                print_rows([row])


#: Outcome rows: (row name, rlmath's function, its loop, verl's function name, index kind).
#: "ids": the integer group ids tensor; "uids": the same groups as uid strings.
OUTCOME_ROWS: tuple[tuple[str, Callable[..., object], str, str, str], ...] = (
    ("grpo", R.compute_grpo_outcome_advantage, "grpo", "compute_grpo_outcome_advantage", "ids"),
    (
        "grpo (uid strings)",
        R.compute_grpo_outcome_advantage,
        "grpo",
        "compute_grpo_outcome_advantage",
        "uids",
    ),
    (
        "grpo_passk",
        R.compute_grpo_passk_outcome_advantage,
        "grpo_passk",
        "compute_grpo_passk_outcome_advantage",
        "ids",
    ),
    ("rloo", R.compute_rloo_outcome_advantage, "rloo", "compute_rloo_outcome_advantage", "ids"),
    ("opo", R.compute_opo_outcome_advantage, "opo", "compute_opo_outcome_advantage", "ids"),
    ("gpg", R.compute_gpg_outcome_advantage, "gpg", "compute_gpg_outcome_advantage", "ids"),
    (
        "reinforce_plus_plus_baseline",
        R.compute_reinforce_plus_plus_baseline_outcome_advantage,
        "reinforce_plus_plus_baseline",
        "compute_reinforce_plus_plus_baseline_outcome_advantage",
        "ids",
    ),
    ("gdpo", R.compute_gdpo_outcome_advantage, "gdpo", "compute_gdpo_outcome_advantage", "ids"),
)


#: Keyword arguments verl's functions need beyond (rewards, mask, uids): its
#: pass@k reads its normalization from a config (here: the defaults).
VERL_KWARGS: dict[str, dict[str, Any]] = {"compute_grpo_passk_outcome_advantage": {"config": {}}}


def _verl_outcome(
    fn: Callable[..., object],
    rewards: torch.Tensor,
    mask: torch.Tensor,
    uids: Any,
    **kwargs: Any,
) -> object:
    # verl writes into its rewards argument: a fresh copy per call.
    return fn(rewards.clone(), mask.float(), uids, **kwargs)


def bench_outcome(setting: Setting, repeats: int, b: int, group: int, t: int, *, stat: str) -> None:
    """Print the outcome-estimator table."""
    device = setting.device
    verl = _verl_core(setting.peers)
    rewards, mask, index = (x.to(device) for x in outcome_inputs(b, group, t))
    uids = [f"uid-{k}" for k in index.tolist()]
    verl_uids: Any = uids
    if verl is not None:
        import numpy as np  # verl's own dependency: it takes uids as an object array

        verl_uids = np.array(uids, dtype=object)
    columns = ["estimator", "rlmath ms", "reference loop ms", "speed-up"]
    if verl is not None:
        columns += ["verl ms", "speed-up vs verl"]
    print(f"### Outcome estimators (B = {b}, {b // group} shuffled groups of {group}, T = {t})\n")
    print(header(setting, repeats, stat=stat, peers=f"verl: {'yes' if verl else 'no'}") + "\n")
    print_header(columns)

    def time_ms(runs: dict[str, Fn]) -> dict[str, float]:
        times = interleaved(runs, device, repeats, stat=stat, collect=False)
        return {k: s * 1e3 for k, s in times.items()}

    for name, ours, loop, verl_name, kind in OUTCOME_ROWS:
        groups: Any = uids if kind == "uids" else index
        runs: dict[str, Fn] = {
            "rlmath": partial(ours, rewards, mask, groups),
            "loop": partial(baselines.OUTCOME_LOOPS[loop], rewards, mask, groups),
        }
        theirs = getattr(verl, verl_name, None)
        if theirs is not None:
            runs["verl"] = partial(
                _verl_outcome, theirs, rewards, mask, verl_uids, **VERL_KWARGS.get(verl_name, {})
            )
        ms = time_ms(runs)
        row = [
            name,
            f"{ms['rlmath']:.2f}",
            f"{ms['loop']:.0f}",
            f"{ms['loop'] / ms['rlmath']:.0f}×",
        ]
        if verl is not None:
            row += (
                [f"{ms['verl']:.0f}", f"{ms['verl'] / ms['rlmath']:.0f}×"]
                if "verl" in ms
                else ["", ""]
            )
        print_rows([row])
    ms = time_ms(
        {
            "rlmath": partial(R.compute_grpo_outcome_advantage, rewards, mask, index),
            "loop": partial(baselines.grpo_torch_scalar_loop, rewards, mask, index.tolist()),
        }
    )
    row = [
        "grpo vs a per-sample loop over torch scalars",
        f"{ms['rlmath']:.2f}",
        f"{ms['loop']:.0f}",
        f"{ms['loop'] / ms['rlmath']:.0f}×",
    ]
    print_rows([row + (["", ""] if verl is not None else [])])


def run(
    setting: Setting,
    *,
    quick: bool = False,
    repeats: int | None = None,
    stat: str = "median",
) -> None:
    """Print the GAE table and the outcome-estimator table (``quick``: T ≤ 1024, B = 1024)."""
    repeats = check_repeats(DEFAULT_REPEATS if repeats is None else repeats)
    if stat not in STATS:
        raise BenchSettingError(f"stat must be one of {sorted(STATS)}, got {stat!r}")
    bench_gae(setting, repeats, GAE_LENGTHS_QUICK if quick else GAE_LENGTHS, stat=stat)
    print()
    b, group, t = OUTCOME_SHAPE_QUICK if quick else OUTCOME_SHAPE
    with torch.no_grad():
        bench_outcome(setting, repeats, b, group, t, stat=stat)
