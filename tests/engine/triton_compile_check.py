"""Compile the Triton backend's kernels for NVIDIA GPUs on a machine without one.

Triton's interpreter runs a kernel's Python, not its compilation; this
module lowers each kernel through Triton's real compiler (to PTX and, with
the ``ptxas`` the triton wheel ships, to a cubin) for a GPU architecture
given on the command line, so errors that only the compiler sees (a global
that is not a ``tl.constexpr``, a type mismatch in a loop-carried value, an
unsupported construct) fail on a CPU. Each kernel is compiled with every
compile-time flag off, every flag on, and each flag flipped from all on, in
fp32 and a half-precision dtype, with the argument types the launches use.

Run as ``python -m tests.engine.triton_compile_check [ARCH ...]`` with
``TRITON_INTERPRET`` unset (``ARCH`` e.g. 90 for an H100/H200, 80 for an
A100); it prints one line per kernel and exits 1 if any fails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlmath.engine.triton_backend import (
    head_backward,
    head_forward,
    kl_backward,
    kl_forward,
    logits_backward,
    logits_forward,
    sum_pi_squared,
)

# Pointer and scalar argument types per kernel; "IN" is the input dtype.
_F = "*fp32"
_KERNELS = {
    "logits_stats": (
        logits_forward._logits_stats_kernel,
        dict(X="*IN", OFF="*i64", row_stride="i64", col_stride="i32", n="i32", TEMP=_F,
             inv_t_scalar="fp32", LAB="*i64", K="i32", M_OUT=_F, S_OUT=_F, T_OUT=_F, Z_OUT=_F),
        dict(HAS_OFF=bool, TEMP_MODE=(0, 1, 2), WANT_T=bool, HAS_LABELS=bool),
    ),
    "logits_grad": (
        logits_backward._logits_grad_kernel,
        dict(X="*IN", SRC="*i64", src_stride="i64", col_stride="i32", G="*IN", DST="*i64",
             dst_stride="i64", n_real="i32", n_cols="i32", LSE=_F, ALPHA=_F, BETA=_F, W=_F,
             LAB="*i64", K="i32", SIGN=_F, TEMP=_F, inv_t_scalar="fp32", DEAD="*u8",
             ORDER="*i64", FIRST="*u8", END="*i64"),
        dict(HAS_SRC=bool, HAS_DST=bool, GROUPED=bool, TEMP_MODE=(0, 1, 2), HAS_BETA=bool,
             HAS_W=bool, LOGP_ONLY=bool, HAS_SIGN=bool, HAS_DEAD=bool),
    ),
    "kl_stats": (
        kl_forward._kl_stats_kernel,
        dict(Z="*IN", Z_OFF="*i64", z_stride="i64", z_col="i32", R="*IN", R_OFF="*i64",
             r_stride="i64", r_col="i32", n="i32", TEMP=_F, inv_t_scalar="fp32", KL_OUT=_F,
             LSE_Z=_F, LSE_R=_F),
        dict(Z_HAS_OFF=bool, R_HAS_OFF=bool, TEMP_MODE=(0, 1, 2)),
    ),
    "kl_grad": (
        kl_backward._kl_grad_kernel,
        dict(Z="*IN", Z_OFF="*i64", z_stride="i64", z_col="i32", R="*IN", R_OFF="*i64",
             r_stride="i64", r_col="i32", GZ="*IN", GR="*IN", n_real="i32", n_cols="i32",
             LSE_Z=_F, LSE_R=_F, KL=_F, GRAD=_F, TEMP=_F, inv_t_scalar="fp32"),
        dict(Z_HAS_OFF=bool, R_HAS_OFF=bool, NEED_Z=bool, NEED_R=bool, TEMP_MODE=(0, 1, 2)),
    ),
    "pi_squared": (
        sum_pi_squared._pi_squared_kernel,
        dict(X="*IN", OFF="*i64", row_stride="i64", col_stride="i32", n="i32", TEMP=_F,
             inv_t_scalar="fp32", M_OUT=_F, S_OUT=_F, U_OUT=_F),
        dict(HAS_OFF=bool, TEMP_MODE=(0, 1, 2)),
    ),
    "head_stats": (
        head_forward._head_stats_kernel,
        dict(Z="*IN", width="i32", r0="i64", v0="i32", M_RUN=_F, S_RUN=_F, T_RUN=_F, Z_LAB=_F,
             LAB="*i64", OWN="*u8", K="i32", TEMP=_F, inv_t_scalar="fp32"),
        dict(TEMP_MODE=(0, 1, 2), WANT_T=bool),
    ),
    "head_grad": (
        head_backward._head_grad_kernel,
        dict(G="*IN", width="i32", r0="i64", v0="i32", LSE=_F, ALPHA=_F, BETA=_F, W=_F,
             LAB="*i64", K="i32", TEMP=_F, inv_t_scalar="fp32", LIVE="*u8"),
        dict(TEMP_MODE=(0, 1, 2), HAS_BETA=bool, HAS_W=bool, HAS_LIVE=bool),
    ),
}  # fmt: skip


def _values(kind: object) -> tuple[object, ...]:
    return (False, True) if kind is bool else kind  # type: ignore[return-value]


def configs() -> Iterator[tuple[str, dict[str, object]]]:
    """``(kernel, flags)``: all flags at their first value, at their last, and each flipped."""
    for name, (_, _, flags) in _KERNELS.items():
        lo = {k: _values(v)[0] for k, v in flags.items()}
        hi = {k: _values(v)[-1] for k, v in flags.items()}
        seen = []
        for cfg in (lo, hi, *({**hi, k: _values(v)[0]} for k, v in flags.items())):
            if cfg not in seen:
                seen.append(cfg)
                yield name, cfg


def compile_kernel(name: str, flags: dict[str, object], dtype: str, arch: int) -> None:
    """Compile one kernel for ``sm_{arch}`` (raises on a compilation error)."""
    fn, types, _ = _KERNELS[name]
    params = [p.name for p in fn.params]
    block = 4096 if dtype == "fp32" or name.startswith("kl") else 8192
    consts: dict[str, object] = {**flags, "BLOCK": block}
    if "col_stride" in params:
        consts["col_stride"] = 1  # contiguous rows: Triton specializes a stride of 1
    signature = {p: "constexpr" if p in consts else types[p].replace("IN", dtype) for p in params}
    src = ASTSource(fn, signature, constexprs={(params.index(k),): v for k, v in consts.items()})
    warps = 16 if block >= 8192 else 8
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def main(archs: list[int]) -> int:
    failed = 0
    for arch in archs:
        for name, flags in configs():
            for dtype in ("fp32", "bf16"):
                tag = f"sm_{arch} {name} {dtype} {flags}"
                try:
                    compile_kernel(name, flags, dtype, arch)
                except Exception as exc:
                    failed += 1
                    print(f"FAIL {tag}: {type(exc).__name__}: {exc}", flush=True)
                else:
                    print(f"OK   {tag}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
