"""The Triton backend: the engine's passes as Triton kernels on CUDA tensors.

Imported on first use by :mod:`rlmath.engine.backends` (``backend="triton"``,
or ``"auto"`` on a CUDA tensor); importing it without the ``triton``
package raises :class:`ImportError`, and the backend is then reported
unavailable with that reason. One module per pass, with the signatures and
results of the pure-torch ones: ``logits_forward``, ``logits_backward``,
``kl_forward``, ``kl_backward``, ``head_forward``, ``head_backward``,
``sum_pi_squared`` and ``tile_sums`` (a vocabulary shard on the tile grid),
over the shared ``row_math`` (jit helpers), ``launch`` (block sizes, rows,
temperatures), ``kept_math`` (a sampler's kept set in
the logits passes; its threshold search is the pure-torch one, run on the
logits' device) and ``head_blocks`` (the head's blocks).

Accepts fp32, bf16 and fp16 tensors on CUDA devices; fp64 inputs are left to
the pure-torch backend (``"auto"`` picks it; ``backend="triton"`` on fp64 is
a ``ValueError``), and a pass whose compute dtype is fp64 (say fp32 logits
with fp64 reference logits) runs the pure-torch pass. With the environment
variable ``TRITON_INTERPRET=1`` set before this module is first imported,
Triton's interpreter runs the same kernels on CPU tensors (slowly; the
tests use it), and the backend accepts fp32 CPU tensors instead of CUDA ones
(the interpreter rounds to bf16 wrongly, so half precision is left to the
pure-torch backend there).
"""

from __future__ import annotations

import os

import torch

from rlmath.engine.backends import Backend, Kernels, register_backend
from rlmath.engine.torch_backend.kept_shards import sharded_thresholds
from rlmath.engine.torch_backend.logits_forward import logits_max

# Before the kernels: raises ImportError (the backend is then unavailable)
# without a usable triton.
from rlmath.engine.triton_backend._requirement import MIN_TRITON
from rlmath.engine.triton_backend.head_backward import head_grad
from rlmath.engine.triton_backend.head_blocks import head_tiles
from rlmath.engine.triton_backend.head_forward import head_stats
from rlmath.engine.triton_backend.kl_backward import kl_grad
from rlmath.engine.triton_backend.kl_forward import kl_stats
from rlmath.engine.triton_backend.logits_backward import logits_grad
from rlmath.engine.triton_backend.logits_forward import logits_stats
from rlmath.engine.triton_backend.sum_pi_squared import pi_squared_stats

__all__ = ["INTERPRETED", "MIN_TRITON", "TRITON_BACKEND", "TRITON_KERNELS", "supports"]

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
"""Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The input dtypes the kernels take (compute in fp32)."""

_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def supports(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor``: fp32/bf16/fp16 on a CUDA device of compute capability
    7.0+ (8.0+ for bf16), or fp32 on the CPU under the interpreter."""
    if tensor.dtype not in DTYPES:
        return False
    if INTERPRETED:
        return tensor.device.type == "cpu" and tensor.dtype == torch.float32
    if tensor.device.type != "cuda":
        return False
    major, minor = _capability(tensor.device)
    return (major, minor) >= ((8, 0) if tensor.dtype == torch.bfloat16 else (7, 0))


TRITON_KERNELS = Kernels(
    logits_stats=logits_stats,
    logits_grad=logits_grad,
    kl_stats=kl_stats,
    kl_grad=kl_grad,
    head_stats=head_stats,
    head_grad=head_grad,
    pi_squared_stats=pi_squared_stats,
    head_tiles=head_tiles,
    logits_max=logits_max,
    kept_thresholds=sharded_thresholds,
)

TRITON_BACKEND = Backend(
    name="triton", kernels=TRITON_KERNELS, supports=supports, priority=10, checked=True
)

register_backend(TRITON_BACKEND)
