"""A guard that makes every Python-level read of tensor data raise (the no-sync tests).

On CPU a host sync cannot be observed, so every way of turning tensor data
into host values (``bool()``, ``int()``, ``float()``, ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero``, boolean-mask indexing)
and every operation whose output shape depends on the data (``unique``,
``unique_consecutive``, ``masked_select``) is made to raise while the guarded
code runs. On CUDA the same calls also run under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import torch

from rlmath import _device


class HostSync(AssertionError):
    pass


_TENSOR_METHODS = [
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "item",
    "tolist",
    "cpu",
    "numpy",
    "nonzero",
    "unique",
    "unique_consecutive",
    "masked_select",
]
_TORCH_FUNCTIONS = ["nonzero", "unique", "unique_consecutive", "masked_select"]


@contextlib.contextmanager
def forbid_host_reads():
    def refuse(name):
        def method(*args, **kwargs):
            raise HostSync(f"{name} reads device data on the host")

        return method

    saved = {n: getattr(torch.Tensor, n) for n in _TENSOR_METHODS}
    saved_torch = {n: getattr(torch, n) for n in _TORCH_FUNCTIONS}
    saved_getitem = torch.Tensor.__getitem__

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise HostSync("boolean-mask indexing has a data-dependent shape")
        return saved_getitem(self, index)

    # The engine reads data on the host only where that costs nothing (a CPU);
    # the guard makes it take the path an accelerator takes.
    saved_reads_host = _device.reads_host
    _device.reads_host = lambda device: False
    try:
        for n in _TENSOR_METHODS:
            setattr(torch.Tensor, n, refuse(f"Tensor.{n}"))
        for n in _TORCH_FUNCTIONS:
            setattr(torch, n, refuse(f"torch.{n}"))
        torch.Tensor.__getitem__ = getitem
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        for n, f in saved_torch.items():
            setattr(torch, n, f)
        torch.Tensor.__getitem__ = saved_getitem
        _device.reads_host = saved_reads_host
