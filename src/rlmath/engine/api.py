"""The entry points the public vocabulary functions call: validate, place, run, reshape.

Each entry checks its arguments (shapes, dtypes, devices and Python values;
tensor data only with ``validate=True``), turns DTensor inputs into a local
call (:mod:`rlmath.engine.dtensor`), resolves ``backend``, packs the
non-tensor arguments into an :class:`~rlmath.engine.config.OpConfig` and
applies the operation's autograd function. A vocabulary shard
(:class:`~rlmath.engine.config.VocabShard`) makes the same call
vocabulary-parallel; without one the whole vocabulary is in this process.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import replace
from typing import Any

import torch

from rlmath._validation import (
    check_index_tensor,
    check_label_values,
    check_labels,
    check_logits,
    check_optional_int,
    check_positive_int_or_none,
    check_same_shape,
    check_temperature,
    check_tensor,
    is_finite,
)
from rlmath.engine import dtensor as dt
from rlmath.engine import ops
from rlmath.engine.backends import resolve_backend
from rlmath.engine.config import OpConfig, VocabParallel, VocabShard
from rlmath.engine.functions import FusedHeadFunction, KLFunction, LogProbsEntropyFunction
from rlmath.engine.groups import (
    ProcessGroup,
    group_name,
    group_rank,
    group_size,
    resolve_group,
)
from rlmath.engine.head_truncation import truncated_head
from rlmath.engine.layout import validate_layout
from rlmath.engine.packed import NO_LABEL, packed_row_of, response_rows
from rlmath.engine.truncation import (
    SampledLogProbs,
    Truncation,
    check_truncation,
    truncation_columns,
    truncation_width,
)

__all__ = [
    "check_response_length",
    "dense_response_log_probs",
    "fused_head",
    "kl",
    "log_probs_entropy",
    "packed_response_log_probs",
    "packed_rows_from_indices",
    "packed_rows_from_mask",
    "positive_float",
    "resolve_shard",
    "sum_pi_squared",
]

Temp = float | torch.Tensor


def _vocab_size(vocab_size: object) -> int | None:
    total = check_optional_int("vocab_size", vocab_size)
    if total is not None and total < 1:
        raise ValueError(f"vocab_size must be >= 1, got {total}")
    return total


def resolve_shard(
    width: int,
    *,
    vocab_size: object,
    vocab_parallel: object,
    name: str = "logits",
    dtensor_shard: VocabShard | None = None,
) -> VocabShard | None:
    """The :class:`VocabShard` of this call: which global columns the ``width`` local ones are.

    ``vocab_size`` is the number of real tokens of the whole vocabulary: the
    columns from it on are padding, left out of the softmax. Without
    ``vocab_parallel`` the input holds the whole vocabulary (``None`` when it is
    all real). ``dtensor_shard``: the shard a DTensor's placements give.
    Shape-only checks; the shards' tiling of ``[0, V)`` is checked by the
    engine's first collective.
    """
    total = _vocab_size(vocab_size)
    if vocab_parallel is None:
        if dtensor_shard is not None:
            if total is None:
                return dtensor_shard
            first = dtensor_shard.start
            real = max(0, min(width, total - first))
            return replace(dtensor_shard, real=real, total=total if dtensor_shard.stride else 0)
        if total is None or total == width:
            return None
        if total > width:
            raise ValueError(
                f"vocab_size={total} is more than the {width} columns of {name}: it is the "
                "number of real tokens of the whole vocabulary (the columns from it on are "
                "padding). For a vocabulary split over processes pass "
                "vocab_parallel=rlmath.VocabParallel(group=...)."
            )
        return VocabShard(start=0, real=total)
    if not isinstance(vocab_parallel, VocabParallel):
        raise TypeError(
            "vocab_parallel must be an rlmath.VocabParallel or None, got "
            f"{type(vocab_parallel).__name__}"
        )
    if dtensor_shard is not None:
        raise TypeError(
            f"{name} is a DTensor, whose placements say how the vocabulary is split: "
            "vocab_parallel is for plain tensors holding each rank's shard"
        )
    start = check_optional_int("vocab_parallel.start", vocab_parallel.start)
    if start is not None and start < 0:
        raise ValueError(f"vocab_parallel.start must be >= 0, got {start}")
    if not isinstance(vocab_parallel.reduce_grad_hidden, bool):
        raise TypeError(
            "vocab_parallel.reduce_grad_hidden must be a bool, got "
            f"{type(vocab_parallel.reduce_grad_hidden).__name__}"
        )
    group = vocab_parallel.group
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(
            f"vocab_parallel.group must be a torch.distributed ProcessGroup or None, got "
            f"{type(group).__name__}"
        )
    group_id = group_name(group)
    if not group_id and ((start or 0) != 0 or (total is not None and total > width)):
        # A world of one holds the whole vocabulary: a shard of a larger one would be
        # normalized over its own columns only.
        raise ValueError(
            f"vocab_parallel.start={start} and vocab_size={total} describe a shard of a "
            "larger vocabulary, but no other process holds the rest: torch.distributed is "
            f"not initialized or the group has one rank, so {name} must be the whole "
            f"vocabulary (start 0 and vocab_size <= {width}, its width). Initialize the "
            "process group first, or pass the group that holds the shards."
        )
    stride = 0
    if start is None:
        start = group_rank(group) * width
        stride = width
    real = width if total is None else max(0, min(width, total - start))
    whole = total if total is not None else group_size(group) * width
    return VocabShard(
        start=start, real=real, group=group_id, stride=stride, total=whole if stride else 0
    )


def _validate_shard(
    shard: VocabShard | None,
    width: int,
    rows: int,
    labels: torch.Tensor | None,
    ignore_index: int | None,
    device: torch.device,
    name: str,
) -> None:
    """``validate=True``: labels in the vocabulary (one process) or the cross-rank check."""
    if shard is not None and shard.group:
        validate_layout(shard, width, rows, labels, ignore_index, device)
    elif labels is not None:
        check_label_values("labels", labels, shard.real_columns(width) if shard else width,
                           ignore_index)  # fmt: skip


def _config(
    backend: object,
    tensor: torch.Tensor,
    shard: VocabShard | None = None,
    *,
    family: str,
    **fields: Any,
) -> OpConfig:
    if family == "logits" and fields.get("sampler"):
        family = "kept"  # a sampler's kept set: its own kernels' self-check
    name = resolve_backend(backend, tensor, family)
    if shard is None:
        return OpConfig(backend=name, **fields)
    # Flat fields: a compiler tracing this call handles one plain dataclass.
    return OpConfig(
        backend=name,
        shard_start=shard.start,
        shard_real=shard.real,
        group=shard.group,
        shard_stride=shard.stride,
        shard_total=shard.total,
        **fields,
    )


def _no_vocab_parallel(vocab_parallel: object, name: str) -> None:
    if vocab_parallel is not None:
        raise TypeError(
            f"{name} is a DTensor, whose placements say how the vocabulary is split (Shard(-1) "
            "of the logits or Shard(0) of the head's weight runs vocabulary-parallel): "
            "vocab_parallel is for plain tensors holding each rank's shard"
        )


def _trailing(ndim_t: int, ndim_batch: int) -> tuple[int, ...]:
    """The batch dims that a tensor of ``ndim_t`` dims broadcast to the batch follows."""
    return tuple(range(ndim_batch - ndim_t, ndim_batch))


# ------------------------------------------------------------------ logits


def log_probs_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    temperature: Temp,
    want_entropy: bool,
    ignore_index: object,
    chunk_size: object,
    backend: object,
    validate: bool,
    vocab_size: object = None,
    vocab_parallel: object = None,
    logits_name: str = "logits",
    dtensor_shard: VocabShard | None = None,
    top_k: object = None,
    top_p: object = None,
    min_p: object = None,
    sampler: object = "vllm",
    kept: object = None,
    kept_stats: bool = False,
) -> Any:
    """Label log-probs (``labels.shape``) and/or entropy (``logits.shape[:-1]``) of ``logits / T``.

    ``labels`` is ``logits.shape[:-1]`` or ``logits.shape[:-1] + (K,)`` integer
    token ids (``None``: entropy only). With ``vocab_parallel``, ``logits``
    holds this rank's columns and the result is over the whole vocabulary of
    its group (:func:`resolve_shard`). ``top_k``, ``top_p``, ``min_p``,
    ``sampler`` and ``kept`` restrict each row's softmax to a sampler's kept set
    (:mod:`rlmath.engine.sampling`); with ``kept_stats`` the result is a
    :class:`SampledLogProbs`, else ``(log_probs, entropy)``.
    """
    truncating = (
        top_k is not None or top_p is not None or min_p is not None or kept is not None
        or kept_stats is not False or sampler != "vllm"
    )  # fmt: skip
    truncation = dict(top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler, kept=kept)
    if dt.any_dtensor(logits, labels, temperature, top_k, top_p, min_p, kept):
        return _log_probs_entropy_dtensor(
            logits, labels, temperature=temperature, want_entropy=want_entropy,
            ignore_index=ignore_index, chunk_size=chunk_size, backend=backend,
            validate=validate, vocab_size=vocab_size, vocab_parallel=vocab_parallel,
            logits_name=logits_name, kept_stats=kept_stats,
            **(truncation if truncating else {}),
        )  # fmt: skip
    x = check_logits(logits_name, logits)
    batch = tuple(x.shape[:-1])
    ig = check_optional_int("ignore_index", ignore_index)
    shard = resolve_shard(
        x.shape[-1], vocab_size=vocab_size, vocab_parallel=vocab_parallel, name=logits_name,
        dtensor_shard=dtensor_shard,
    )  # fmt: skip
    lab2d = out_shape = None
    if labels is not None:
        lab2d, out_shape = check_labels("labels", labels, batch, x.device, device_of=logits_name)
    if validate:
        _validate_shard(shard, x.shape[-1], math.prod(batch), lab2d, ig, x.device, logits_name)
    temp, scalar = check_temperature(
        temperature, batch, x.device, validate=validate, shape_name=f"{logits_name}.shape[:-1]",
        device_of=logits_name,
    )  # fmt: skip
    trunc = Truncation()
    if truncating:
        # A DTensor sharded over the vocabulary is split as vocab_parallel= is.
        split = vocab_parallel if dtensor_shard is None else dtensor_shard
        trunc = check_truncation(
            top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler, kept=kept,
            kept_stats=kept_stats, batch=batch, rows=batch,
            width=truncation_width(shard, x.shape[-1], split),
            real=truncation_columns(shard, x.shape[-1], split),
            split=split is not None, device=x.device,
            shape_name=f"{logits_name}.shape[:-1]", rows_name=f"{logits_name}.shape[:-1]",
        )  # fmt: skip
    cfg = _config(
        backend, x, family="logits", temperature=scalar, want_entropy=want_entropy, ignore_index=ig,
        chunk_size=check_positive_int_or_none("chunk_size", chunk_size),
        shard=shard, **trunc.fields,
    )  # fmt: skip
    logp, ent, _, aux, outside = LogProbsEntropyFunction.apply(
        x, lab2d, temp, None, trunc.sampling, trunc.kept, cfg
    )
    logp_out = logp.view(out_shape) if out_shape is not None else None
    ent_out = ent.view(batch) if want_entropy else None
    if not kept_stats:
        return logp_out, ent_out
    return SampledLogProbs(
        logp_out,  # type: ignore[arg-type]
        ent_out,
        outside.view(out_shape) if out_shape is not None else outside,
        aux[:, 1].to(torch.int64).view(batch),
    )


def _log_probs_entropy_dtensor(
    logits: Any, labels: Any, *, temperature: Any, vocab_parallel: object, logits_name: str,
    kept_stats: bool = False, **kwargs: Any,
) -> Any:  # fmt: skip
    if not dt.is_dtensor(logits):
        raise TypeError(
            f"labels or temperature is a DTensor but {logits_name} is not: pass DTensors "
            f"together, with {logits_name} a DTensor"
        )
    _no_vocab_parallel(vocab_parallel, logits_name)
    nb = logits.dim() - 1
    batch_dims = tuple(range(nb))
    lay = dt.layout_of(logits, logits_name, vocab_dim=nb, batch_dims=batch_dims)
    lab_dims = batch_dims + ((-1,) if labels is not None and labels.dim() == nb + 1 else ())
    local_labels = dt.localize(labels, lay, "labels", dims=lab_dims) if labels is not None else None
    local_temp = temperature
    if isinstance(temperature, torch.Tensor):
        local_temp = dt.localize(
            temperature, lay, "temperature", dims=_trailing(temperature.dim(), nb)
        )
    # The sampler's per-row parameters follow the rows as the temperature does; a replayed
    # kept set (ids, or a mask over the whole vocabulary) follows the rows, its last dim whole.
    for name in ("top_k", "top_p", "min_p"):
        v = kwargs.get(name)
        if isinstance(v, torch.Tensor):
            kwargs[name] = dt.localize(v, lay, name, dims=_trailing(v.dim(), nb))
    if isinstance(kwargs.get("kept"), torch.Tensor):
        kwargs["kept"] = dt.localize(kwargs["kept"], lay, "kept", dims=(*batch_dims, -1))
    out = log_probs_entropy(
        logits.to_local(), local_labels, temperature=local_temp, dtensor_shard=lay.shard,
        logits_name=logits_name, kept_stats=kept_stats, **kwargs,
    )  # fmt: skip
    batch = tuple(logits.shape[:-1])
    lab_shape = tuple(labels.shape) if labels is not None else None
    logp, ent = out[0], out[1]
    logp_out = dt.wrap(logp, lay, lab_shape, lab_dims) if lab_shape is not None else None
    ent_out = dt.wrap(ent, lay, batch, batch_dims) if ent is not None else None
    if not kept_stats:
        return logp_out, ent_out
    # Without labels (the entropy alone) log_probs and outside are as the plain call gives them.
    outside = dt.wrap(out.outside, lay, lab_shape, lab_dims) if lab_shape is not None else None
    return SampledLogProbs(
        logp_out if logp_out is not None else out.log_probs,
        ent_out,
        outside if outside is not None else out.outside,
        dt.wrap(out.kept_count, lay, batch, batch_dims),
    )


def kl(
    logits: Any,
    ref_logits: Any,
    *,
    temperature: Temp,
    chunk_size: object,
    backend: object,
    validate: bool,
    vocab_size: object = None,
    vocab_parallel: object = None,
    names: tuple[str, str] = ("logits", "ref_logits"),
    dtensor_shard: VocabShard | None = None,
) -> Any:
    """Exact ``KL(softmax(logits/T) ‖ softmax(ref_logits/T))`` per row, ``logits.shape[:-1]``."""
    if dt.any_dtensor(logits, ref_logits, temperature):
        if not dt.is_dtensor(logits):
            raise TypeError(f"a DTensor call of the KL needs {names[0]} to be a DTensor")
        _no_vocab_parallel(vocab_parallel, names[0])
        nb = logits.dim() - 1
        batch_dims = tuple(range(nb))
        lay = dt.layout_of(logits, names[0], vocab_dim=nb, batch_dims=batch_dims)
        if dt.is_dtensor(ref_logits):
            same = dt.layout_of(ref_logits, names[1], vocab_dim=nb, batch_dims=batch_dims)
            if ref_logits.device_mesh != logits.device_mesh or same.shard_dims != lay.shard_dims:
                raise TypeError(
                    f"{names[1]} must be a DTensor with the placements of {names[0]} "
                    f"({logits.placements}), got {ref_logits.placements}"
                )
            ref = ref_logits.to_local()
        else:
            ref = dt.localize(ref_logits, lay, names[1], dims=batch_dims)
            if lay.shard is not None:
                width = logits.to_local().shape[-1]
                ref = ref.narrow(-1, lay.shard.start, width)
        temp: Any = temperature
        if isinstance(temperature, torch.Tensor):
            temp = dt.localize(
                temperature, lay, "temperature", dims=_trailing(temperature.dim(), nb)
            )
        out = kl(
            logits.to_local(), ref, temperature=temp, chunk_size=chunk_size, backend=backend,
            validate=validate, vocab_size=vocab_size, names=names, dtensor_shard=lay.shard,
        )  # fmt: skip
        return dt.wrap(out, lay, tuple(logits.shape[:-1]), batch_dims)
    x = check_logits(names[0], logits)
    r = check_logits(names[1], ref_logits)
    check_same_shape(names[1], r, names[0], x)
    if r.device != x.device:
        raise ValueError(f"{names[1]} is on {r.device} but {names[0]} is on {x.device}")
    batch = tuple(x.shape[:-1])
    shard = resolve_shard(
        x.shape[-1], vocab_size=vocab_size, vocab_parallel=vocab_parallel, name=names[0],
        dtensor_shard=dtensor_shard,
    )  # fmt: skip
    if validate:
        _validate_shard(shard, x.shape[-1], math.prod(batch), None, None, x.device, names[0])
    temp_t, scalar = check_temperature(
        temperature, batch, x.device, validate=validate, shape_name=f"{names[0]}.shape[:-1]",
        device_of=names[0],
    )  # fmt: skip
    cfg = _config(
        backend, x, family="kl", temperature=scalar,
        chunk_size=check_positive_int_or_none("chunk_size", chunk_size),
        shard=shard,
    )  # fmt: skip
    out, _, _ = KLFunction.apply(x, r, temp_t, cfg)
    return out.view(batch)


def sum_pi_squared(
    logits: torch.Tensor,
    *,
    temperature: Temp,
    chunk_size: object,
    backend: object,
    validate: bool,
    vocab_size: object = None,
    vocab_parallel: object = None,
    logits_name: str = "logits",
) -> torch.Tensor:
    """``Σ_v π_v²`` of ``π = softmax(logits / T)`` per row, ``logits.shape[:-1]``; no gradient."""
    x = check_logits(logits_name, logits)
    if dt.is_dtensor(x):
        raise TypeError(
            f"{logits_name}: DTensor inputs are not supported here; pass to_local() with "
            "vocab_parallel=VocabParallel(group=...) for Shard(-1) logits"
        )
    batch = tuple(x.shape[:-1])
    shard = resolve_shard(
        x.shape[-1], vocab_size=vocab_size, vocab_parallel=vocab_parallel, name=logits_name
    )
    if validate:
        _validate_shard(shard, x.shape[-1], math.prod(batch), None, None, x.device, logits_name)
    temp, scalar = check_temperature(
        temperature, batch, x.device, validate=validate, shape_name=f"{logits_name}.shape[:-1]",
        device_of=logits_name,
    )  # fmt: skip
    cfg = _config(
        backend, x, family="pi_squared", temperature=scalar,
        chunk_size=check_positive_int_or_none("chunk_size", chunk_size),
        shard=shard,
    )  # fmt: skip
    with torch.no_grad():
        return ops.sum_pi_squared(x.detach(), temp, *cfg.op_args()).view(batch)


# ------------------------------------------------------------------ responses


def check_response_length(response_length: object, seqlen: int, *, allow_full: bool) -> int:
    if isinstance(response_length, bool) or not isinstance(response_length, int):
        raise TypeError(f"response_length must be an int, got {type(response_length).__name__}")
    hi = seqlen if allow_full else seqlen - 1
    if not 1 <= response_length <= hi:
        raise ValueError(
            f"response_length must be in [1, {hi}] for sequences of {seqlen} columns, "
            f"got {response_length}"
        )
    return response_length


def _response_truncation(
    truncation: dict[str, Any] | None,
    x: torch.Tensor,
    shard: VocabShard | None,
    B: int,
    S: int,
    R: int,
    vocab_parallel: object,
) -> Truncation:
    """The checked truncation arguments of a response function.

    Per-row parameters broadcast to ``(B, S)`` (the predicting position, as the
    temperature); ``kept`` is ``(B, R, ·)``, one row per response token.
    """
    if not truncation:
        return Truncation()
    return check_truncation(
        **truncation, batch=(B, S), rows=(B, R),
        width=truncation_width(shard, x.shape[-1], vocab_parallel),
        real=truncation_columns(shard, x.shape[-1], vocab_parallel),
        split=vocab_parallel is not None, device=x.device, shape_name="input_ids.shape",
        rows_name="(B, response_length)",
    )  # fmt: skip


def _response_result(
    logp: torch.Tensor,
    aux: torch.Tensor,
    outside: torch.Tensor,
    B: int,
    R: int,
    truncation: dict[str, Any] | None,
) -> Any:
    logp = logp.view(B, R)
    if not truncation or not truncation.get("kept_stats"):
        return logp
    return SampledLogProbs(logp, None, outside.view(B, R), aux[:, 1].to(torch.int64).view(B, R))


def dense_response_log_probs(
    input_ids: torch.Tensor,
    logits: torch.Tensor,
    response_length: int,
    *,
    temperature: Temp,
    chunk_size: object,
    backend: object,
    validate: bool = False,
    vocab_size: object = None,
    vocab_parallel: object = None,
    truncation: dict[str, Any] | None = None,
) -> Any:
    """``(B, R)`` log-probs of the last ``R`` tokens; ``logits[:, t]`` predicts ``input_ids[:, t+1]``.

    ``truncation``: the keyword arguments ``top_k``, ``top_p``, ``min_p``,
    ``sampler``, ``kept`` and ``kept_stats`` (``None``: none); with
    ``kept_stats`` the result is a :class:`SampledLogProbs`.
    """
    ids = check_index_tensor("input_ids", input_ids)
    x = check_logits("logits", logits)
    if dt.any_dtensor(ids, x, temperature):
        raise TypeError("DTensor inputs are not supported by the response functions")
    if ids.dim() != 2 or x.dim() != 3 or tuple(x.shape[:2]) != tuple(ids.shape):
        raise ValueError(
            "logits must have shape (B, S, V) with (B, S) = input_ids.shape; got input_ids "
            f"{tuple(ids.shape)} and logits {tuple(x.shape)}"
        )
    B, S = ids.shape
    R = check_response_length(response_length, S, allow_full=False)
    shard = resolve_shard(x.shape[-1], vocab_size=vocab_size, vocab_parallel=vocab_parallel)
    labels = ids[:, -R:].reshape(-1, 1).long()
    if validate:
        _validate_shard(shard, x.shape[-1], B * R, labels, None, x.device, "logits")
    temp, scalar = check_temperature(
        temperature, (B, S), x.device, validate=validate, shape_name="input_ids.shape"
    )
    trunc = _response_truncation(truncation, x, shard, B, S, R, vocab_parallel)
    cfg = _config(
        backend, x, family="logits", temperature=scalar, narrow=(1, S - R - 1, R),
        chunk_size=check_positive_int_or_none("chunk_size", chunk_size), shard=shard,
        **trunc.fields,
    )  # fmt: skip
    # The operator reads the response rows of the full logits in place: slicing them
    # here would make autograd allocate a second full-size gradient in backward.
    logp, _, _, aux, outside = LogProbsEntropyFunction.apply(
        x, labels, temp, None, trunc.sampling, trunc.kept, cfg
    )
    return _response_result(logp, aux, outside, B, R, truncation)


def packed_response_log_probs(
    ids: torch.Tensor,
    row_of: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    temperature: Temp,
    chunk_size: object,
    backend: object,
    validate: bool,
    vocab_size: object = None,
    vocab_parallel: object = None,
    truncation: dict[str, Any] | None = None,
) -> Any:
    """``(B, R)`` response log-probs from packed logits, shifting within each sequence.

    ``ids``: ``(B, S)`` token ids on the dense grid; ``row_of``: ``(B, S)`` packed
    row of each valid position, -1 elsewhere (:func:`~rlmath.engine.packed.packed_row_of`).
    Only the ``B·R`` rows predicting response positions are read, through an
    index of fixed length (no host read). If ``logits_rmpad`` does not have one
    row per valid position, every result is NaN (``validate=True`` raises instead).
    ``truncation``: as in :func:`dense_response_log_probs`.
    """
    B, S = ids.shape
    x = logits_rmpad
    nnz = x.shape[0]
    shard = resolve_shard(
        x.shape[-1], vocab_size=vocab_size, vocab_parallel=vocab_parallel, name="logits_rmpad"
    )
    plan = response_rows(ids, row_of, response_length)
    if validate:
        n_valid = int((row_of >= 0).sum())
        if n_valid != nnz:
            raise ValueError(
                f"logits_rmpad must have one row per valid token ({n_valid}), got {nnz}"
            )
        used = plan.labels[plan.labels != NO_LABEL].reshape(-1, 1)
        _validate_shard(shard, x.shape[-1], B * response_length, used, None, x.device,
                        "logits_rmpad")  # fmt: skip
    # A mask that does not match the packed rows cannot be told on the host without a
    # sync: the rows are clamped into range and every result becomes NaN instead.
    mismatch = row_of.amax() + 1 != nnz if row_of.numel() else None
    rows = plan.rows.clamp_max(max(nnz - 1, 0))
    temp, scalar = check_temperature(
        temperature, (B, S), x.device, validate=validate, shape_name="input_ids.shape",
        device_of="logits_rmpad",
    )  # fmt: skip
    if temp is not None:
        # Each packed row's own (predicting) position; a spare last row collects padding.
        dense = temp.expand(B, S).reshape(-1)
        packed = torch.ones(nnz + 1, dtype=dense.dtype, device=x.device)
        slot = torch.where(row_of >= 0, row_of, nnz).reshape(-1)
        temp = packed.scatter(0, slot, dense)[:nnz]
    trunc = _response_truncation(truncation, x, shard, B, S, response_length, vocab_parallel)
    sampling = trunc.sampling
    if sampling is not None:
        # As the temperature: each packed row takes its own position's parameters.
        slot3 = torch.where(row_of >= 0, row_of, nnz).reshape(-1, 1).expand(-1, 3)
        spare = torch.ones(nnz + 1, 3, dtype=sampling.dtype, device=x.device)
        sampling = spare.scatter(0, slot3, sampling.reshape(-1, 3))[:nnz]
    cfg = _config(
        backend, x, family="logits", temperature=scalar, ignore_index=NO_LABEL,
        chunk_size=check_positive_int_or_none("chunk_size", chunk_size),
        shard=shard, **trunc.fields,
    )  # fmt: skip
    logp, _, _, aux, outside = LogProbsEntropyFunction.apply(
        x, plan.labels, temp, rows, sampling, trunc.kept, cfg
    )
    if mismatch is not None:
        logp = torch.where(mismatch, float("nan"), logp)
    return _response_result(logp, aux, outside, B, response_length, truncation)


def packed_rows_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """:func:`~rlmath.engine.packed.packed_row_of` of a bool or 0/1 mask."""
    return packed_row_of(attention_mask != 0)


def packed_rows_from_indices(
    indices: torch.Tensor, ids_rmpad: torch.Tensor, batch_size: int, seqlen: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (B, S), row_of (B, S))`` on the dense grid from ``unpad_input``'s flat ``indices``."""
    n = batch_size * seqlen
    idx = indices.reshape(-1).long()
    row_of = torch.full((n,), -1, dtype=torch.long, device=idx.device)
    row_of = row_of.scatter(0, idx, torch.arange(idx.numel(), device=idx.device))
    ids = torch.zeros(n, dtype=ids_rmpad.dtype, device=idx.device).scatter(0, idx, ids_rmpad)
    return ids.view(batch_size, seqlen), row_of.view(batch_size, seqlen)


