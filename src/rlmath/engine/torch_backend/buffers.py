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

**Kept trees.** The fixed tree that adds a row's tile sums
(:mod:`rlmath.engine.tree`) costs three small operations per level when built
for each call. :func:`fold_tiles` keeps, per thread, a buffer for each of the
last few small tree shapes with the views of its levels made once, so that a
level is one addition (the same additions as :func:`rlmath.engine.tree.fold`).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from collections.abc import Callable

import torch

from rlmath.engine.tree import fold

__all__ = [
    "HELD_BYTES",
    "Temperature",
    "TemperatureColumn",
    "TileWorkspace",
    "Workspace",
    "fold_tiles",
    "held_bytes",
    "kept_tree",
    "tree_for",
]

#: The most scratch memory kept between passes on a CPU, all threads together, in bytes.
HELD_BYTES = 32 << 20

_lock = threading.Lock()
_held = [0]  # bytes kept by every thread's pool


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


class _Kept:
    """One thread's kept buffers (flat tensors, newest last); uncounted when the thread ends.

    ``trees``: the thread's kept trees (:func:`fold_tiles`), by shape and dtype, oldest first.
    """

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.trees: dict[tuple[int, int, int, torch.dtype], _Tree] = {}
        _every.add(self)

    def __del__(self) -> None:
        try:
            with _lock:
                _held[0] -= sum(_nbytes(b) for b in self.free)
        except TypeError:  # interpreter shutdown: the module's globals are gone
            pass


_every: weakref.WeakSet[_Kept] = weakref.WeakSet()


def release_kept() -> None:
    """Free the scratch and trees every thread keeps (for a measurement that starts from
    nothing kept).

    Call it while no rlmath pass runs.
    """
    with _lock:
        for kept in list(_every):
            _held[0] -= sum(_nbytes(b) for b in kept.free)
            kept.free.clear()
            kept.trees.clear()


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


# A tree with at most this many entries in all its levels is kept per thread for the next call.
_KEPT_TREE_ENTRIES = 1 << 16
_KEPT_TREES = 8


class _Tree:
    """The levels of one tree shape in one buffer, with the views each level adds.

    ``(c, n, k)`` tiles go to level 0 (its columns past ``n`` stay ``+0.0``);
    level ``L + 1`` is written as ``left + right`` of the pairs of level ``L``,
    each level in its own columns, so the padding is never overwritten. The
    views are made once; a call is one copy, one addition per level and one
    copy of the root.
    """

    def __init__(self, c: int, n: int, k: int, dtype: torch.dtype, device: torch.device):
        width = 1 << (n - 1).bit_length()
        # Made outside inference mode, so that it can be written in and out of it.
        with torch.inference_mode(False):
            buf = torch.zeros(c, 2 * width - 1, k, dtype=dtype, device=device)
        self.leaves = buf[:, :n]
        self.steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        start, w = 0, width
        while w > 1:
            pairs = buf[:, start : start + w].unflatten(1, (w // 2, 2))
            out = buf[:, start + w : start + w + w // 2]
            self.steps.append((pairs[:, :, 0], pairs[:, :, 1], out))
            start, w = start + w, w // 2
        self.root = buf[:, start]

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        self.leaves.copy_(x)
        return self.fold_leaves()

    def fold_leaves(self) -> torch.Tensor:
        """The root ``(c, k)`` of what :attr:`leaves` holds (written there in place)."""
        for left, right, out in self.steps:
            torch.add(left, right, out=out)
        return self.root.clone()


def kept_tree(x: torch.Tensor) -> _Tree | None:
    """This thread's kept :class:`_Tree` for ``x``'s shape and dtype, or ``None`` (not kept).

    Only for plain CPU tensors outside dispatch modes and transforms (which
    must see every allocation, or hold tensors of their own), and small trees.
    """
    if type(x) is not torch.Tensor:
        return None
    c, n, k = x.shape
    return tree_for(c, n, k, x.dtype, x.device)


def tree_for(c: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> _Tree | None:
    """This thread's kept :class:`_Tree` for ``(c, n, k)`` tile sums, or ``None`` (not kept).

    A pass can write its tile sums into the tree's ``leaves`` (``(c, n, k)``; with
    ``k = 1`` each row's tiles are contiguous) and add them with
    :meth:`_Tree.fold_leaves`, without a copy.
    """
    if n == 0:
        return None
    width = 1 << (n - 1).bit_length()
    if (
        c * (2 * width - 1) * k > _KEPT_TREE_ENTRIES
        or not _pooled(device)
        or torch._C._are_functorch_transforms_active()
    ):
        return None
    trees = _pool.kept.trees
    key = (c, n, k, dtype)
    tree = trees.get(key)
    if tree is None:
        if len(trees) >= _KEPT_TREES:
            del trees[next(iter(trees))]  # the oldest
        tree = trees[key] = _Tree(c, n, k, dtype, device)
    return tree


def fold_tiles(x: torch.Tensor) -> torch.Tensor:
    """:func:`rlmath.engine.tree.fold` of ``(c, n, k)`` tile sums, in this thread's kept tree
    when there is one for them (the same additions), else built for the call."""
    tree = kept_tree(x) if x.shape[1] else None
    return tree.fold(x) if tree is not None else fold(x)
