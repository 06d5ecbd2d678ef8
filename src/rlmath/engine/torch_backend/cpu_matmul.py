"""The fused head's fp32 CPU matmuls: in oneDNN on x86 CPUs that are not Intel's, else in torch's BLAS.

torch runs an fp32 ``torch.mm`` on a CPU in its BLAS, MKL on x86 builds. MKL
picks its code by the processor's vendor: on Intel processors its AVX-512
kernels, on other x86 processors (AMD's) a generic path. oneDNN, which the
same torch build carries, picks its kernels by the instruction sets the
processor reports, whoever made it. Measured on an AMD EPYC (Zen 5, AVX-512),
one thread, fp32, the fused head's block shapes (512 × 1024 by 1024 × 896 and
the two gradient products): MKL 93–100 GFLOP/s, oneDNN 164–216 GFLOP/s;
``4096×1024 @ 1024×32000`` on both cores 1.58 s in MKL, 0.81 s in oneDNN.

So on an x86 CPU that is not Intel's the head's fp32 matmuls go to oneDNN
(:func:`uses_onednn`), elsewhere to ``torch.mm``. Both compute in fp32 with
fp32 accumulation; they differ in the order of the additions, that is by
rounding. The choice is made from the machine alone (never from a timing),
so a machine always takes the same path and its results stay reproducible.
The environment variable ``RLMATH_CPU_MATMUL`` (``onednn`` or ``blas``)
overrides it for the whole process, read when the process first asks; torch's
own switch ``torch.backends.mkldnn.enabled = False`` keeps the matmuls in
``torch.mm`` while it holds.

oneDNN follows torch's fp32 matmul precision setting
(``torch.backends.mkldnn.matmul.fp32_precision``) as torch's own oneDNN
matmuls do; its default keeps full fp32.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

__all__ = ["ENV_VAR", "PRODUCT_ELEMENTS", "add_mm_", "mm", "onednn_available", "uses_onednn"]

ENV_VAR = "RLMATH_CPU_MATMUL"
"""Environment variable that overrides :func:`uses_onednn`: ``onednn`` or ``blas``."""

_CHOICES = ("onednn", "blas")


@functools.cache
def _onednn_linear() -> object | None:
    """torch's ``mkldnn::_linear_pointwise`` operator (``x @ w.T + b``), or None where absent."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def onednn_available() -> bool:
    """Whether this torch build can run the head's matmuls in oneDNN at all."""
    return _onednn_linear() is not None


def _cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The x86 vendor string of this CPU (``GenuineIntel``, ``AuthenticAMD``, ...), or ``""``.

    Read from Linux's ``cpuinfo``; ``""`` where there is none (another system).
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def _machine_choice() -> bool:
    """Whether this process runs the head's fp32 CPU matmuls in oneDNN (see the module docstring)."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in _CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {_CHOICES} or unset, got {forced!r}")
    if _onednn_linear() is None:
        return False
    if forced:
        return forced == "onednn"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    # MKL's vendor-specific kernels serve Intel processors only; elsewhere oneDNN's
    # ISA-dispatched kernels are the faster of the two (measured above).
    return x86 and torch.backends.mkl.is_available() and _cpu_vendor() not in ("", "GenuineIntel")


def uses_onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the head's matmuls of ``dtype`` on ``device`` run in oneDNN (fp32 on a CPU only)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and _machine_choice()
        and bool(torch.backends.mkldnn.enabled)
    )


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    onednn: bool,
) -> torch.Tensor:
    """``a @ b (+ bias)``: oneDNN's result in a new tensor, or torch's in ``out`` (or a new one).

    Shape: ``(m, k)``, ``(k, n)``, ``bias (n,)`` → ``(m, n)``. ``out`` is the
    buffer the BLAS path writes (and returns); oneDNN allocates its result.
    With ``k = 0`` torch's path runs (oneDNN has no primitive for it).
    """
    if onednn and a.shape[1] > 0:
        return _linear(a, b.T, bias)
    if out is None:
        return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def _linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's ``a @ w.T + bias``, with a row computed alike whatever ``a``'s row count.

    oneDNN takes another kernel for a single row (a matrix-vector product,
    which adds in another order); from two rows on, each row of the product
    has the same bits whatever the rows around it (measured for 2 to 600
    rows). A single row is therefore computed as two.
    """
    linear = _onednn_linear()
    if a.shape[0] == 1:
        return linear(a.expand(2, -1).contiguous(), w, bias, "none", [], "")[:1]  # type: ignore[operator]
    return linear(a, w, bias, "none", [], "")  # type: ignore[operator]


PRODUCT_ELEMENTS = 512 * 1024
"""Most entries of one oneDNN product that :func:`add_mm_` adds (2 MiB in fp32)."""


def add_mm_(
    acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool, onednn: bool
) -> None:
    """``acc = a @ b`` if ``first`` else ``acc += a @ b``, in place.

    Shape: ``acc (m, n)``, ``a (m, k)``, ``b (k, n)``. With torch's BLAS the
    product is added inside the GEMM; with oneDNN it is formed in a new tensor
    and then added, in pieces of rows of at most :data:`PRODUCT_ELEMENTS`
    entries: a product as large as a head's weight tile (the fused head's
    ``grad_weight``, 9.5 MiB for 2432 × 1024) formed whole, once per block
    and worker, made the process's memory grow by that much per worker beyond
    what the head's buffers take (each row of the product is the same sum of
    ``k`` terms however the rows are cut). With ``k = 0`` torch's path runs.
    """
    if not onednn or a.shape[1] == 0:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    w = b.T
    step = max(1, PRODUCT_ELEMENTS // max(1, acc.shape[1]))
    for r0 in range(0, a.shape[0], step):
        product = _linear(a[r0 : r0 + step], w, None)
        if first:
            acc[r0 : r0 + step].copy_(product)
        else:
            acc[r0 : r0 + step].add_(product)
