"""Distributed rlmath: launching, and logging statistics over a data-parallel group.

The math itself takes its process group as an argument: the masked statistics
and the advantage estimators ``group=`` (data parallelism), the vocabulary
functions ``vocab_parallel=rlmath.VocabParallel(group=...)`` (a vocabulary
split over ranks). Every function behaves as a world of one process when
torch.distributed is not initialized. See docs/distributed.md.
"""

from rlmath.distributed import data_parallel, launch, vocab_parallel
from rlmath.distributed.data_parallel import *
from rlmath.distributed.launch import *
from rlmath.distributed.vocab_parallel import *

__all__: list[str] = []
__all__ += data_parallel.__all__
__all__ += launch.__all__
__all__ += vocab_parallel.__all__
