"""Compile the Triton backend for NVIDIA GPUs on a CPU, through its real launch code, and check the code.

Triton's interpreter runs a kernel's Python and never its compiler. This
module drives the public functions on small CPU tensors while a stand-in
Triton driver reports a GPU target (``sm_80``, ``sm_90``, ...) and every
kernel launch becomes a compile-only warm-up: each kernel is compiled with
exactly the signature, the divisibility specialization (which pointers and
integers Triton sees as multiples of 16), the constexprs and the warps that
the wrappers pass for that call. Each distinct specialization is compiled
once per target (Triton's own cache, plus a cache of this module's analysis
keyed by the kernel's hash, lives in ``--cache``).

For each compiled kernel it reads:

- from ``ptxas -v`` (the log of Triton's own ``ptxas`` call): registers,
  spill stores and loads, stack frame;
- from the PTX: the width of every global load and store, grouped by the
  source line it comes from (the PTX's ``.loc`` line info). A line whose
  accesses are a tensor (more than one instruction per thread, or a vector
  one) is a *row stream*; scalar per-row loads (a label, a log-sum-exp) are
  not;
- from the SASS (``nvdisasm``): the instructions of the main loop's common
  path (the rescale of a rising max skipped) per element each thread handles
  in one iteration;
- shared memory and warps from the kernel's metadata, and from those the
  occupancy (resident warps per SM against the target's 64).

It fails on a compile error, on any spill, and on a row stream that is not
read or written 128 bits at a time in a scenario whose layout is aligned
(rows starting on 16-byte boundaries: dense rows of a width that is a
multiple of 16 bytes, ``x[:, :-1]`` of such logits, response slices,
vocabulary shards, the fused head's tiles). Unaligned layouts (``V = 50257``
dense, transposed logits) are compiled and reported, not required to be
vectorized.

Run as ``python -m tests.engine.triton_gpu_check [--arch 90 80] [--cache DIR]``
with ``TRITON_INTERPRET`` unset (``make test-gpu-compile``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on"):
    raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

# ------------------------------------------------------------------ the stand-in driver


class CompileOnlyDriver:
    """What Triton's launch path asks of a driver, for a GPU that is not there.

    The device id is the architecture, so each target keeps its own kernel
    cache inside every ``JITFunction``.
    """

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: object = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


@dataclasses.dataclass
class Launch:
    """One kernel launch of a scenario, compiled instead of run."""

    kernel: Any  # triton's CompiledKernel
    name: str
    warps: int
    scenario: str
    aligned: bool
    ptxas_log: str | None = None


class _PtxasLogs:
    """Keeps the ``ptxas -v`` log of each cubin Triton builds (Triton discards it)."""

    def __init__(self) -> None:
        self.last: str | None = None

    def install(self) -> None:
        import triton.backends.nvidia.compiler as nvc

        real = nvc.subprocess
        logs = self

        class _Shim:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def run(self, cmd, *args, **kwargs):
                stderr = kwargs.get("stderr")
                if not (isinstance(cmd, list) and cmd and "ptxas" in str(cmd[0]) and stderr):
                    return real.run(cmd, *args, **kwargs)
                # Triton reads the log back from the file's name on failure.
                kwargs["stderr"] = real.PIPE
                proc = real.run(cmd, *args, **{**kwargs, "check": False})
                text = proc.stderr.decode() if isinstance(proc.stderr, bytes) else proc.stderr
                with open(stderr.name, "w") as f:
                    f.write(text or "")
                logs.last = text or ""
                if kwargs.get("check") and proc.returncode:
                    raise real.CalledProcessError(proc.returncode, cmd, stderr=proc.stderr)
                return proc

        if not isinstance(real, type(sys)):  # already shimmed
            return
        nvc.subprocess = _Shim()


@contextlib.contextmanager
def compile_only(
    arch: int, launches: list[Launch], scenario: list[tuple[str, bool]], logs: _PtxasLogs
):
    """Every launch of a Triton kernel in the block compiles it for ``sm_{arch}`` and records it."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import rlmath.engine.backends as backends
    import rlmath.engine.triton_backend as tb

    driver.set_active(CompileOnlyDriver(arch))
    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        logs.last = None
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        name, aligned = scenario[0]
        warps = int(kwargs.get("num_warps", 4))
        launches.append(Launch(kernel, self.fn.__name__, warps, name, aligned, logs.last))
        return kernel

    # The backend takes CUDA tensors only: here it takes CPU tensors of its dtypes.
    cpu = backends.Backend(
        "triton", tb.TRITON_KERNELS, supports=lambda t: t.dtype in tb.DTYPES, priority=10
    )
    saved = backends._BACKENDS.get("triton")
    backends._BACKENDS["triton"] = cpu
    JITFunction.run = warm
    try:
        yield
    finally:
        JITFunction.run = run
        if saved is not None:
            backends._BACKENDS["triton"] = saved


