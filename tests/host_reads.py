"""A guard that makes every Python-level host read of tensor data raise (for no-sync tests).

On CPU a host sync cannot be observed, so every way of turning tensor data
into host values (``bool()``, ``int()``, ``float()``, ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, ``nonzero``, boolean-mask indexing)
is made to raise while the guarded code runs. On CUDA the tests also run under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["HostSync", "forbid_host_reads"]


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_reads():
    def refuse(name):
        def method(*args, **kwargs):
            raise HostSync(f"Tensor.{name} reads device data on the host")

        return method

    names = [
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "item",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
    ]
    saved = {n: getattr(torch.Tensor, n) for n in names}
    saved_getitem = torch.Tensor.__getitem__
    saved_nonzero = torch.nonzero

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise HostSync("boolean-mask indexing has a data-dependent shape")
        return saved_getitem(self, index)

    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        torch.Tensor.__getitem__ = getitem
        torch.nonzero = refuse("nonzero")
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.Tensor.__getitem__ = saved_getitem
        torch.nonzero = saved_nonzero
