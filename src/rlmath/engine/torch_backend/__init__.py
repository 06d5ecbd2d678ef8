"""The pure-torch backend: chunked passes built from ordinary torch operations.

Runs on every device and dtype, and is the reference every other backend is
tested against. One module per pass: ``logits_forward``, ``logits_backward``,
``kl_forward``, ``kl_backward``, ``head_forward``, ``head_backward``,
``sum_pi_squared`` and ``kept_shards`` (a sampler's kept set over vocabulary
shards), over the primitives of ``reductions``, ``rows`` and ``buffers``.
"""

from rlmath.engine.backends import Backend, Kernels, register_backend
from rlmath.engine.torch_backend.head_backward import head_grad
from rlmath.engine.torch_backend.head_forward import head_stats, head_tile_nodes
from rlmath.engine.torch_backend.kept_shards import sharded_thresholds
from rlmath.engine.torch_backend.kl_backward import kl_grad
from rlmath.engine.torch_backend.kl_forward import kl_stats
from rlmath.engine.torch_backend.logits_backward import logits_grad
from rlmath.engine.torch_backend.logits_forward import logits_max, logits_stats
from rlmath.engine.torch_backend.sum_pi_squared import pi_squared_stats

__all__ = ["TORCH_BACKEND", "TORCH_KERNELS"]

TORCH_KERNELS = Kernels(
    logits_stats=logits_stats,
    logits_grad=logits_grad,
    kl_stats=kl_stats,
    kl_grad=kl_grad,
    head_stats=head_stats,
    head_tile_nodes=head_tile_nodes,
    head_grad=head_grad,
    pi_squared_stats=pi_squared_stats,
    logits_max=logits_max,
    kept_thresholds=sharded_thresholds,
)

TORCH_BACKEND = Backend(name="torch", kernels=TORCH_KERNELS, priority=-1)

register_backend(TORCH_BACKEND)