# ------------------------------------------------------------------ scenarios

Scenario = tuple[str, bool, Callable[[], None]]
"""``(name, aligned layout, run)``: ``run`` calls public functions (forward and backward)."""


def _g(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def scenarios(full: bool = False) -> Iterator[Scenario]:
    """The calls whose launches are compiled: every kernel, flag and layout the wrappers produce.

    Small row counts (the kernels' code does not depend on them); vocabulary
    widths of real models. ``full`` adds the product of every option on the
    main layouts (slower; the default covers each option on its own).
    """
    import torch

    import rlmath as R
    from rlmath.distributed import vocab_parallel as vp

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    def aligned_rows(V: int, dt) -> bool:
        return (V * torch.tensor([], dtype=dt).element_size()) % 16 == 0

    def logits(shape, dt, seed=0):
        return (torch.randn(*shape, generator=_g(seed)) * 2).to(dt)

    # -------------------------------------------------- log-probs and entropy
    def lp_case(dt, V, layout, temp, entropy, K, ignore, real=None):
        B, S = 2, 5

        def run():
            if layout == "dense":
                x = logits((B * S, V), dt).requires_grad_()
                xs, lab_shape = x, (B * S,)
            elif layout == "shifted":  # logits[:, :-1]: the layout every trainer passes
                x = logits((B, S, V), dt).requires_grad_()
                xs, lab_shape = x[:, :-1], (B, S - 1)
            elif layout == "transposed":
                x = logits((V, B * S), dt).requires_grad_()
                xs, lab_shape = x.T, (B * S,)
            else:
                raise AssertionError(layout)
            n = real if real is not None else V
            labels = torch.randint(0, n, (*lab_shape, K) if K > 1 else lab_shape, generator=_g(1))
            if ignore:
                labels.view(-1)[0] = -100
            t = {
                "none": 1.0,
                "scalar": 0.7,
                "rows": torch.rand(lab_shape, generator=_g(2)) + 0.5,
            }[temp]
            kw: dict[str, Any] = dict(temperature=t, backend="triton")
            if real is not None:
                lp, ent = vp.vocab_parallel_log_probs_and_entropy(
                    xs, labels, vocab_size=real, ignore_index=-100, **kw
                )
                (lp.sum() + ent.sum()).backward()
                return
            if ignore:
                kw["ignore_index"] = -100
            if entropy:
                lp, ent = R.log_probs_and_entropy_from_logits(xs, labels, **kw)
                (lp.sum() + ent.sum()).backward()
            else:
                R.log_probs_from_logits(xs, labels, **kw).sum().backward()

        return run

    def tile_case(dt, V, temp, entropy, picked=False):
        """The wrapper's per-tile pass of a vocabulary shard, given the rows' global max
        (``picked``: rows chosen by index, as packed sequences are)."""

        def run():
            from rlmath.engine.triton_backend.logits_forward import logits_stats

            x = logits((10, V), dt)
            rows = torch.tensor([0, 3, 4, 8]) if picked else None
            M = 4 if picked else 10
            labels = torch.randint(0, V, (M, 1), generator=_g(1))
            t = {"none": None, "scalar": 0.7, "rows": torch.rand(M, generator=_g(2)) + 0.5}
            shift = x.float().amax(-1)[rows if picked else slice(None)] + 0.5
            logits_stats(
                x, rows, None, labels, t[temp], entropy, V, None, torch.float32, shift=shift
            )

        return run

    def tile_kl_pi2_case(dt, V, temp):
        """The KL's two per-tile phases and ``Σ π²``'s per-tile sums of a shard on the grid."""

        def run():
            from rlmath.engine.triton_backend.kl_forward import kl_stats
            from rlmath.engine.triton_backend.sum_pi_squared import pi_squared_stats

            x, r = logits((10, V), dt), logits((10, V), dt, seed=3)
            t = {"none": None, "rows": torch.rand(10, generator=_g(2)) + 0.5}[temp]
            mz, mr = x.float().amax(-1) + 0.5, r.float().amax(-1) + 0.5
            kl_stats(x, r, t, V, None, torch.float32, shift=(mz, mr))
            kl_stats(x, r, t, V, None, torch.float32, shift=(mz, mr), log_sums=(mz, mr))
            pi_squared_stats(x, t, V, None, torch.float32, shift=mz)

        return run

    def tile_kept_case(dt, V, how):
        """The per-tile pass of a shard restricted to a kept set: thresholds, a replayed mask,
        replayed ids; two labels a row added to it."""

        def run():
            from rlmath.engine.sampling import KeptSet
            from rlmath.engine.triton_backend.tile_sums import ENTROPY, tile_sums

            x = logits((10, V), dt)
            shift = x.float().amax(-1) + 0.5
            kept: torch.Tensor | None = None
            if how == "mask":
                kept = torch.rand(10, V, generator=_g(16)) < 0.01
            elif how == "ids":
                kept = torch.randint(0, V, (10, 20), generator=_g(15))
            restrict = KeptSet(
                "kept" if kept is not None else "vllm", top_k=None, top_p=None, min_p=None,
                kept=kept, labels=torch.randint(0, V, (10, 2), generator=_g(1)),
                owned=torch.ones(10, 2, dtype=torch.bool), tau=shift - 3.0, count=None,
                forward=False,
            )  # fmt: skip
            tile_sums(x, None, None, 0.7, V, shift, ENTROPY, restrict)

        return run

    main_v = (32000, 151936, 262144, 50257)

    # fp16 compiles to the code of bf16 but for its conversions: the main cases only
    # (every case with `full`).
    def widths(dname: str) -> tuple[int, ...]:
        return main_v if full or dname != "fp16" else (151936,)

    for dname, dt in dtypes.items():
        for V in widths(dname):
            for layout in ("dense", "shifted"):
                ok = aligned_rows(V, dt)
                for entropy in (True, False):
                    yield (
                        f"logprobs {dname} V={V} {layout} T=scalar entropy={entropy}",
                        ok,
                        lp_case(dt, V, layout, "scalar", entropy, 1, False),
                    )
        # vocabulary shard with padding columns (vocab_size 151665 of 151936)
        for layout in ("dense", "shifted"):
            yield (
                f"vocab shard {dname} V=151936 vocab_size=151665 {layout}",
                aligned_rows(151936, dt),
                lp_case(dt, 151936, layout, "scalar", True, 1, True, real=151665),
            )
        yield (
            f"logprobs {dname} V=32000 transposed",
            False,
            lp_case(dt, 32000, "transposed", "scalar", True, 1, False),
        )
        # A shard on the 128-column tile grid (half of V = 32000): the per-tile kernel.
        for temp in ("none", "scalar", "rows"):
            for entropy in (True, False):
                yield (
                    f"tile sums {dname} V=16000 T={temp} entropy={entropy}",
                    aligned_rows(16000, dt),
                    tile_case(dt, 16000, temp, entropy),
                )
        yield (
            f"tile sums {dname} V=16000 rows by index",
            aligned_rows(16000, dt),
            tile_case(dt, 16000, "scalar", True, picked=True),
        )
        for temp in ("none", "rows"):
            yield (
                f"tile sums of the KL and sum pi^2 {dname} V=16000 T={temp}",
                aligned_rows(16000, dt),
                tile_kl_pi2_case(dt, 16000, temp),
            )
        for how in ("tau", "mask", "ids"):
            yield (
                f"tile sums under a kept set ({how}) {dname} V=16000",
                aligned_rows(16000, dt),
                tile_kept_case(dt, 16000, how),
            )
    # Each option on the main layouts, in fp32 and bf16 (and fp16 with `full`).
    for dname, dt in dtypes.items():
        if dname == "fp16" and not full:
            continue
        for layout in ("dense", "shifted"):
            for temp in ("none", "rows"):
                for entropy in (True, False):
                    yield (
                        f"logprobs {dname} V=151936 {layout} T={temp} entropy={entropy}",
                        True,
                        lp_case(dt, 151936, layout, temp, entropy, 1, False),
                    )
            yield (
                f"logprobs {dname} V=151936 {layout} K=3 ignore_index",
                True,
                lp_case(dt, 151936, layout, "rows", True, 3, True),
            )
            yield (
                f"logprobs {dname} V=151936 {layout} K=1 ignore_index",
                True,
                lp_case(dt, 151936, layout, "scalar", False, 1, True),
            )
            if full:
                for temp in ("none", "scalar", "rows"):
                    for entropy in (True, False):
                        for K in (1, 3):
                            for ignore in (False, True):
                                yield (
                                    f"logprobs {dname} V=151936 {layout} T={temp} "
                                    f"entropy={entropy} K={K} ignore={ignore}",
                                    True,
                                    lp_case(dt, 151936, layout, temp, entropy, K, ignore),
                                )

    # -------------------------------------------------- responses (dense slice and packed rows)
    def response_case(dt, V, kind, temp):
        B, S, Rl = 2, 6, 3

        def run():
            ids = torch.randint(0, V, (B, S), generator=_g(3))
            t = 0.8 if temp == "scalar" else torch.rand(B, 1, generator=_g(4)) + 0.5
            if kind == "dense":
                x = logits((B, S, V), dt).requires_grad_()
                R.log_probs_from_logits_response(
                    ids, x, Rl, temperature=t, backend="triton"
                ).sum().backward()
            else:
                mask = torch.ones(B, S, dtype=torch.long)
                mask[0, :2] = 0
                x = logits((int(mask.sum()), V), dt).requires_grad_()
                R.log_probs_from_logits_response_rmpad(
                    ids, mask, x, Rl, temperature=t, backend="triton"
                ).sum().backward()

        return run

    for dname, dt in dtypes.items():
        for V in (151936, 50257) if full or dname != "fp16" else (151936,):
            for kind in ("dense", "rmpad"):
                for temp in ("scalar", "rows"):
                    yield (
                        f"response {kind} {dname} V={V} T={temp}",
                        aligned_rows(V, dt),
                        response_case(dt, V, kind, temp),
                    )

    # -------------------------------------------------- KL and Σ π²
    def kl_case(dt, V, layout, temp, both):
        B, S = 2, 4

        def run():
            if layout == "dense":
                z = logits((B * S, V), dt).requires_grad_()
                r = logits((B * S, V), dt, 5).requires_grad_(both)
                zs, rs, shape = z, r, (B * S,)
            else:
                z = logits((B, S, V), dt).requires_grad_()
                r = logits((B, S, V), dt, 5).requires_grad_(both)
                zs, rs, shape = z[:, :-1], r[:, :-1], (B, S - 1)
            t = {"none": 1.0, "scalar": 0.7, "rows": torch.rand(shape, generator=_g(6)) + 0.5}[temp]
            R.kl_from_logits(zs, rs, temperature=t, backend="triton").sum().backward()

        return run

    def pi_case(dt, V, layout, temp):
        def run():
            x = logits((2, 4, V), dt)
            xs = x[:, :-1] if layout == "shifted" else x
            t = 0.7 if temp == "scalar" else torch.rand(xs.shape[:-1], generator=_g(7)) + 0.5
            R.sum_pi_squared_from_logits(xs, temperature=t, backend="triton")

        return run

    for dname, dt in dtypes.items():
        for V in widths(dname):
            for layout in ("dense", "shifted"):
                yield (
                    f"kl {dname} V={V} {layout} T=scalar",
                    aligned_rows(V, dt),
                    kl_case(dt, V, layout, "scalar", True),
                )
                yield (
                    f"sum_pi_squared {dname} V={V} {layout}",
                    aligned_rows(V, dt),
                    pi_case(dt, V, layout, "scalar"),
                )
        if dname == "fp16" and not full:
            continue
        for layout in ("dense", "shifted"):
            for temp in ("none", "rows"):
                yield (
                    f"kl {dname} V=151936 {layout} T={temp} grad of logits only",
                    True,
                    kl_case(dt, 151936, layout, temp, False),
                )
            yield (
                f"sum_pi_squared {dname} V=151936 {layout} T=rows",
                True,
                pi_case(dt, 151936, layout, "rows"),
            )

    # -------------------------------------------------- a sampler's kept set
    def kept_case(dt, V, layout, how, entropy):
        B, S = 2, 5

        def run():
            x = logits((B, S, V), dt).requires_grad_()
            if layout == "dense":
                xs, lab_shape = x.reshape(B * S, V), (B * S,)
            else:
                xs, lab_shape = x[:, :-1], (B, S - 1)
            labels = torch.randint(0, V, lab_shape, generator=_g(13))
            t = torch.rand(lab_shape, generator=_g(14)) + 0.5
            kw: dict[str, Any] = dict(temperature=t, backend="triton")
            if how == "top_p":
                kw.update(top_k=50, top_p=0.9)
            elif how == "ids":
                kw["kept"] = torch.randint(0, V, (*lab_shape, 20), generator=_g(15))
            else:  # a replayed mask
                kw["kept"] = torch.rand(*lab_shape, V, generator=_g(16)) < 0.01
            if entropy:
                lp, ent = R.log_probs_and_entropy_from_logits(xs, labels, **kw)
                (lp.sum() + ent.sum()).backward()
            else:
                R.log_probs_from_logits(xs, labels, **kw).sum().backward()

        return run

    def kept_packed_case(dt, V):
        def run():
            ids = torch.randint(0, V, (2, 6), generator=_g(17))
            mask = torch.ones(2, 6, dtype=torch.long)
            mask[0, :2] = 0
            x = logits((int(mask.sum()), V), dt).requires_grad_()
            R.log_probs_from_logits_response_rmpad(
                ids, mask, x, 3, temperature=0.8, top_p=0.9, backend="triton"
            ).sum().backward()

        return run

    for dname, dt in dtypes.items():
        if dname == "fp16" and not full:
            continue
        for layout in ("dense", "shifted"):
            for how in ("top_p", "ids", "mask"):
                yield (
                    f"kept {how} {dname} V=151936 {layout} entropy=True",
                    True,
                    kept_case(dt, 151936, layout, how, True),
                )
            yield (
                f"kept top_p {dname} V=151936 {layout} entropy=False",
                True,
                kept_case(dt, 151936, layout, "top_p", False),
            )
        yield (f"kept top_p packed {dname} V=151936", True, kept_packed_case(dt, 151936))

    # -------------------------------------------------- fused head
    def head_case(dt, V, temp, entropy, bias, ignore, real=None):
        N, H = 6, 16

        def run():
            h = logits((N, H), dt, 8).requires_grad_()
            w = (logits((V, H), dt, 9) / 4).requires_grad_()
            b = logits((V,), dt, 10).requires_grad_() if bias else None
            n = real if real is not None else V
            labels = torch.randint(0, n, (N,), generator=_g(11))
            if ignore:
                labels[1] = -100
            t = 0.8 if temp == "scalar" else torch.rand(N, generator=_g(12)) + 0.5
            if real is not None:
                lp, ent = vp.vocab_parallel_log_probs_and_entropy_from_hidden(
                    h, w, labels, bias_shard=b, vocab_size=real, temperature=t, backend="triton"
                )
            else:
                lp, ent = R.log_probs_and_entropy_from_hidden(
                    h, w, labels, bias=b, temperature=t, return_entropy=entropy,
                    ignore_index=-100, backend="triton",
                )  # fmt: skip
            loss = lp.sum() + (ent.sum() if ent is not None else 0)
            loss.backward()

        return run

    for dname, dt in dtypes.items():
        for V in (151936, 128256, 32000):
            yield (f"head {dname} V={V}", True, head_case(dt, V, "scalar", True, False, True))
        if dname == "fp16" and not full:
            continue
        yield (
            f"head {dname} V=151936 vocab_size=151665 bias",
            True,
            head_case(dt, 151936, "rows", True, True, True, real=151665),
        )
        for temp in ("scalar", "rows"):
            for entropy in (True, False):
                yield (
                    f"head {dname} V=151936 T={temp} entropy={entropy} bias",
                    True,
                    head_case(dt, 151936, temp, entropy, True, False),
                )


# ------------------------------------------------------------------ analysis of one kernel

_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"(?:,\s*"([^"]*)")?')
_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9_]+)*?(?:\.v(\d))?\.([bufs])(\d+)\b")

