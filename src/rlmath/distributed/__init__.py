"""Distributed rlmath: data-parallel statistics, vocabulary-parallel functions, launching.

Every function takes an explicit ``group`` (default: the world group) and
behaves as a world of one process when torch.distributed is not initialized.
See docs/distributed.md.
"""

from rlmath.distributed.data_parallel import (
    distributed_mean_max_min_std,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from rlmath.distributed.launch import (
    init_from_env,
    run_distributed,
)
from rlmath.distributed.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_kl_from_logits,
    vocab_parallel_log_probs_and_entropy,
    vocab_parallel_log_probs_and_entropy_from_hidden,
    vocab_parallel_log_probs_from_logits,
    vocab_parallel_log_probs_from_logits_response_rmpad,
    vocab_parallel_sum_pi_squared,
)

# The names DESIGN.md uses for the data-parallel statistics.
distributed_masked_mean = masked_mean
distributed_masked_var = masked_var
distributed_masked_whiten = masked_whiten
distributed_masked_sum = masked_sum

__all__ = [
    "distributed_masked_mean",
    "distributed_masked_sum",
    "distributed_masked_var",
    "distributed_masked_whiten",
    "distributed_mean_max_min_std",
    "init_from_env",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "run_distributed",
    "vocab_parallel_entropy",
    "vocab_parallel_kl_from_logits",
    "vocab_parallel_log_probs_and_entropy",
    "vocab_parallel_log_probs_and_entropy_from_hidden",
    "vocab_parallel_log_probs_from_logits",
    "vocab_parallel_log_probs_from_logits_response_rmpad",
    "vocab_parallel_sum_pi_squared",
]
