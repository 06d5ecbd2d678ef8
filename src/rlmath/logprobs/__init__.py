"""Log-probabilities, entropies and the full KL over the vocabulary, in bounded memory.

Every function here chunks over tokens with a custom autograd function: the
logits are upcast to fp32 one chunk at a time, only an fp32 log-sum-exp (and
entropy) per row is saved, and backward recomputes each chunk and writes its
gradient directly into the gradient buffer. See ``docs/logprobs.md``.
"""

from rlmath.logprobs.entropy import entropy_from_logits
from rlmath.logprobs.kl_from_logits import kl_from_logits
from rlmath.logprobs.log_probs import (
    log_probs_and_entropy_from_logits,
    log_probs_from_logits,
    logprobs_from_logits,
)
from rlmath.logprobs.response import (
    log_probs_from_logits_all_rmpad,
    log_probs_from_logits_response,
    log_probs_from_logits_response_rmpad,
)

__all__ = [
    "entropy_from_logits",
    "kl_from_logits",
    "log_probs_and_entropy_from_logits",
    "log_probs_from_logits",
    "log_probs_from_logits_all_rmpad",
    "log_probs_from_logits_response",
    "log_probs_from_logits_response_rmpad",
    "logprobs_from_logits",
]
