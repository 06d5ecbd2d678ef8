"""The policy's LM head split over the vocabulary (``rlmath demo --tp K``).

Each rank of a tensor-parallel group holds rows ``[start, start + V/K)`` of
the head's weight. Training never forms logits: the per-token log-probs and
entropies come from ``rlmath.log_probs_and_entropy_from_hidden`` with
``vocab_parallel=rlmath.VocabParallel(group=...)``, which reduces over the
group and returns the full gradient of the hidden states on every rank. Sampling needs whole distributions, so ``forward``
gathers the logit slices of the (few) positions it is given.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import rlmath
from rlmath.demo.config import Truncation
from rlmath.demo.parallel import Layout

__all__ = ["VocabParallelLMHead"]


class VocabParallelLMHead(nn.Module):
    """Rows ``[vocab_start, vocab_start + V/tp)`` of a bias-free LM head, on one rank."""

    def __init__(self, weight_shard: torch.Tensor, *, vocab_size: int, layout: Layout) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_shard)
        self.vocab_size = vocab_size
        self.vocab_start = layout.tp_rank * weight_shard.shape[0]
        self.layout = layout

    @classmethod
    def from_linear(cls, head: nn.Linear, layout: Layout) -> VocabParallelLMHead:
        """This rank's slice of a full ``nn.Linear`` head (``out_features`` = V)."""
        if head.bias is not None:
            raise ValueError("the vocabulary-parallel head takes a bias-free nn.Linear")
        v = head.out_features
        share = v // layout.tp
        start = layout.tp_rank * share
        shard = head.weight.detach()[start : start + share].clone()
        return cls(shard, vocab_size=v, layout=layout)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits ``[..., V]`` of ``hidden`` ``[..., H]`` (for sampling; no gradient)."""
        local = hidden @ self.weight.T
        parts = [torch.empty_like(local) for _ in range(self.layout.tp)]
        dist.all_gather(parts, local.contiguous(), group=self.layout.tp_group)
        return torch.cat(parts, dim=-1)

    def log_probs_and_entropy(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        temperature: float,
        with_entropy: bool,
        truncation: Truncation | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``labels`` ``[N]`` (``-100``: none, gives 0) and entropies, ``[N]`` each.

        ``truncation``: the sampler's ``top_k`` / ``top_p`` / ``min_p``; the kept set
        is the whole vocabulary's, found from every rank's rows of the head.
        """
        return rlmath.log_probs_and_entropy_from_hidden(
            hidden,
            self.weight,
            labels,
            temperature=temperature,
            ignore_index=-100,
            vocab_size=self.vocab_size,
            vocab_parallel=rlmath.VocabParallel(group=self.layout.tp_group, start=self.vocab_start),
            return_entropy=with_entropy,
            **(truncation or {}),
        )
