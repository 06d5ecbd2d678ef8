"""Log-probabilities, entropies, the full KL and ``Σ π²`` over the vocabulary, in bounded memory.

Every function here is a thin face of :mod:`rlmath.engine`: it chunks over
tokens (the logits are upcast to fp32 one chunk at a time, only an fp32
log-sum-exp and entropy per row is saved, and backward recomputes each chunk
and writes its gradient directly into the gradient buffer), takes
``backend=`` to choose the implementation, accepts DTensors, and runs over a
vocabulary split over processes when given ``vocab_parallel=``
(:class:`VocabParallel`). See ``docs/log_probs.md``.
"""

from rlmath.log_probs.entropy import entropy_from_logits
from rlmath.log_probs.kl_from_logits import kl_from_logits
from rlmath.log_probs.log_probs import (
    SampledLogProbs,
    VocabParallel,
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
)
from rlmath.log_probs.response import (
    log_probs_from_logits_all_rmpad,
    log_probs_from_logits_response,
    log_probs_from_logits_response_rmpad,
)
from rlmath.log_probs.sum_pi_squared import sum_pi_squared_from_logits

__all__ = [
    "SampledLogProbs",
    "VocabParallel",
    "entropy_from_logits",
    "kl_from_logits",
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
    "log_probs_from_logits_all_rmpad",
    "log_probs_from_logits_response",
    "log_probs_from_logits_response_rmpad",
    "sum_pi_squared_from_logits",
]
