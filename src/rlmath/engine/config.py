"""The non-tensor arguments of a vocabulary operation, in one frozen dataclass.

The engine's autograd functions take their tensors positionally and
everything else as one :class:`OpConfig`; the torch operators underneath take
the same fields flattened (:meth:`OpConfig.op_args`), in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SINGLE_PROCESS", "OpConfig", "VocabParallel", "VocabShard"]


@dataclass(frozen=True)
class VocabParallel:
    """How a vocabulary function's input holds one shard of a vocabulary split over processes.

    Pass it as ``vocab_parallel=`` to any vocabulary function: each rank of
    ``group`` passes its own columns of the logits (or rows of the LM-head
    weight) for the same tokens, and every rank gets the result over the whole
    vocabulary, as one process would on the concatenated columns
    (Megatron-style tensor parallelism of the vocabulary). ``None`` (the
    default of every function): the input holds the whole vocabulary.

    Attributes:
        group: the process group over which the vocabulary is split
            (``None``: the world group). Without an initialized
            ``torch.distributed`` (or in a group of one rank) the input must
            hold the whole vocabulary.
        start: the global token id of this rank's first column (``None``: rank
            ``k`` starts at ``k · width``, equal shards in rank order as
            Megatron lays them out; needed for shards of unequal width).
        reduce_grad_hidden: fused head only: all-reduce the gradient of
            ``hidden`` over ``group`` so that every rank holds the full gradient
            (the default). ``False`` leaves each rank its own part
            ``g_k @ W_k``, for a caller whose graph sums over the group in
            backward already (Megatron's sequence parallelism).
    """

    group: Any = None
    start: int | None = None
    reduce_grad_hidden: bool = True


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary columns one process holds, and the group that holds the rest.

    Attributes:
        start: global token id of local column 0.
        real: how many local columns are real tokens; the columns after them
            are padding, left out of the softmax and given a zero gradient.
        group: name of the process group over which the vocabulary is split
            (:func:`rlmath.engine.groups.group_name`); ``""`` is a world of one
            process, the single-process case.
        stride: when every rank's columns follow from the shapes alone (rank
            ``k`` starts at ``k · stride``: ``VocabParallel(start=None)`` or a
            DTensor), that width; 0 when they do not (an explicit ``start``).
        total: with ``stride``, the real tokens of the whole vocabulary.
    """

    start: int = 0
    real: int = -1
    group: str = ""
    stride: int = 0
    total: int = 0

    def real_columns(self, width: int) -> int:
        """Real local columns for a shard ``width`` columns wide (``real = -1``: all)."""
        return width if self.real < 0 else self.real


_SAMPLER_CODES = ("", "vllm", "sglang", "hf", "kept")
"""The values of :attr:`OpConfig.sampler`, in the order of their integer codes."""

SINGLE_PROCESS = VocabShard()
"""The whole vocabulary in this process."""


@dataclass(frozen=True)
class OpConfig:
    """Everything but the tensors of one call of a vocabulary operation.

    Attributes:
        backend: the resolved backend name (``"torch"``, ...), never ``"auto"``.
        temperature: the scalar temperature, used when no temperature tensor is given.
        want_entropy: also compute the entropy.
        ignore_index: label value of positions to skip (``None``: none).
        chunk_size: rows per chunk (``None``: :mod:`rlmath.engine.policy` decides).
        vocab_chunk_size: vocabulary entries per fused-head tile (``None``: the policy).
        narrow: ``(dim, start, length)``: use the rows of
            ``logits.narrow(dim, start, length)`` (a batch dim), or ``None``.
        shard_start, shard_real, group, shard_stride, shard_total: the fields of
            the :class:`VocabShard`
            of this process (:attr:`shard`; flat, so that a compiler tracing the
            call handles one plain dataclass).
        reduce_grad_hidden: fused head only: sum the gradient of ``hidden`` over
            the shard's group (else each rank keeps its own part).
        logit_scale: fused head only: the head's logits are multiplied by it
            (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``).
        softcap: fused head only: ``c > 0`` soft-caps the (scaled) logits to
            ``c·tanh(z / c)`` (Gemma 2/3's ``final_logit_softcapping``); 0: none.
        sampler: logits only: ``""`` (the full vocabulary), or the engine
            (``"vllm"``, ``"sglang"``, ``"hf"``) whose truncation rules define the
            kept set, or ``"kept"`` (the kept set is given, replayed);
            see :mod:`rlmath.engine.sampling`.
        top_k: with ``sampler``: the top-k (``0``: none; ``-1``: per row, in
            the sampling-parameter tensor).
        top_p, min_p: with ``sampler``: the top-p (``1``: none) and min-p
            (``0``: none); ``-1``: per row, in the sampling-parameter tensor.
        kept_stats: with ``sampler``: also count each row's kept set.
    """

    backend: str = "torch"
    temperature: float = 1.0
    want_entropy: bool = False
    ignore_index: int | None = None
    chunk_size: int | None = None
    vocab_chunk_size: int | None = None
    narrow: tuple[int, int, int] | None = None
    shard_start: int = 0
    shard_real: int = -1
    group: str = ""
    shard_stride: int = 0
    shard_total: int = 0
    reduce_grad_hidden: bool = True
    logit_scale: float = 1.0
    softcap: float = 0.0
    sampler: str = ""
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    kept_stats: bool = False

    @property
    def shard(self) -> VocabShard:
        """The vocabulary columns this process holds."""
        if (
            not (self.shard_start or self.group or self.shard_stride or self.shard_total)
            and self.shard_real == -1
        ):
            return SINGLE_PROCESS
        return VocabShard(
            self.shard_start, self.shard_real, self.group, self.shard_stride, self.shard_total
        )

    def op_args(self) -> tuple[str, str, list[float], list[int]]:
        """The fields as the operators' last four arguments: ``(backend, group, floats, ints)``.

        Operator schemas take plain values only; ``floats`` packs the
        temperature, logit scale and soft-cap, ``ints`` the integer and boolean
        fields (see :meth:`from_op_args`, the inverse).
        """
        narrow = list(self.narrow) if self.narrow is not None else [-1, 0, 0]
        ints = [
            int(self.want_entropy),
            int(self.ignore_index is not None),
            self.ignore_index if self.ignore_index is not None else 0,
            self.chunk_size or 0,
            self.vocab_chunk_size or 0,
            *narrow,
            self.shard_start,
            self.shard_real,
            self.shard_stride,
            self.shard_total,
            int(self.reduce_grad_hidden),
            _SAMPLER_CODES.index(self.sampler),
            self.top_k,
            int(self.kept_stats),
        ]
        floats = [
            float(self.temperature),
            float(self.logit_scale),
            float(self.softcap),
            float(self.top_p),
            float(self.min_p),
        ]
        return self.backend, self.group, floats, ints

    @staticmethod
    def from_op_args(backend: str, group: str, floats: list[float], ints: list[int]) -> OpConfig:
        """The inverse of :meth:`op_args` (inside the operators)."""
        temperature, logit_scale, softcap, top_p, min_p = floats
        (want_entropy, has_ignore, ignore, chunk, vchunk, n_dim, n_start, n_len, start, real,
         stride, total, reduce, sampler, top_k, kept_stats) = ints  # fmt: skip
        return OpConfig(
            backend=backend,
            temperature=temperature,
            want_entropy=bool(want_entropy),
            ignore_index=ignore if has_ignore else None,
            chunk_size=chunk or None,
            vocab_chunk_size=vchunk or None,
            narrow=(n_dim, n_start, n_len) if n_dim >= 0 else None,
            shard_start=start,
            shard_real=real,
            shard_stride=stride,
            shard_total=total,
            group=group,
            reduce_grad_hidden=bool(reduce),
            logit_scale=logit_scale,
            softcap=softcap,
            sampler=_SAMPLER_CODES[sampler],
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            kept_stats=bool(kept_stats),
        )
