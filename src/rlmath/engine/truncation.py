"""The arguments of a truncating sampler (``top_k``, ``top_p``, ``min_p``, ``sampler``, ``kept``).

:func:`check_truncation` validates them for one call and turns them into the
:class:`~rlmath.engine.config.OpConfig` fields and the two tensors the
engine's log-probs operator takes (per-row parameters, a replayed kept set);
the rules themselves are in :mod:`rlmath.engine.sampling`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlmath.engine.sampling import SAMPLERS

__all__ = [
    "SampledLogProbs",
    "Truncation",
    "check_truncation",
    "truncation_columns",
    "truncation_width",
]


class SampledLogProbs(NamedTuple):
    """Log-probs under a sampler's kept set, with what the caller needs to monitor it.

    Returned by the log-probs functions with ``kept_stats=True``.

    Attributes:
        log_probs: the log-probabilities (``labels.shape``), as without ``kept_stats``.
        entropy: the entropy of each row's renormalised kept distribution
            (``logits.shape[:-1]``), or ``None`` for a function that computes
            no entropy.
        outside: bool, ``labels.shape``: the label is not in the kept set the
            rule gives (only numerical differences between the engine and
            rlmath, or a label the rollout did not sample, put it there). Its
            log-prob is computed as if it had been kept: the row's kept set is
            extended by its labels. ``False`` at ignored labels.
        kept_count: int64, the rows' shape: the number of tokens with a
            finite logit in each row's kept set, before labels are added.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    outside: torch.Tensor
    kept_count: torch.Tensor


@dataclass
class Truncation:
    """The checked truncation arguments of one call.

    ``active``: the call restricts the softmax (or reports ``kept_stats``);
    ``fields``: the :class:`OpConfig` fields; ``sampling``: ``batch + (3,)``
    float64 per-row parameters or ``None``; ``kept``: ``(M, V)`` bool or
    ``(M, K)`` int64, or ``None``.
    """

    active: bool = False
    fields: dict[str, Any] = field(default_factory=dict)
    sampling: torch.Tensor | None = None
    kept: torch.Tensor | None = None


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _param_tensor(
    name: str, t: torch.Tensor, batch: tuple[int, ...], device: torch.device, shape_name: str
) -> torch.Tensor:
    t = t.detach()
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the logits are on {device}")
    try:
        shape = torch.broadcast_shapes(tuple(t.shape), batch)
    except RuntimeError:
        shape = None
    if shape != batch:
        raise ValueError(
            f"{name} must be a number or a tensor broadcastable to {shape_name} = {batch} "
            f"(one value per row), got shape {tuple(t.shape)}"
        )
    return t


def _bad(t: torch.Tensor) -> bool:
    """Whether any entry is set (a host read; skipped while a compiler traces the call)."""
    if torch.compiler.is_compiling() or not t.numel():
        return False
    return bool(t.any())


def _check_k(value: object, batch: tuple[int, ...], device: torch.device, shape_name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"top_k must be an int or an integer tensor, got dtype {value.dtype}")
        t = _param_tensor("top_k", value, batch, device, shape_name)
        if _bad(t < 1):
            raise ValueError(f"top_k must be >= 1 in every row, got a minimum of {int(t.min())}")
        return t
    if not _is_int(value):
        raise TypeError(
            f"top_k must be an int, an integer tensor or None, got {type(value).__name__}"
        )
    if int(value) < 1:  # type: ignore[call-overload]
        raise ValueError(f"top_k must be >= 1 (None: no top-k), got {value}")
    return int(value)  # type: ignore[call-overload]


