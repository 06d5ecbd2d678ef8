"""Distributed rlmath: data-parallel statistics, vocabulary-parallel functions, launching.

Every function takes an explicit ``group`` (default: the world group) and
behaves as a world of one process when torch.distributed is not initialized.
See docs/distributed.md.
"""

from rlmath.distributed import data_parallel, launch, vocab_parallel
from rlmath.distributed.data_parallel import *
from rlmath.distributed.launch import *
from rlmath.distributed.vocab_parallel import *

# verl-style names for the data-parallel statistics (docs/design.md, "Distributed").
distributed_masked_mean = data_parallel.masked_mean
distributed_masked_var = data_parallel.masked_var
distributed_masked_whiten = data_parallel.masked_whiten
distributed_masked_sum = data_parallel.masked_sum

__all__ = [
    "distributed_masked_mean",
    "distributed_masked_sum",
    "distributed_masked_var",
    "distributed_masked_whiten",
]
__all__ += data_parallel.__all__
__all__ += launch.__all__
__all__ += vocab_parallel.__all__
