"""What a device makes cheap, for the few places where the fastest way differs by device.

Two rules, each asked where the choice is made so that the call shows it:

- :func:`reads_host`: reading tensor data on the host costs nothing on a CPU
  (there is no device to wait for) and is a synchronization on an
  accelerator. Code that can skip work after a host read (a chunk without
  ignored rows, group ids that are already small integers) does so only
  where the read is free, and otherwise takes a path that reads nothing.
- :func:`selects_by_bits`: on a CPU, torch's ``where`` runs element by element
  (it is not vectorized), while integer arithmetic is; multiplying floating
  values read as integers by a 0 / 1 mask gives the same bits
  (:mod:`rlmath._valid_select`). On an accelerator ``where`` is one
  bandwidth-bound kernel already.

The no-host-read tests replace :func:`reads_host` by ``lambda device: False``
to run the accelerator path on a CPU; callers therefore look it up on this
module at the call (``_device.reads_host(...)``), not by importing the name.
"""

from __future__ import annotations

import torch

__all__ = ["reads_host", "selects_by_bits"]


def reads_host(device: torch.device) -> bool:
    """Whether code may read tensor data on the host for ``device``: only a CPU, where it is free."""
    return device.type == "cpu"


def selects_by_bits(device: torch.device) -> bool:
    """Whether ``torch.where(mask, x, 0)`` is faster on ``x``'s bits as integers on ``device`` (a CPU)."""
    return device.type == "cpu"