# ------------------------------------------------------------------ fused head


def _check_head(
    hidden: object, weight: object, bias: object, names: tuple[str, str, str], min_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Shapes and devices of the head's inputs; their dtypes are reconciled by :func:`_head_dtype`."""
    hn, wn, bn = names
    h = check_tensor(hn, hidden, floating=True)
    if h.dim() < 1:
        raise ValueError(f"{hn} must have shape (..., H), got a 0-d tensor")
    w = check_tensor(wn, weight, floating=True)
    if w.dim() != 2 or w.shape[0] < min_rows or w.shape[1] != h.shape[-1]:
        rows = "V/tp" if min_rows == 0 else "V"
        raise ValueError(
            f"{wn} must have shape ({rows}, H) with {rows} >= {min_rows} and H = "
            f"{hn}.shape[-1] = {h.shape[-1]}, got {tuple(w.shape)}"
        )
    if w.device != h.device:
        raise ValueError(f"{wn} is on {w.device} but {hn} is on {h.device}")
    if bias is None:
        return h, w, None
    b = check_tensor(bn, bias, floating=True)
    if tuple(b.shape) != (w.shape[0],):
        raise ValueError(
            f"{bn} must have shape (V,) = ({w.shape[0]},), the rows of {wn}, got {tuple(b.shape)}"
        )
    if b.device != w.device:
        raise ValueError(f"{bn} is on {b.device} but {wn} is on {w.device}")
    return h, w, b


def _head_dtype(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The head's inputs in one dtype: autocast's when it is on, else the widest of theirs.

    Under ``torch.autocast`` the head runs in the autocast dtype, as ``F.linear``
    would (the casts are differentiable: gradients reach an fp32 master
    weight). Otherwise mixed dtypes (bf16 hidden states with an fp32 weight,
    say) are promoted to the widest, so nothing is rounded down.
    """
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    else:
        dtype = torch.promote_types(h.dtype, w.dtype)
        if b is not None:
            dtype = torch.promote_types(dtype, b.dtype)
    return h.to(dtype), w.to(dtype), b.to(dtype) if b is not None else None


def positive_float(name: str, value: object) -> float:
    """A finite float > 0 (Python or numpy)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    v = float(value)
    if not is_finite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return v


def fused_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    temperature: Temp,
    want_entropy: bool,
    ignore_index: object,
    chunk_size: object,
    vocab_chunk_size: object,
    backend: object,
    validate: bool,
    logit_scale: object = 1.0,
    softcap: object = None,
    vocab_size: object = None,
    vocab_parallel: object = None,
    names: tuple[str, str, str] = ("hidden", "weight", "bias"),
    dtensor_shard: VocabShard | None = None,
    reduce_grad_hidden: bool = True,
    top_k: object = None,
    top_p: object = None,
    min_p: object = None,
    sampler: object = "vllm",
    kept_stats: bool = False,
) -> Any:
    """Label log-probs (``labels.shape``) and entropy (``hidden.shape[:-1]``) of the LM head.

    The logits are ``softcap·tanh(logit_scale·(hidden @ weight.T + bias) / softcap)``;
    ``vocab_size`` keeps the rows of ``weight`` below it as the vocabulary and
    leaves the others (padding) out of the softmax; with ``vocab_parallel``
    ``weight`` holds this rank's rows (:func:`resolve_shard`). ``top_k``,
    ``top_p``, ``min_p`` and ``sampler`` restrict each row's softmax to a
    sampler's kept set (:mod:`rlmath.engine.head_truncation`); with
    ``kept_stats`` the result is a :class:`SampledLogProbs`.
    """
    truncating = (
        top_k is not None or top_p is not None or min_p is not None or kept_stats is not False
        or sampler != "vllm"
    )  # fmt: skip
    if dt.any_dtensor(hidden, weight, bias, labels, temperature, top_k, top_p, min_p):
        _no_vocab_parallel(vocab_parallel, names[1])
        truncation = dict(top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler)
        return _fused_head_dtensor(
            hidden, weight, labels, bias=bias, temperature=temperature,
            want_entropy=want_entropy, ignore_index=ignore_index, chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size, backend=backend, validate=validate,
            logit_scale=logit_scale, softcap=softcap, vocab_size=vocab_size, names=names,
            kept_stats=kept_stats, **(truncation if truncating else {}),
        )  # fmt: skip
    sharded = vocab_parallel is not None or dtensor_shard is not None
    h, w, b = _check_head(hidden, weight, bias, names, 0 if sharded else 1)
    scale = positive_float("logit_scale", logit_scale)
    cap = 0.0 if softcap is None else positive_float("softcap", softcap)
    batch = tuple(h.shape[:-1])
    ig = check_optional_int("ignore_index", ignore_index)
    lab2d, out_shape = check_labels(
        "labels", labels, batch, h.device, device_of=names[0],
        batch_name=f"{names[0]}.shape[:-1]",
    )  # fmt: skip
    shard = resolve_shard(
        w.shape[0], vocab_size=vocab_size, vocab_parallel=vocab_parallel, name=names[1],
        dtensor_shard=dtensor_shard,
    )  # fmt: skip
    if isinstance(vocab_parallel, VocabParallel):
        reduce_grad_hidden = vocab_parallel.reduce_grad_hidden
    if validate:
        _validate_shard(shard, w.shape[0], math.prod(batch), lab2d, ig, h.device, names[1])
    temp, scalar = check_temperature(
        temperature, batch, h.device, validate=validate, shape_name=f"{names[0]}.shape[:-1]",
        device_of=names[0],
    )  # fmt: skip
    h, w, b = _head_dtype(h, w, b)
    if truncating:
        real = shard.real_columns(w.shape[0]) if shard is not None else w.shape[0]
        if dtensor_shard is not None and shard is not None:
            # A weight sharded over the vocabulary as a DTensor: its rows placed by start=.
            vocab_parallel = VocabParallel(
                group=resolve_group(shard.group), start=shard.start,
                reduce_grad_hidden=bool(reduce_grad_hidden),
            )  # fmt: skip
        check_truncation(  # validates; the head passes the values on
            top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler, kept=None,
            kept_stats=kept_stats, batch=batch, rows=batch, width=real,
            real=truncation_columns(shard, w.shape[0], vocab_parallel),
            split=vocab_parallel is not None, device=h.device,
            shape_name=f"{names[0]}.shape[:-1]", rows_name=f"{names[0]}.shape[:-1]",
        )  # fmt: skip
        params = {"top_k": top_k, "top_p": top_p, "min_p": min_p, "sampler": sampler}
        logp, ent, outside, count = truncated_head(
            h, w, b, lab2d.reshape(out_shape),
            temperature=temperature, params=params, scale=scale, cap=cap, real=real,
            want_entropy=bool(want_entropy), ignore_index=ig,
            chunk_size=check_positive_int_or_none("chunk_size", chunk_size), backend=backend,
            vocab_parallel=vocab_parallel, vocab_size=vocab_size,
            group=resolve_group(shard.group) if shard is not None and shard.group else None,
            reduce_grad_hidden=bool(reduce_grad_hidden),
        )  # fmt: skip
        if not kept_stats:
            return logp, ent
        return SampledLogProbs(logp, ent, outside, count)
    cfg = _config(
        backend, h, family="head", temperature=scalar, want_entropy=bool(want_entropy), ignore_index=ig,
        chunk_size=check_positive_int_or_none("chunk_size", chunk_size),
        vocab_chunk_size=check_positive_int_or_none("vocab_chunk_size", vocab_chunk_size),
        shard=shard, reduce_grad_hidden=bool(reduce_grad_hidden), logit_scale=scale,
        softcap=cap,
    )  # fmt: skip
    logp, ent, _ = FusedHeadFunction.apply(h, w, b, lab2d, temp, cfg)
    return logp.view(out_shape), ent.view(batch) if want_entropy else None


def _fused_head_dtensor(
    hidden: Any, weight: Any, labels: Any, *, bias: Any, temperature: Any,
    names: tuple[str, str, str], kept_stats: bool = False, **kwargs: Any,
) -> Any:  # fmt: skip
    hn, wn, bn = names
    if not dt.is_dtensor(hidden):
        raise TypeError(
            f"{wn} is a DTensor but {hn} is a plain tensor. If the head belongs to a model "
            "sharded with FSDP2 (fully_shard), its parameters are sharded DTensors outside "
            "the module's forward: call the fused head from inside a forward of a module "
            "FSDP2 wraps (or use rlmath.fused_head.FusedLMHeadLogProbs registered as a "
            f"submodule), so that they are gathered first. For tensor parallelism pass {hn} "
            "as a DTensor (Replicate() over the vocabulary's mesh dim)."
        )
    nb = hidden.dim() - 1
    batch_dims = tuple(range(nb))
    lay = dt.layout_of(hidden, hn, vocab_dim=-1 % max(hidden.dim(), 1), batch_dims=batch_dims)
    if lay.vocab_mesh_dim is not None:
        raise TypeError(f"{hn}: the hidden dim cannot be sharded ({hidden.placements})")
    wshard = None
    w_local = weight
    b_local = bias
    if dt.is_dtensor(weight):
        if weight.device_mesh != hidden.device_mesh:
            raise TypeError(f"{wn} and {hn} are DTensors on different device meshes")
        wl = dt.layout_of(weight, wn, vocab_dim=0, batch_dims=())
        if wl.vocab_mesh_dim is not None:
            if lay.shard_dims[wl.vocab_mesh_dim] is not None:
                raise TypeError(
                    f"{hn} is sharded over mesh dim {wl.vocab_mesh_dim}, over which {wn} "
                    f"splits the vocabulary: {hn} must be Replicate() there"
                )
            wshard = wl.shard
        w_local = weight.to_local()
        if bias is not None:
            b_local = bias.to_local() if dt.is_dtensor(bias) else _bias_block(bias, wl)
    elif dt.is_dtensor(bias):
        raise TypeError(f"{bn} is a DTensor but {wn} is not")
    lab_dims = batch_dims + ((-1,) if labels.dim() == nb + 1 else ())
    local_labels = dt.localize(labels, lay, "labels", dims=lab_dims)
    temp = temperature
    if isinstance(temperature, torch.Tensor):
        temp = dt.localize(temperature, lay, "temperature", dims=_trailing(temperature.dim(), nb))
    for name in ("top_k", "top_p", "min_p"):  # per-row sampler parameters: as the temperature
        v = kwargs.get(name)
        if isinstance(v, torch.Tensor):
            kwargs[name] = dt.localize(v, lay, name, dims=_trailing(v.dim(), nb))
    out = fused_head(
        hidden.to_local(), w_local, local_labels, bias=b_local, temperature=temp,
        dtensor_shard=wshard, names=names, kept_stats=kept_stats, **kwargs,
    )  # fmt: skip
    logp, ent = out[0], out[1]
    out_lay = dt.Layout(lay.mesh, lay.shard_dims, None, None)
    batch = tuple(hidden.shape[:-1])
    logp_out = dt.wrap(logp, out_lay, tuple(labels.shape), lab_dims)
    ent_out = dt.wrap(ent, out_lay, batch, batch_dims) if ent is not None else None
    if not kept_stats:
        return logp_out, ent_out
    return SampledLogProbs(
        logp_out,
        ent_out,
        dt.wrap(out.outside, out_lay, tuple(labels.shape), lab_dims),
        dt.wrap(out.kept_count, out_lay, batch, batch_dims),
    )


def _bias_block(bias: torch.Tensor, layout: dt.Layout) -> torch.Tensor:
    """This rank's rows of a plain (global) bias for a vocabulary-sharded weight."""
    if layout.shard is None or layout.vocab_mesh_dim is None:
        return bias
    mesh = layout.mesh
    size = -(-bias.shape[0] // mesh.size(layout.vocab_mesh_dim))
    start = min(layout.shard.start, bias.shape[0])
    return bias.narrow(0, start, max(0, min(start + size, bias.shape[0]) - start))