# Occupancy limits per SM: (max resident warps, registers, shared bytes, max CTAs).
_SM_LIMITS = {
    80: (64, 65536, 164 * 1024, 32),
    86: (48, 65536, 100 * 1024, 16),
    89: (48, 65536, 100 * 1024, 24),
    90: (64, 65536, 228 * 1024, 32),
    100: (64, 65536, 228 * 1024, 32),
    120: (48, 65536, 100 * 1024, 24),
}


def access_widths(ptx: str) -> dict[str, dict[str, Any]]:
    """``{"file:line": {"kind": "ld"/"st", "widths": {bits: count}}}`` of the PTX's global accesses."""
    files: dict[str, str] = {}
    where = "?"
    out: dict[str, dict[str, Any]] = {}
    for line in ptx.splitlines():
        m = _FILE.match(line)
        if m:
            name = m.group(2) if not m.group(3) else f"{m.group(3)}/{m.group(2)}"
            files[m.group(1)] = os.path.basename(name)
            continue
        m = _LOC.match(line)
        if m:
            where = f"{files.get(m.group(1), m.group(1))}:{m.group(2)}"
            continue
        m = _ACCESS.search(line)
        if m:
            bits = int(m.group(4)) * int(m.group(2) or 1)
            entry = out.setdefault(f"{m.group(1)} {where}", {"kind": m.group(1), "widths": {}})
            entry["widths"][bits] = entry["widths"].get(bits, 0) + 1
    return out


