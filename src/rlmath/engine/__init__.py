"""rlmath's vocabulary engine: every operation over the vocabulary, once.

Log-probs, entropy, the exact KL, ``Σ π²`` and the fused LM head exist here
once each, for a single process and for a vocabulary split over a process
group alike (a world of one is the single-process case). The public faces
(:mod:`rlmath.log_probs`, :mod:`rlmath.fused_head`, the vocabulary-parallel
functions of :mod:`rlmath.distributed`) validate their arguments and call
:mod:`rlmath.engine.api`. Below it, in layers:

- :mod:`~rlmath.engine.functions`: the autograd functions (one per operation),
- :mod:`~rlmath.engine.ops`: the ``torch.ops.rlmath`` operators they call,
- :mod:`~rlmath.engine.impl`: the operators' bodies (labels, masks,
  temperature, combination over shards, gradient coefficients),
- :mod:`~rlmath.engine.backends`: the kernel sets, chosen by ``backend=``;
  :mod:`~rlmath.engine.torch_backend` is the pure-torch one,
- :mod:`~rlmath.engine.policy`: chunk and tile sizes,
- :mod:`~rlmath.engine.dtensor`: DTensor inputs.

This layer is internal: its names may change between releases.
"""

from rlmath.engine import torch_backend as torch_backend  # registers the "torch" backend
from rlmath.engine.backends import (
    BACKEND_NAMES,
    Backend,
    Kernels,
    available_backends,
    register_backend,
    resolve_backend,
)
from rlmath.engine.config import OpConfig, VocabShard
from rlmath.engine.functions import (
    DoubleBackwardError,
    FusedHeadFunction,
    KLFunction,
    LogProbsEntropyFunction,
)

__all__ = [
    "BACKEND_NAMES",
    "Backend",
    "DoubleBackwardError",
    "FusedHeadFunction",
    "KLFunction",
    "Kernels",
    "LogProbsEntropyFunction",
    "OpConfig",
    "VocabShard",
    "available_backends",
    "register_backend",
    "resolve_backend",
]
