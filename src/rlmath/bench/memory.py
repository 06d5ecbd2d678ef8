"""Memory of an operation: a deterministic allocation tracker, device peaks, and peak RSS.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every ATen op that runs
while it is active (forward, and backward too, as autograd carries the mode
to its engine) reports its outputs. An output whose storage is new (not the
storage of an input, as for views and ``out=`` / in-place ops) is recorded
as an :class:`Allocation`, added to the live byte count, and subtracted again
when the storage is freed (a ``weakref.finalize`` on the storage: PyTorch
keeps one Python object per live storage, so it fires when the memory is
actually released). ``peak_bytes`` is the high-water mark of that count.

Only tensors created while the tracker is active are counted; memory that a
kernel allocates internally without returning it is invisible, and so is
anything outside torch. That is what makes it deterministic: the numbers do
not depend on the allocator, the machine or other processes. rlmath's own
operators (``torch.ops.rlmath.*``) are not kernels in that sense: the tracker
runs their Python bodies (:func:`rlmath._operators.python_body`) with itself
active, so every chunk buffer, block buffer and temporary of a pass is
counted. The benchmarks
(``rlmath bench``) report it on CPU, and the test suite asserts memory
bounds with it.

:func:`peak_bytes` runs a call once and returns its peak: the tracker's on
CPU, ``torch.cuda.max_memory_allocated`` on a CUDA device (the caching
allocator's own count, in its block sizes; cheap enough to leave on).

The tracker does not see memory the C library's allocator keeps after a
free, buffers that libraries (oneDNN, MKL) allocate inside a call, or the
pages of code and data a first call loads. :func:`peak_rss_bytes` measures
what the operating system counts instead: the peak resident set of one call
in a fresh process (Linux: ``VmHWM`` after resetting it through
``/proc/self/clear_refs``), beyond the resident set just before the call and
the results the call leaves. The call is made once on a small slice of the
same inputs first, so that the imports and one-time set-up of a first call in
a process (torch's custom-operator machinery imports ``torch._dynamo`` on a
process's first call of any such operator: about 75 MiB) are not counted.

Usage::

    with MemoryTracker() as mem:
        mem.phase = "forward"
        out = f(x)
        mem.phase = "backward"
        out.sum().backward()
    big = mem.allocations_at_least(n_rows * vocab * 4, dtype=torch.float32)
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlmath._operators import python_body
from rlmath.engine.torch_backend.buffers import release_kept

__all__ = [
    "Allocation",
    "MemoryTracker",
    "RssCase",
    "peak_bytes",
    "peak_rss_bytes",
    "rss_measurable",
]

#: ``(warm_up, call)`` of a case measured by :func:`peak_rss_bytes`: ``warm_up()``
#: runs the operation on a small slice, ``call()`` runs it once and returns the
#: tensors it leaves whose bytes are not counted (gradients, outputs).
RssCase = tuple[Callable[[], object], Callable[[], list[torch.Tensor]]]

T = TypeVar("T")


@dataclass(frozen=True)
class Allocation:
    """One new storage produced by an op."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    phase: str


class MemoryTracker(TorchDispatchMode):
    """Record every new tensor storage produced by an op and track live/peak bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[Allocation] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase = ""
        self.peak_by_phase: dict[str, int] = {}
        self._live_keys: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._live_keys:
            self._live_keys.discard(key)
            self.live_bytes -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        body = python_body(func)
        if body is not None:
            # An rlmath operator: run its body with this mode on, so that its
            # scratch buffers count (as the ops of any composite function do).
            # Its passes then run on this thread (workers see the mode).
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {t.untyped_storage()._cdata for t in flat_in if isinstance(t, torch.Tensor)}
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live_keys:
                continue
            nbytes = storage.nbytes()
            self._live_keys.add(key)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_by_phase[self.phase] = max(
                self.peak_by_phase.get(self.phase, 0), self.live_bytes
            )
            weakref.finalize(storage, self._free, key, nbytes)
            self.allocations.append(
                Allocation(str(func), tuple(t.shape), t.dtype, nbytes, self.phase)
            )
        return out

    def allocations_at_least(
        self, nbytes: int, *, dtype: torch.dtype | None = None, phase: str | None = None
    ) -> list[Allocation]:
        """Allocations of ``nbytes`` or more (of ``dtype`` / in ``phase`` if given)."""
        return [
            a
            for a in self.allocations
            if a.nbytes >= nbytes
            and (dtype is None or a.dtype == dtype)
            and (phase is None or a.phase == phase)
        ]

    def largest(self, *, phase: str | None = None) -> int:
        """Size in bytes of the largest allocation (in ``phase`` if given), 0 if none."""
        sizes = [a.nbytes for a in self.allocations if phase is None or a.phase == phase]
        return max(sizes, default=0)


def peak_bytes(fn: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """Run ``fn()`` once; return its result and the peak tensor bytes allocated during the call.

    The peak counts only memory allocated after the call starts (tensors that
    exist before it, such as the inputs, are not counted) and includes
    whatever the result keeps alive: subtract that where it should not
    count. CPU (and any non-CUDA device): :class:`MemoryTracker`. CUDA:
    ``torch.cuda.max_memory_allocated`` after a synchronization, minus what
    was allocated before.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - before
    with MemoryTracker() as mem:
        out = fn()
    return out, mem.peak_bytes


def rss_measurable() -> bool:
    """Whether this system can reset and read a process's peak RSS (Linux's ``/proc``)."""
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_bytes(
    module: str, case: dict[str, Any], *, threads: int, env: dict[str, str] | None = None
) -> int | None:
    """Peak RSS of one call of a benchmark case in a fresh process, beyond what it starts from.

    ``module`` (``rlmath.bench.logprobs``, ...) provides ``rss_case(**case) ->``
    :data:`RssCase`. The child process sets ``threads`` intra-op threads (and
    ``env`` on top of this process's environment), runs ``warm_up()``, resets
    its peak RSS, runs ``call()`` and reports the peak above the resident set
    just before the call, less the bytes of the tensors ``call()`` returns.
    ``None`` where :func:`rss_measurable` is false. Raises ``RuntimeError``
    with the child's output if it fails.
    """
    if not rss_measurable():
        return None
    code = "import sys; from rlmath.bench.memory import _rss_child; _rss_child(sys.argv[1])"
    spec = json.dumps({"module": module, "case": case, "threads": threads})
    proc = subprocess.run(
        [sys.executable, "-c", code, spec],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"peak RSS of {module} {case} failed:\n{proc.stdout}{proc.stderr}")
    return int(proc.stdout.strip().splitlines()[-1])


def _rss_child(spec_json: str) -> None:
    """The child process of :func:`peak_rss_bytes`: prints the extra peak RSS in bytes."""
    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    warm_up, call = importlib.import_module(spec["module"]).rss_case(**spec["case"])
    warm_up()
    release_kept()  # the call's own scratch counts, not what the warm-up left kept
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    kept = call()
    peak = _status_bytes("VmHWM")
    print(peak - before - sum(t.numel() * t.element_size() for t in kept), flush=True)
