"""Scratch buffers and the temperature column of the pure-torch kernels.

**Kept between calls on a CPU.** A logits pass's scratch buffers are a few
MiB (:func:`rlmath.engine.policy.auto_chunk_size`). Freed at the end of each
call, they go back to the C allocator, which returns the top of its heap to
the operating system once enough is free there, so the next call's buffers
are new pages that fault in on first touch: ~2 µs per 4 KiB page on a VM,
about 1 ms for the 2 MiB of an ``(8, 32000)`` call, several times the
arithmetic. Each thread therefore keeps the :class:`Workspace` buffers of
its last pass (:class:`_ScratchPool`; at most :data:`HELD_BYTES` for all
threads together) and hands them to its next pass. A buffer goes back only
when nothing else refers to its memory (no view of it survives the pass) and
was made outside inference mode (a normal tensor can be written in and out
of inference mode); under a ``TorchDispatchMode`` nothing is kept, so a mode
sees every allocation. The fused head's :class:`TileWorkspace` keeps nothing
(see :meth:`TileWorkspace.release`); accelerators have their own caching
allocator and keep nothing here.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections.abc import Callable

import torch

__all__ = [
    "HELD_BYTES",
    "Temperature",
    "TemperatureColumn",
    "TileWorkspace",
    "Workspace",
    "held_bytes",
]

#: The most scratch memory kept between passes on a CPU, all threads together, in bytes.
HELD_BYTES = 32 << 20

_lock = threading.Lock()
_held = [0]  # bytes kept by every thread's pool


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


class _Kept:
    """One thread's kept buffers (flat tensors, newest last); uncounted when the thread ends."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        _every.add(self)

    def __del__(self) -> None:
        try:
            with _lock:
                _held[0] -= sum(_nbytes(b) for b in self.free)
        except TypeError:  # interpreter shutdown: the module's globals are gone
            pass


_every: weakref.WeakSet[_Kept] = weakref.WeakSet()


def release_kept() -> None:
    """Free the scratch every thread keeps (for a measurement that starts from nothing kept).

    Call it while no rlmath pass runs.
    """
    with _lock:
        for kept in list(_every):
            _held[0] -= sum(_nbytes(b) for b in kept.free)
            kept.free.clear()


_trim: Callable[[int], int] | bool | None = False  # False: not looked up yet


def return_free_memory(device: torch.device) -> None:
    """Return the C allocator's free pages to the operating system (glibc on a CPU; else nothing).

    Each thread that allocates gets its own glibc arena, and memory freed in
    an arena stays resident until its top is trimmed: after a pass whose
    workers each freed tens of MiB of blocks, that memory still counts in the
    process's resident set, by an amount that changes with which thread
    freed what. ``malloc_trim(0)`` gives the free pages of every arena back.
    It touches only free memory; its cost (a few ms) is small beside the
    fused head's passes, the one place that calls it.
    """
    global _trim
    if device.type != "cpu":
        return
    if _trim is False:
        _trim = None
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_size_t]
                _trim = fn
            except (AttributeError, OSError, TypeError):  # not glibc (musl), or no libc handle
                _trim = None
    if callable(_trim):
        _trim(0)


class _ScratchPool(threading.local):
    """The kept CPU scratch buffers of the current thread."""

    def __init__(self) -> None:
        self.kept = _Kept()

    @property
    def free(self) -> list[torch.Tensor]:
        return self.kept.free


_pool = _ScratchPool()


def held_bytes() -> int:
    """Bytes of scratch kept between passes by every thread, now."""
    with _lock:
        return _held[0]


def _pooled(device: torch.device) -> bool:
    return device.type == "cpu" and torch._C._len_torch_dispatch_stack() == 0


