"""``nn.Module`` front end of the fused head, for models that own an ``nn.Linear`` LM head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlmath._validation import check_optional_int, check_positive_int_or_none, check_temperature
from rlmath.engine import api
from rlmath.engine.backends import resolve_backend
from rlmath.engine.config import VocabParallel
from rlmath.fused_head.from_hidden import log_probs_and_entropy_from_hidden
from rlmath.fused_head.through_module import swapped_forward
from rlmath.log_probs.log_probs import Sampler

__all__ = ["FusedLMHeadLogProbs"]


class FusedLMHeadLogProbs(nn.Module):
    """Log-probs and entropies of an existing LM head, computed from hidden states.

    Holds a *reference* to ``head`` (not registered as a submodule), so adding
    this module to the model that owns the head neither duplicates the head's
    parameters in ``state_dict()`` nor moves them: ``forward`` reads
    ``head.weight`` and ``head.bias`` at call time, so their gradients land on
    the head's own parameters (tied embeddings included).

    ``forward`` runs the fused computation *as the head's own forward*
    (:func:`rlmath.fused_head.through_module.swapped_forward`): the hooks a
    framework put on the head run around it. With FSDP2, a head passed to
    ``fully_shard`` is gathered for the call and in backward, and its
    gradients are reduce-scattered, as for ``head(hidden)``; a head sharded only
    as part of its parent is gathered while the parent's ``forward`` runs, so
    call this module from inside that forward (``rlmath.hf.response_log_probs``
    does the equivalent for a whole ``transformers`` model). Under
    ``torch.compile`` the computation is traced directly, without the swap.

    Args:
        head: the ``nn.Linear(H, V)`` LM head (with ``vocab_parallel``, this rank's
            ``nn.Linear(H, V/tp)`` rows of it).
        temperature: default temperature (float > 0) for :meth:`forward`.
        ignore_index: label value of positions to skip (log-prob and entropy 0).
        logit_scale, softcap, vocab_size, vocab_parallel, chunk_size, vocab_chunk_size: as
            in :func:`~rlmath.fused_head.log_probs_and_entropy_from_hidden`.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check in each call that every label is a token id or
            ``ignore_index`` (a ``ValueError`` naming ``labels``; reads the labels, a
            host sync). Without it a label that is neither gives a NaN log-prob.
    """

    def __init__(
        self,
        head: nn.Linear,
        *,
        temperature: float = 1.0,
        ignore_index: int | None = -100,
        logit_scale: float = 1.0,
        softcap: float | None = None,
        vocab_size: int | None = None,
        vocab_parallel: VocabParallel | None = None,
        chunk_size: int | None = None,
        vocab_chunk_size: int | None = None,
        backend: str = "auto",
        validate: bool = False,
    ):
        super().__init__()
        if not isinstance(head, nn.Linear):
            raise TypeError(f"head must be an nn.Linear, got {type(head).__name__}")
        _, value = check_temperature(temperature, (), torch.device("cpu"), validate=False)
        self._head = (head,)  # a tuple keeps nn.Module from registering it
        self.temperature = value
        self.ignore_index = check_optional_int("ignore_index", ignore_index)
        self.logit_scale = api.positive_float("logit_scale", logit_scale)
        self.softcap = None if softcap is None else api.positive_float("softcap", softcap)
        # Shape-only: the same checks as a call, once here.
        api.resolve_shard(
            head.out_features, vocab_size=vocab_size, vocab_parallel=vocab_parallel,
            name="head.weight",
        )  # fmt: skip
        self.vocab_size = vocab_size
        self.vocab_parallel = vocab_parallel
        self.chunk_size = check_positive_int_or_none("chunk_size", chunk_size)
        self.vocab_chunk_size = check_positive_int_or_none("vocab_chunk_size", vocab_chunk_size)
        resolve_backend(backend, head.weight)
        self.backend = backend
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        self.validate = validate

    @property
    def head(self) -> nn.Linear:
        """The LM head this module reads its weight and bias from."""
        return self._head[0]

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float | torch.Tensor | None = None,
        return_entropy: bool = True,
        top_k: int | torch.Tensor | None = None,
        top_p: float | torch.Tensor | None = None,
        min_p: float | torch.Tensor | None = None,
        sampler: Sampler = "vllm",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs, entropy)`` of ``labels`` under ``softmax(head(hidden) / temperature)``.

        Args:
            hidden: ``(..., H)`` hidden states, the head's dtype.
            labels: ``(...)`` = ``hidden.shape[:-1]`` integer labels, or
                ``hidden.shape[:-1] + (K,)`` for K candidates per row.
            temperature: overrides the module's default (float or a tensor
                broadcastable to ``hidden.shape[:-1]``).
            return_entropy: also return the entropy (else ``None``).
            top_k, top_p, min_p, sampler: under a truncating sampler's kept set,
                renormalised (see :func:`log_probs_and_entropy_from_hidden`).

        Returns:
            fp32 (fp64 for fp64 inputs) ``(log_probs, entropy)`` of shapes
            ``labels.shape`` and ``hidden.shape[:-1]``; see
            :func:`log_probs_and_entropy_from_hidden`.
        """
        kw: dict[str, Any] = {
            "temperature": self.temperature if temperature is None else temperature,
            "return_entropy": return_entropy,
            "ignore_index": self.ignore_index,
            "logit_scale": self.logit_scale,
            "softcap": self.softcap,
            "vocab_size": self.vocab_size,
            "vocab_parallel": self.vocab_parallel,
            "chunk_size": self.chunk_size,
            "vocab_chunk_size": self.vocab_chunk_size,
            "backend": self.backend,
            "validate": self.validate,
        }
        if top_k is not None or top_p is not None or min_p is not None or sampler != "vllm":
            kw.update(top_k=top_k, top_p=top_p, min_p=min_p, sampler=sampler)

        def fused(head: nn.Linear, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return log_probs_and_entropy_from_hidden(h, head.weight, labels, bias=head.bias, **kw)

        if torch.compiler.is_compiling():
            # A compiler traces the computation itself (hooks are its business).
            return fused(self.head, hidden)
        with swapped_forward(self.head, fused):
            out: tuple[torch.Tensor, torch.Tensor | None] = self.head(hidden)
        return out

    def extra_repr(self) -> str:
        out, inp = self.head.weight.shape
        return (
            f"head=Linear({inp}, {out}, bias={self.head.bias is not None}), "
            f"temperature={self.temperature}, ignore_index={self.ignore_index}"
        )