def streams(widths: dict[str, dict[str, Any]]) -> dict[str, dict[int, int]]:
    """The row streams among the accesses: source lines with a vector access, or with several
    accesses of one width (a tensor's elements; scalar loads on one line differ in width)."""
    out = {}
    for where, entry in widths.items():
        w = {int(k): v for k, v in entry["widths"].items()}
        if max(w) > 64 or max(w.values()) > 1:
            out[where] = w
    return out


def ptxas_figures(log: str) -> dict[str, int]:
    """Registers, spills and stack frame from a ``ptxas -v`` log."""

    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
    }


def _bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def run_ptxas(ptx: str, arch: int) -> str:
    """``ptxas -v`` of ``ptx`` (when Triton's own log is not at hand: a cached kernel)."""
    import tempfile

    tool = (
        _bin("ptxas-blackwell")
        if arch >= 100 and Path(_bin("ptxas-blackwell")).exists()
        else _bin("ptxas")
    )
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [tool, "-v", "-lineinfo", f"--gpu-name={gpu}", str(src), "-o", str(Path(d) / "k.o")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return proc.stderr


def loop_instructions(cubin: bytes) -> dict[str, int] | None:
    """Instructions of the main loop (the outermost loop holding a global load), common path.

    A loop is the span from a label to a backward branch to it; regions a
    forward conditional branch inside the loop jumps over (the rescale when
    a row's max rises) are left out. ``None`` without a loop.
    """
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    instrs: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        lab = re.match(r"^\s*(\.L_x_\d+):", line)
        if lab:
            labels[lab.group(1)] = len(instrs)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(1).strip())
    loops = []
    for i, ins in enumerate(instrs):
        b = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", ins)
        if b and b.group(1) in labels and labels[b.group(1)] <= i:
            lo = labels[b.group(1)]
            if any("LDG" in x for x in instrs[lo : i + 1]):
                loops.append((lo, i))
    if not loops:
        return None
    lo, hi = min(loops, key=lambda p: (p[0], -p[1]))
    skipped = set()
    for i in range(lo, hi + 1):
        ins = instrs[i]
        b = re.search(r"\bBRA\b.*`\((\.L_x_\d+)\)", ins)
        if b and ins.startswith("@") and b.group(1) in labels:
            t = labels[b.group(1)]
            if i < t <= hi:
                skipped.update(range(i + 1, t))
    body = [instrs[i] for i in range(lo, hi + 1) if i not in skipped]
    return {
        "loop": len(body),
        "mufu": sum("MUFU" in x for x in body),
        "bar": sum(x.startswith("BAR") or " BAR" in x for x in body),
        "shfl": sum("SHFL" in x for x in body),
    }


