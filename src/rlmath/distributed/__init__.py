"""Distributed rlmath: data-parallel statistics and process launching.

Every function takes an explicit ``group`` (default: the world group) and
behaves as a world of one process when torch.distributed is not initialized.
"""

from rlmath.distributed import data_parallel, launch
from rlmath.distributed.data_parallel import *
from rlmath.distributed.launch import *

# The names DESIGN.md uses for the data-parallel statistics.
distributed_masked_mean = data_parallel.masked_mean
distributed_masked_var = data_parallel.masked_var
distributed_masked_whiten = data_parallel.masked_whiten
distributed_masked_sum = data_parallel.masked_sum

__all__ = [
    *data_parallel.__all__,
    *launch.__all__,
    "distributed_masked_mean",
    "distributed_masked_sum",
    "distributed_masked_var",
    "distributed_masked_whiten",
]
