"""``nn.Module`` front end of the fused head, for models that own an ``nn.Linear`` LM head."""

from __future__ import annotations

import torch
from torch import nn

from rlmath._validation import check_optional_int, check_positive_int_or_none, check_temperature
from rlmath.engine.backends import resolve_backend
from rlmath.fused_head.from_hidden import log_probs_and_entropy_from_hidden

__all__ = ["FusedLMHeadLogProbs"]


class FusedLMHeadLogProbs(nn.Module):
    """Log-probs and entropies of an existing LM head, computed from hidden states.

    Holds a *reference* to ``head`` (not registered as a submodule), so adding
    this module to the model that owns the head neither duplicates the head's
    parameters in ``state_dict()`` nor moves them: ``forward`` reads
    ``head.weight`` and ``head.bias`` at call time, so their gradients land on
    the head's own parameters (tied embeddings included).

    Args:
        head: the ``nn.Linear(H, V)`` LM head.
        temperature: default temperature (float > 0) for :meth:`forward`.
        ignore_index: label value of positions to skip (log-prob and entropy 0).
        chunk_size: tokens per block, ``None`` for automatic.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    """

    def __init__(
        self,
        head: nn.Linear,
        *,
        temperature: float = 1.0,
        ignore_index: int | None = -100,
        chunk_size: int | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        if not isinstance(head, nn.Linear):
            raise TypeError(f"head must be an nn.Linear, got {type(head).__name__}")
        _, value = check_temperature(temperature, (), torch.device("cpu"), validate=False)
        self._head = (head,)  # a tuple keeps nn.Module from registering it
        self.temperature = value
        self.ignore_index = check_optional_int("ignore_index", ignore_index)
        self.chunk_size = check_positive_int_or_none("chunk_size", chunk_size)
        resolve_backend(backend, head.weight)
        self.backend = backend

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(log_probs, entropy)`` of ``labels`` under ``softmax(head(hidden) / temperature)``.

        Args:
            hidden: ``(..., H)`` hidden states, the head's dtype.
            labels: ``(...)`` = ``hidden.shape[:-1]`` integer labels.
            temperature: overrides the module's default (float or a tensor
                broadcastable to ``hidden.shape[:-1]``).
            return_entropy: also return the entropy (else ``None``).

        Returns:
            fp32 (fp64 for fp64 inputs) ``(log_probs, entropy)`` of shape
            ``labels.shape``; see :func:`log_probs_and_entropy_from_hidden`.
        """
        head = self.head
        return log_probs_and_entropy_from_hidden(
            hidden,
            head.weight,
            labels,
            bias=head.bias,
            temperature=self.temperature if temperature is None else temperature,
            return_entropy=return_entropy,
            ignore_index=self.ignore_index,
            chunk_size=self.chunk_size,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        out, inp = self.head.weight.shape
        return (
            f"head=Linear({inp}, {out}, bias={self.head.bias is not None}), "
            f"temperature={self.temperature}, ignore_index={self.ignore_index}"
        )