def occupancy(arch: int, regs: int, shared: int, warps: int) -> float:
    """Resident warps per SM over the target's maximum (registers allocated per warp in 256s)."""
    max_warps, reg_file, smem, max_ctas = _SM_LIMITS.get(arch, _SM_LIMITS[90])
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (reg_file // per_warp) // warps
    by_smem = smem // shared if shared else max_ctas
    ctas = min(by_regs, by_smem, max_ctas, max_warps // warps)
    return ctas * warps / max_warps


def analyse(kernel: Any, arch: int, ptxas_log: str | None) -> dict[str, Any]:
    """The figures of one compiled kernel (see the module docstring)."""
    ptx = kernel.asm["ptx"]
    log = ptxas_log if ptxas_log is not None else run_ptxas(ptx, arch)
    figs = ptxas_figures(log)
    md = kernel.metadata
    shared = int(getattr(md, "shared", 0) or 0)
    warps = int(getattr(md, "num_warps", 4))
    widths = access_widths(ptx)
    try:
        loop = loop_instructions(kernel.asm["cubin"])
    except (OSError, subprocess.CalledProcessError):
        loop = None
    return {
        **figs,
        "shared": shared,
        "warps": warps,
        "occupancy": occupancy(arch, figs["registers"], shared, warps),
        "widths": widths,
        "loop": loop,
    }


# ------------------------------------------------------------------ the check


def _constexprs(kernel: Any) -> str:
    src = getattr(kernel, "src", None)
    consts = getattr(src, "constants", None) or {}
    names = [p.name for p in src.fn.params] if src is not None else []
    items = []
    for key, val in sorted(consts.items(), key=lambda kv: str(kv[0])):
        idx = key[0] if isinstance(key, tuple) else key
        name = names[idx] if isinstance(idx, int) and idx < len(names) else str(idx)
        if name in ("BLOCK",) or name.isupper():
            items.append(f"{name}={int(val) if isinstance(val, bool) else val}")
    return " ".join(items)


def _aligned_args(kernel: Any) -> str:
    """The arguments Triton specialized as multiples of 16 (pointers: 16-byte aligned)."""
    src = getattr(kernel, "src", None)
    attrs = getattr(src, "attrs", None) or {}
    names = [p.name for p in src.fn.params] if src is not None else []
    out = []
    for key, val in attrs.items():
        idx = key[0] if isinstance(key, tuple) else key
        if "tt.divisibility" in str(val) and isinstance(idx, int) and idx < len(names):
            out.append(names[idx])
    return ",".join(sorted(out))


def _dtype(kernel: Any) -> str:
    src = getattr(kernel, "src", None)
    sig = getattr(src, "signature", {}) or {}
    for v in sig.values():
        if isinstance(v, str) and v.startswith("*") and v[1:] in ("bf16", "fp16"):
            return v[1:]
    return "fp32"


def check(arch: int, cache: Path, full: bool, verbose: bool) -> tuple[int, dict[str, Any]]:
    """Compile every scenario's kernels for ``sm_{arch}``; print the table; return (failures, summary)."""
    import triton

    logs = _PtxasLogs()
    logs.install()
    store = cache / f"analysis-triton{triton.__version__}-sm{arch}.json"
    known: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    launches: list[Launch] = []
    current: list[tuple[str, bool]] = [("", False)]
    failures: list[str] = []
    n_scen = 0
    t0 = time.time()
    with compile_only(arch, launches, current, logs):
        for name, aligned, run in scenarios(full):
            n_scen += 1
            current[0] = (name, aligned)
            try:
                run()
            except Exception as exc:  # a compile error surfaces here
                msg = str(exc).strip().splitlines()
                failures.append(f"sm_{arch} {name}: compile error {type(exc).__name__}: {msg[:1]}")
    compile_s = time.time() - t0
    # One analysis per distinct compiled kernel.
    by_hash: dict[str, dict[str, Any]] = {}
    for la in launches:
        h = la.kernel.hash
        if h in by_hash:
            by_hash[h]["scenarios"].append((la.scenario, la.aligned))
            continue
        if h not in known:
            known[h] = analyse(la.kernel, arch, la.ptxas_log)
        by_hash[h] = {
            "name": la.name,
            "dtype": _dtype(la.kernel),
            "flags": _constexprs(la.kernel),
            "div16": _aligned_args(la.kernel),
            **known[h],
            "scenarios": [(la.scenario, la.aligned)],
        }
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(known))
    # Failures: spills, narrow row streams on aligned layouts.
    narrow_aligned = 0
    for k in by_hash.values():
        tag = f"sm_{arch} {k['name']} {k['dtype']} {k['flags']} warps={k['warps']} div16=[{k['div16']}]"
        if k["spill_stores"] or k["spill_loads"]:
            failures.append(f"{tag}: spills {k['spill_stores']} B stores, {k['spill_loads']} B loads "
                            f"(in: {k['scenarios'][0][0]})")  # fmt: skip
        st = streams(k["widths"])
        narrow = {w: c for w, c in st.items() if min(c) < 128}
        k["stream_widths"] = {w: {b: n for b, n in sorted(c.items())} for w, c in st.items()}
        k["narrow"] = bool(narrow)
        bad = [s for s, a in k["scenarios"] if a]
        if narrow and bad:
            narrow_aligned += 1
            lines = ", ".join(
                f"{w}: " + " ".join(f"{n}x{b}-bit" for b, n in sorted(c.items()))
                for w, c in narrow.items()
            )
            failures.append(
                f"{tag}: row stream not 128-bit on an aligned layout ({lines}; in: {bad[0]})"
            )
    # The table.
    print(f"== sm_{arch}, triton {triton.__version__}: {n_scen} scenarios, {len(launches)} launches, "
          f"{len(by_hash)} distinct kernels, {compile_s:.0f} s")  # fmt: skip
    rows = sorted(by_hash.values(), key=lambda k: (k["name"], k["dtype"], k["flags"]))
    for k in rows:
        loop = k["loop"]
        per = ""
        if loop:
            per = f" loop={loop['loop']} mufu={loop['mufu']}"
        widths = " ".join(
            f"{w.split(' ')[0]}:" + "/".join(f"{n}x{b}" for b, n in c.items())
            for w, c in k["stream_widths"].items()
        )
        if verbose or k["narrow"] or k["spill_stores"]:
            print(f"  {k['name']:<22} {k['dtype']:<4} w={k['warps']:<2} regs={k['registers']:<3} "
                  f"spill={k['spill_stores']:<3} smem={k['shared']:<5} occ={k['occupancy']:.2f}{per} "
                  f"streams=[{widths}] {k['flags']} div16=[{k['div16']}]")  # fmt: skip
    summary = {
        "arch": arch,
        "triton": triton.__version__,
        "scenarios": n_scen,
        "launches": len(launches),
        "kernels": len(by_hash),
        "spills": sum(1 for k in by_hash.values() if k["spill_stores"] or k["spill_loads"]),
        "narrow_on_aligned": narrow_aligned,
        "narrow_any": sum(1 for k in by_hash.values() if k["narrow"]),
        "seconds": round(compile_s),
        "by_kernel": _by_kernel(by_hash),
    }
    return len(failures), {"summary": summary, "failures": failures, "kernels": rows}


def _by_kernel(by_hash: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in by_hash.values():
        e = out.setdefault(k["name"], {"count": 0, "registers": [999, 0], "occupancy": [1.0, 0.0]})
        e["count"] += 1
        e["registers"] = [
            min(e["registers"][0], k["registers"]),
            max(e["registers"][1], k["registers"]),
        ]
        e["occupancy"] = [
            min(e["occupancy"][0], k["occupancy"]),
            max(e["occupancy"][1], k["occupancy"]),
        ]
    return out


def default_archs() -> list[int]:
    """sm_90 and sm_80: the targets whose code the check requires to be free of spills.

    ``--arch 100`` (Blackwell, where this triton knows it) compiles too; there
    ptxas gives 512-thread programs 64 registers, and the forward with entropy
    on unaligned rows (``V = 50257``) spills 8 bytes (triton 3.9).
    """
    return [90, 80]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="*", help="compute capabilities (default: 90 80)")
    p.add_argument(
        "--cache", type=Path, default=None, help="cache directory (Triton's and this check's)"
    )
    p.add_argument(
        "--full", action="store_true", help="every option combination on the main layouts"
    )
    p.add_argument("--verbose", action="store_true", help="one line per distinct kernel")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--jobs", type=int, default=1, help="targets compiled in parallel processes")
    args = p.parse_args(argv)
    cache = args.cache or Path(os.environ.get("TRITON_CACHE_DIR", ".triton-gpu-check"))
    cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    archs = args.arch or default_archs()
    if args.jobs > 1 and len(archs) > 1:
        return _parallel(archs, args, cache)
    total = 0
    results = []
    for arch in archs:
        n, res = check(arch, cache, args.full, args.verbose)
        total += n
        results.append(res)
        for f in res["failures"]:
            print("FAIL " + f)
        s = res["summary"]
        print(f"-- sm_{arch}: {s['kernels']} kernels compiled, {s['spills']} spilling, "
              f"{s['narrow_on_aligned']} narrow on aligned layouts ({s['narrow_any']} narrow in all), "
              f"{len(res['failures'])} failures")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 1 if total else 0


def _parallel(archs: list[int], args: argparse.Namespace, cache: Path) -> int:
    """One process per target, ``--jobs`` at a time; their reports in target order."""
    import tempfile

    pending = list(archs)
    running: list[tuple[int, subprocess.Popen, Any, Path]] = []
    done: dict[int, tuple[int, str, Path]] = {}
    tmp = Path(tempfile.mkdtemp())
    while pending or running:
        while pending and len(running) < args.jobs:
            arch = pending.pop(0)
            out = tempfile.TemporaryFile(mode="w+")
            js = tmp / f"sm{arch}.json"
            cmd = [sys.executable, "-m", "tests.engine.triton_gpu_check", "--arch", str(arch),
                   "--cache", str(cache), "--json", str(js)]  # fmt: skip
            cmd += ["--full"] if args.full else []
            cmd += ["--verbose"] if args.verbose else []
            running.append(
                (arch, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), out, js)
            )
        time.sleep(0.5)
        for item in list(running):
            arch, proc, out, js = item
            if proc.poll() is not None:
                out.seek(0)
                done[arch] = (proc.returncode, out.read(), js)
                running.remove(item)
    results = []
    rc = 0
    for arch in archs:
        code, text, js = done[arch]
        print(
            "\n".join(
                line
                for line in text.splitlines()
                if "Warning" not in line and "warn_once" not in line
            )
        )
        rc = rc or code
        if js.exists():
            results.extend(json.loads(js.read_text()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