def _check_fraction(
    name: str,
    value: object,
    batch: tuple[int, ...],
    device: torch.device,
    shape_name: str,
    *,
    open_low: bool,
) -> Any:
    """``top_p`` in ``(0, 1]`` (``open_low``) or ``min_p`` in ``[0, 1]``."""
    if value is None:
        return None
    interval = "(0, 1]" if open_low else "[0, 1]"
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a float or a floating tensor, got dtype {value.dtype}")
        t = _param_tensor(name, value, batch, device, shape_name)
        low_bad = (t <= 0) if open_low else (t < 0)
        if _bad(low_bad | (t > 1) | t.isnan()):
            raise ValueError(f"{name} must lie in {interval} in every row")
        return t
    if not _is_real(value):
        raise TypeError(f"{name} must be a float, a tensor or None, got {type(value).__name__}")
    v = float(value)  # type: ignore[arg-type]
    if not ((v > 0) if open_low else (v >= 0)) or not v <= 1:
        raise ValueError(
            f"{name} must lie in {interval} (None: no {name.replace('_', '-')}), got {value}"
        )
    return v


def _check_kept(
    kept: object, rows: tuple[int, ...], width: int, real: int, device: torch.device, rows_name: str
) -> torch.Tensor:
    """A replayed kept set as ``(M, V)`` bool or ``(M, K)`` int64 ids padded with -1."""
    M = 1
    for n in rows:
        M *= n
    if isinstance(kept, torch.Tensor):
        t = kept.detach()
        if t.device != device:
            raise ValueError(f"kept is on {t.device} but the logits are on {device}")
        if t.dtype == torch.bool:
            if tuple(t.shape) != (*rows, width):
                raise ValueError(
                    f"kept: a boolean mask must have shape {rows_name} + (V,) = "
                    f"{(*rows, width)}, got {tuple(t.shape)}"
                )
            t = t.reshape(M, width)
            if real < width:
                t = t[:, :real]
            return t
        if t.is_floating_point() or t.is_complex():
            raise TypeError(
                f"kept must be a bool mask or an integer tensor of token ids, got dtype {t.dtype}"
            )
        if t.dim() != len(rows) + 1 or tuple(t.shape[:-1]) != rows:
            raise ValueError(
                f"kept: token ids must have shape {rows_name} + (K,) = {(*rows, 'K')}, padded "
                f"with -1, got {tuple(t.shape)}"
            )
        t = t.reshape(M, t.shape[-1]).long()
    elif isinstance(kept, Sequence) and not isinstance(kept, (str, bytes)):
        if len(kept) != M:
            raise ValueError(
                f"kept: a list must hold one sequence of token ids per row ({M} rows of "
                f"{rows_name} = {rows}), got {len(kept)}"
            )
        seqs = [list(r.tolist() if isinstance(r, torch.Tensor) else r) for r in kept]
        K = max((len(r) for r in seqs), default=0)
        t = torch.full((M, max(K, 1)), -1, dtype=torch.long)
        for i, r in enumerate(seqs):
            if r:
                t[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        t = t.to(device)
    else:
        raise TypeError(
            f"kept must be a bool tensor, an integer tensor or a list of token-id sequences, "
            f"got {type(kept).__name__}"
        )
    if _bad((t < -1) | (t >= real)):
        raise ValueError(f"kept: token ids must lie in [0, {real}) (or be -1, padding)")
    return t


def check_truncation(
    *,
    top_k: object,
    top_p: object,
    min_p: object,
    sampler: object,
    kept: object,
    kept_stats: object,
    batch: tuple[int, ...],
    rows: tuple[int, ...],
    width: int,
    real: int,
    device: torch.device,
    shape_name: str,
    rows_name: str,
    split: bool = False,
) -> Truncation:
    """Check the truncation arguments of one call.

    Args:
        top_k, top_p, min_p, sampler, kept, kept_stats: as the public functions take them.
        batch: the shape the per-row parameters broadcast to (``shape_name`` in errors).
        rows: the shape of the output rows ``kept`` is aligned with (``rows_name``).
        width: the logits' last dim; real: its real columns.
        device: the logits' device.
        split: the vocabulary is split over processes (``vocab_parallel``):
            ``kept`` holds global token ids, or a mask over the whole vocabulary
            of ``width`` tokens (``width=0``: not known here, ids only).

    Raises:
        ValueError: a value out of range or a shape that does not fit, naming the argument.
        TypeError: a value of the wrong type.

    Per-row tensors are read on the host (one synchronisation) to check their
    values, except while ``torch.compile`` traces the call.
    """
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise ValueError(
            f"sampler must be one of {', '.join(map(repr, SAMPLERS))}, got {sampler!r}"
        )
    if not isinstance(kept_stats, bool):
        raise TypeError(f"kept_stats must be a bool, got {type(kept_stats).__name__}")
    k = _check_k(top_k, batch, device, shape_name)
    p = _check_fraction("top_p", top_p, batch, device, shape_name, open_low=True)
    mp = _check_fraction("min_p", min_p, batch, device, shape_name, open_low=False)
    if kept is not None and split and not width and isinstance(kept, torch.Tensor):
        if kept.dtype == torch.bool:
            raise ValueError(
                "kept: with vocab_parallel placed by start=, the size of the whole "
                "vocabulary is not known here: pass the kept set as token ids (padded "
                "with -1) or as lists, or give vocab_size="
            )
    if kept is not None:
        if k is not None or p is not None or mp is not None:
            raise ValueError(
                "kept replays the rollout's kept set: pass it alone, without top_k, top_p or min_p"
            )
        return Truncation(
            active=True,
            fields={"sampler": "kept", "kept_stats": kept_stats},
            kept=_check_kept(kept, rows, width, real, device, rows_name),
        )
    # Scalars that cut nothing are left out: the call is then the plain one.
    if not isinstance(k, torch.Tensor) and k is not None and k >= real:
        k = None
    if not isinstance(p, torch.Tensor) and p is not None and p >= 1.0:
        p = None
    if not isinstance(mp, torch.Tensor) and mp is not None and mp <= 0.0:
        mp = None
    if k is None and p is None and mp is None and not kept_stats:
        return Truncation()
    fields: dict[str, Any] = {
        "sampler": sampler,
        "top_k": -1 if isinstance(k, torch.Tensor) else (k or 0),
        "top_p": -1.0 if isinstance(p, torch.Tensor) else (1.0 if p is None else p),
        "min_p": -1.0 if isinstance(mp, torch.Tensor) else (0.0 if mp is None else mp),
        "kept_stats": kept_stats,
    }
    sampling = None
    if any(isinstance(v, torch.Tensor) for v in (k, p, mp)):
        cols = [
            k if isinstance(k, torch.Tensor) else real,
            p if isinstance(p, torch.Tensor) else 1.0,
            mp if isinstance(mp, torch.Tensor) else 0.0,
        ]
        sampling = torch.stack(
            [
                c.to(torch.float64).expand(batch)
                if isinstance(c, torch.Tensor)
                else torch.full(batch, float(c), dtype=torch.float64, device=device)
                for c in cols
            ],
            -1,
        )
    return Truncation(active=True, fields=fields, sampling=sampling)


def truncation_columns(shard: Any, width: int, vocab_parallel: object) -> int:
    """The vocabulary size a ``top_k`` is compared with: the real columns of a whole
    vocabulary, the group's total for a shard whose layout follows from the shapes, and
    no bound (``2**62``) for a shard placed by an explicit ``start``."""
    real = shard.real_columns(width) if shard is not None else width
    if vocab_parallel is None:
        return int(real)
    return int(shard.total) if shard is not None and shard.stride else 2**62


def truncation_width(shard: Any, width: int, vocab_parallel: object) -> int:
    """The last dim a replayed boolean kept mask must have: the logits' own, or over vocabulary
    shards the whole vocabulary's when it follows from the shapes (0: not known here)."""
    if vocab_parallel is None:
        return width
    return int(shard.total) if shard is not None and shard.stride else 0