def _take(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` entries: a kept one that fits, else a new one."""
    if _pooled(device):
        free = _pool.free
        best = -1
        for i, buf in enumerate(free):
            # The smallest that fits, and not much more than asked for.
            if buf.dtype == dtype and numel <= buf.numel() <= 2 * numel + 4096:
                if best < 0 or buf.numel() < free[best].numel():
                    best = i
        if best >= 0:
            buf = free.pop(best)
            with _lock:
                _held[0] -= _nbytes(buf)
            return buf
    return torch.empty(numel, dtype=dtype, device=device)


def _give(buffers: list[torch.Tensor]) -> None:
    """Keep ``buffers`` for this thread's next pass: those no view refers to, within :data:`HELD_BYTES`."""
    if not buffers or not _pooled(buffers[0].device):
        return
    free = _pool.free
    for buf in buffers:
        # 2: ``buf`` and the storage object made to ask; a surviving view adds one.
        if buf.is_inference() or torch._C._storage_Use_Count(buf.untyped_storage()._cdata) != 2:
            continue
        size = _nbytes(buf)
        with _lock:
            while free and _held[0] + size > HELD_BYTES:  # this thread's oldest make room
                _held[0] -= _nbytes(free.pop(0))
            if _held[0] + size > HELD_BYTES:
                continue
            _held[0] += size
        free.append(buf)


Temperature = torch.Tensor | float | None
"""A temperature as the kernels receive it: ``None`` (exactly 1), a float, or a
flat ``(M,)`` tensor in the compute dtype, one value per processed row."""


class Workspace:
    """Scratch buffers of ``rows × V``, taken once per pass and reused by every chunk.

    ``get(name, c)`` returns the first ``c`` rows of the buffer called ``name``
    (in the compute dtype unless asked otherwise; taken on first use).
    :meth:`release` at the end of the pass hands the buffers on (see the
    module docstring); nothing the pass returns may be a view of them.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.vocab, self.dtype, self.device = rows, vocab, dtype, device
        # name -> (the flat buffer, its (rows, vocab) view, made once per pass)
        self._buffers: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        entry = self._buffers.get((name, dt))
        if entry is None:
            buf = _take(self.rows * self.vocab, dt, self.device)
            entry = buf, buf[: self.rows * self.vocab].view(self.rows, self.vocab)
            self._buffers[(name, dt)] = entry
        return entry[1] if c == self.rows else entry[1][:c]

    def release(self) -> None:
        """Hand the buffers to this thread's next pass; the workspace is empty afterwards."""
        buffers = [buf for buf, _ in self._buffers.values()]
        self._buffers.clear()  # the views go first: a kept buffer has no view left
        _give(buffers)


class TileWorkspace(Workspace):
    """A :class:`Workspace` whose buffers take the shape of the current vocabulary tile.

    The chunk kernels ask for ``ws.get(name, c)`` and expect a ``(c, V)``
    buffer matching their ``(c, V)`` input; for the fused head the input is one
    vocabulary tile, whose width changes for the last tile. Each named buffer
    is one flat allocation of ``rows × vocab`` entries, viewed as a contiguous
    ``(c, width)`` matrix for the tile set in :attr:`width`. :meth:`scratch`
    holds buffers of other shapes (the fp32 copy of a weight tile, the fp32
    ``grad_hidden`` of a chunk) the same way.
    """

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        super().__init__(rows, vocab, dtype, device)
        self.width = vocab
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._flat.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._flat[(name, dtype)] = buf
        return buf

    def get(self, name: str, c: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        buf = self._buffer(name, self.rows * self.vocab, dt)
        return buf[: c * self.width].view(c, self.width)

    def scratch(self, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous buffer of ``shape``, reused by later calls with the same name."""
        buf = self._buffer(name, shape[0] * shape[1], dtype)
        return buf[: shape[0] * shape[1]].view(shape)

    def release(self) -> None:
        """Free the buffers: the fused head's are kept by no one.

        Its passes are matmul-bound (their page faults are noise) and its
        buffers large; kept, they would add to the resident set of the
        ``grad_weight`` rounding that follows the backward.
        """
        self._flat.clear()


class TemperatureColumn:
    """A temperature as the column the chunk kernels take.

    ``col`` is ``None`` (exactly 1), a ``(1, 1)`` or an ``(M, 1)`` tensor in the
    compute dtype; ``inv`` is ``1/T`` (``None``, a float or an ``(M,)`` tensor)
    for the gradient coefficients.
    """

    def __init__(self, value: Temperature, dtype: torch.dtype, device: torch.device):
        self.col: torch.Tensor | None = None
        self.inv: torch.Tensor | float | None = None
        self.per_row = isinstance(value, torch.Tensor)
        if isinstance(value, torch.Tensor):
            self.col, self.inv = value.unsqueeze(-1), value.reciprocal()
        elif value is not None:
            self.col = torch.full((1, 1), value, dtype=dtype, device=device)
            self.inv = 1.0 / value

    def rows(self, start: int, end: int) -> torch.Tensor | None:
        """The column for rows ``[start, end)`` (the whole ``(1, 1)`` column for a scalar)."""
        if self.col is None or not self.per_row:
            return self.col
        return self.col[start:end]
