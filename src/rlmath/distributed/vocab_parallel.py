"""The earlier spelling of the vocabulary-parallel functions: deprecated, kept for one release.

Every vocabulary function now takes the shard as an argument,
``vocab_parallel=rlmath.VocabParallel(group=..., start=...)``, and
accepts everything it accepts in one process (K labels, ``logit_scale``,
``softcap``, ``ignore_index``, per-row temperatures, ``backend``). Each
function here warns once per process (``FutureWarning``) and calls it:

========================================================  ===============================================
deprecated                                                call instead (same values and gradients)
========================================================  ===============================================
``vocab_parallel_log_probs_from_logits(x, labels, ...)``  ``log_probs_from_logits(x, labels, vocab_parallel=VocabParallel(...), ...)``
``vocab_parallel_entropy``                                ``entropy_from_logits``
``vocab_parallel_log_probs_and_entropy``                  ``log_probs_and_entropy_from_logits``
``vocab_parallel_kl_from_logits``                         ``kl_from_logits``
``vocab_parallel_sum_pi_squared``                         ``sum_pi_squared_from_logits``
``vocab_parallel_log_probs_from_logits_response_rmpad``   ``log_probs_from_logits_response_rmpad``
``vocab_parallel_log_probs_and_entropy_from_hidden``      ``log_probs_and_entropy_from_hidden`` (``weight_shard`` → ``weight``, ``bias_shard`` → ``bias``)
========================================================  ===============================================

``vocab_start_index=s, group=g`` become ``VocabParallel(group=g, start=s)``;
``reduce_grad_hidden`` becomes ``VocabParallel(reduce_grad_hidden=...)``;
``vocab_size`` keeps its name and meaning.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rlmath.engine.config import VocabParallel
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from rlmath.log_probs import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    log_probs_from_logits_response_rmpad,
    sum_pi_squared_from_logits,
)

__all__ = [
    "vocab_parallel_entropy",
    "vocab_parallel_kl_from_logits",
    "vocab_parallel_log_probs_and_entropy",
    "vocab_parallel_log_probs_and_entropy_from_hidden",
    "vocab_parallel_log_probs_from_logits",
    "vocab_parallel_log_probs_from_logits_response_rmpad",
    "vocab_parallel_sum_pi_squared",
]

_warned: set[str] = set()


def _options(
    name: str, replacement: str, group: Any, vocab_start_index: int | None, **extra: Any
) -> VocabParallel:
    """Warn once for ``name`` and return the :class:`VocabParallel` of the old arguments."""
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"rlmath.distributed.{name} is deprecated and will be removed in the next "
            f"release: call rlmath.{replacement}(..., vocab_parallel=rlmath.VocabParallel("
            "group=group, start=vocab_start_index)) instead (same results)",
            FutureWarning,
            stacklevel=3,
        )
    return VocabParallel(group=group, start=vocab_start_index, **extra)


def vocab_parallel_log_probs_from_logits(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start_index: int | None = None,
    group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Deprecated: :func:`rlmath.log_probs_from_logits` with ``vocab_parallel``."""
    vp = _options(
        "vocab_parallel_log_probs_from_logits", "log_probs_from_logits", group, vocab_start_index
    )
    return log_probs_from_logits(logits_shard, labels, vocab_parallel=vp, **kwargs)


def vocab_parallel_entropy(
    logits_shard: torch.Tensor,
    *,
    vocab_start_index: int | None = None,
    group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Deprecated: :func:`rlmath.entropy_from_logits` with ``vocab_parallel``."""
    vp = _options("vocab_parallel_entropy", "entropy_from_logits", group, vocab_start_index)
    return entropy_from_logits(logits_shard, vocab_parallel=vp, **kwargs)


def vocab_parallel_log_probs_and_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start_index: int | None = None,
    group: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deprecated: :func:`rlmath.log_probs_and_entropy_from_logits` with ``vocab_parallel``."""
    vp = _options(
        "vocab_parallel_log_probs_and_entropy", "log_probs_and_entropy_from_logits", group,
        vocab_start_index,
    )  # fmt: skip
    return log_probs_and_entropy_from_logits(logits_shard, labels, vocab_parallel=vp, **kwargs)


def vocab_parallel_kl_from_logits(
    logits_shard: torch.Tensor,
    ref_logits_shard: torch.Tensor,
    *,
    vocab_start_index: int | None = None,
    group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Deprecated: :func:`rlmath.kl_from_logits` with ``vocab_parallel``."""
    vp = _options("vocab_parallel_kl_from_logits", "kl_from_logits", group, vocab_start_index)
    return kl_from_logits(logits_shard, ref_logits_shard, vocab_parallel=vp, **kwargs)


def vocab_parallel_sum_pi_squared(
    logits_shard: torch.Tensor,
    *,
    vocab_start_index: int | None = None,
    group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Deprecated: :func:`rlmath.sum_pi_squared_from_logits` with ``vocab_parallel``."""
    vp = _options(
        "vocab_parallel_sum_pi_squared", "sum_pi_squared_from_logits", group, vocab_start_index
    )
    return sum_pi_squared_from_logits(logits_shard, vocab_parallel=vp, **kwargs)


def vocab_parallel_log_probs_from_logits_response_rmpad(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_rmpad: torch.Tensor,
    response_length: int,
    *,
    vocab_start_index: int | None = None,
    group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Deprecated: :func:`rlmath.log_probs_from_logits_response_rmpad` with ``vocab_parallel``."""
    vp = _options(
        "vocab_parallel_log_probs_from_logits_response_rmpad",
        "log_probs_from_logits_response_rmpad", group, vocab_start_index,
    )  # fmt: skip
    return log_probs_from_logits_response_rmpad(
        input_ids, attention_mask, logits_rmpad, response_length, vocab_parallel=vp, **kwargs
    )


def vocab_parallel_log_probs_and_entropy_from_hidden(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias_shard: torch.Tensor | None = None,
    vocab_start_index: int | None = None,
    reduce_grad_hidden: bool = True,
    group: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Deprecated: :func:`rlmath.log_probs_and_entropy_from_hidden` with ``vocab_parallel``."""
    vp = _options(
        "vocab_parallel_log_probs_and_entropy_from_hidden", "log_probs_and_entropy_from_hidden",
        group, vocab_start_index, reduce_grad_hidden=reduce_grad_hidden,
    )  # fmt: skip
    return log_probs_and_entropy_from_hidden(
        hidden, weight_shard, labels, bias=bias_shard, vocab_parallel=vp, **kwargs
    )
