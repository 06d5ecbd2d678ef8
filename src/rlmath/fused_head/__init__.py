"""Fused LM head: label log-probs and entropies from hidden states, never materializing the logits.

:func:`log_probs_and_entropy_from_hidden` equals ``hidden @ weight.T (+ bias)``
followed by :func:`rlmath.log_probs_and_entropy_from_logits`, computed block by
block by :mod:`rlmath.engine` and recomputed in backward,
so the ``(N, V)`` logits and their gradient never exist. See ``docs/fused_head.md``.
"""

from rlmath.fused_head.from_hidden import log_probs_and_entropy_from_hidden
from rlmath.fused_head.module import FusedLMHeadLogProbs

__all__ = ["FusedLMHeadLogProbs", "log_probs_and_entropy_from_hidden"]
