"""Benchmark: the fused LM head vs ``hidden @ weight.T`` followed by rlmath's log-probs + entropy.

For each ``N×H×V`` shape and dtype it runs forward+backward of label
log-probs and entropies (both outputs used, random upstream gradients; hidden
and weight require grad, no bias) with:

* ``unfused``: :func:`~rlmath.bench.baselines.unfused_head`, the path every
  ratio is measured against (the ``(N, V)`` logits and their gradient exist);
* ``rlmath fused``: :func:`rlmath.fused_head.log_probs_and_entropy_from_hidden`;
* ``verl FusedLinearForPPO`` (``verl.utils.experimental.torch_functional``,
  its default chunk of 512 tokens) when peers are on and it imports;
* for fp32 inputs on a CPU with oneDNN, ``unfused, oneDNN matmuls``:
  :func:`~rlmath.bench.baselines.unfused_head_onednn`, the unfused path with
  its three matmuls in oneDNN instead of torch's BLAS. Where the fused head's
  matmuls run in oneDNN (:mod:`rlmath.engine.torch_backend.cpu_matmul`, named
  in the line above the table), the head's time against this row is the
  cost of the fusion alone, against ``unfused`` that of the fusion and the
  faster library together.

Columns: median forward+backward time over the repeats (the implementations
take turns run by run, in one process, so that load from other processes
hits them alike) and its ratio to ``unfused``; the peak memory of one
forward+backward beyond the inputs, their gradients, the outputs and, for
half-precision weights, one fp32 buffer of the weight's shape, as a share of
the fp32 ``(N, V)`` logits (:func:`rlmath.bench.memory.peak_bytes`, in a
separate untimed run that also warms up); the largest error of the log-probs
and entropies against fp64 math on the first 64 rows (fp64 matmul of the same
input values).

"extra peak MiB" is everything beyond the gradients and the outputs (the
inputs exist before and are not counted); the percentage also leaves out the
fp32 buffer of the weight's shape that the memory bound allows for bf16
weights (for every implementation alike, whether it uses one or not). "extra
peak RSS" is the same quantity as the operating system counts it, the peak
resident set of one forward+backward in a fresh process on a CPU
(:func:`rlmath.bench.memory.peak_rss_bytes`; ``n/a`` elsewhere): allocator
caches and the buffers of the matmul libraries are in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from rlmath.bench import baselines
from rlmath.bench.memory import RssCase, peak_bytes, peak_rss_bytes
from rlmath.bench.setting import (
    Setting,
    check_repeats,
    floating_dtype,
    header,
    interleaved,
    release_memory,
)
from rlmath.bench.tables import fused_header, print_header, print_rows, significant
from rlmath.engine.torch_backend import cpu_matmul
from rlmath.fused_head import log_probs_and_entropy_from_hidden

__all__ = [
    "DEFAULT_REPEATS",
    "FULL_SHAPES",
    "ONEDNN_UNFUSED",
    "QUICK_SHAPES",
    "bench_case",
    "implementations",
    "matmul_library",
    "rss_case",
    "run",
]

Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

FULL_SHAPES: tuple[tuple[int, int, int], ...] = ((8192, 1024, 32000), (4096, 2048, 151936))
QUICK_SHAPES: tuple[tuple[int, int, int], ...] = ((512, 64, 32000), (256, 32, 151936))
DTYPES = ("float32", "bfloat16")
DEFAULT_REPEATS = 5
ERROR_ROWS = 64
#: The name of the row of the unfused path with its matmuls in oneDNN.
ONEDNN_UNFUSED = "unfused, oneDNN matmuls"


def find_peers(enabled: bool) -> dict[str, Impl]:
    """verl's ``FusedLinearForPPO`` where it imports (nothing if not ``enabled``)."""
    if not enabled:
        return {}
    try:  # an optional peer, never a dependency: absent or broken reads the same here
        from verl.utils.experimental.torch_functional import (  # type: ignore[import-not-found]
            FusedLinearForPPO,
        )
    except Exception:
        return {}
    head: Impl = FusedLinearForPPO()  # an nn.Module: (hidden, weight, labels) -> (logp, H)
    return {"verl FusedLinearForPPO": head}


def _rlmath_fused(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lp, ent = log_probs_and_entropy_from_hidden(hidden, weight, labels)
    assert ent is not None  # return_entropy=True, the default
    return lp, ent


def implementations(
    peers: dict[str, Impl], dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> dict[str, Impl]:
    """The implementations of one case, the baseline first.

    :data:`ONEDNN_UNFUSED` is among them for fp32 on a CPU (``device`` ``None``)
    where torch has oneDNN.
    """
    impls: dict[str, Impl] = {"unfused": baselines.unfused_head, "rlmath fused": _rlmath_fused}
    cpu = device is None or device.type == "cpu"
    if cpu and dtype == torch.float32 and cpu_matmul.onednn_available():
        impls[ONEDNN_UNFUSED] = baselines.unfused_head_onednn
    return {**impls, **peers}


def matmul_library(device: torch.device) -> str:
    """Where the fused head's fp32 matmuls run on ``device``, for the line above the table."""
    if device.type != "cpu":
        return "torch"
    onednn = cpu_matmul.uses_onednn(torch.float32, device)
    return "oneDNN" if onednn else "torch's BLAS"


def _forward_backward(
    fn: Impl,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    grads: list[torch.Tensor],
) -> list[torch.Tensor]:
    """One forward+backward; returns what it leaves allocated: outputs and gradients."""
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    lp, ent = fn(h, w, labels)
    torch.autograd.backward([lp, ent], [grads[0].to(lp.dtype), grads[1].to(ent.dtype)])
    return [t for t in (lp.detach(), ent.detach(), h.grad, w.grad) if t is not None]


def _errors(fn: Impl, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> str:
    rows = min(ERROR_ROWS, hidden.shape[0])
    h, lab = hidden[:rows], labels[:rows]
    with torch.no_grad():
        lp, ent = fn(h, weight, lab)
        logp = torch.log_softmax(h.double() @ weight.double().T, -1)
        ref_lp = logp.gather(-1, lab[:, None]).squeeze(-1)
        ref_ent = -(logp.exp() * logp).sum(-1)
    e_lp = float((lp.double() - ref_lp).abs().max())
    e_ent = float((ent.double() - ref_ent).abs().max())
    return f"{e_lp:.1e} / {e_ent:.1e}"


def _inputs(
    n: int, h: int, v: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Hidden states, weight, labels and upstream gradients (seeded: the same in every process)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
    weight = (torch.randn(v, h, generator=g) * h**-0.5 * 2).to(dtype).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    grads = [torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)]
    return hidden, weight, labels, grads


def rss_case(n: int, h: int, v: int, dtype: str, impl: str, peers: bool) -> RssCase:
    """The case of :func:`bench_case` on a CPU for :func:`~rlmath.bench.memory.peak_rss_bytes`."""
    torch_dtype = floating_dtype(dtype)
    hidden, weight, labels, grads = _inputs(n, h, v, torch_dtype, torch.device("cpu"))
    fn = implementations(find_peers(peers), torch_dtype)[impl]
    rows = min(64, n)
    return (
        lambda: _forward_backward(
            fn, hidden[:rows], weight, labels[:rows], [g[:rows] for g in grads]
        ),
        lambda: _forward_backward(fn, hidden, weight, labels, grads),
    )


def _rss_extra(
    setting: Setting, n: int, h: int, v: int, dtype: torch.dtype, impl: str
) -> int | None:
    """:func:`~rlmath.bench.memory.peak_rss_bytes` of one implementation, ``None`` off a CPU."""
    if setting.device.type != "cpu" or not setting.rss:
        return None
    case = {"n": n, "h": h, "v": v, "dtype": str(dtype).replace("torch.", ""), "impl": impl,
            "peers": setting.peers}  # fmt: skip
    # The child runs the head's matmuls where this process does.
    choice = "onednn" if cpu_matmul.uses_onednn(torch.float32, setting.device) else "blas"
    return peak_rss_bytes(
        "rlmath.bench.fused_head",
        case,
        threads=torch.get_num_threads(),
        env={cpu_matmul.ENV_VAR: choice},
    )


def bench_case(
    setting: Setting,
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype,
    repeats: int,
    peers: dict[str, Impl],
) -> list[list[str]]:
    """The rows of one ``N×H×V`` shape and dtype."""
    device = setting.device
    hidden, weight, labels, grads = _inputs(n, h, v, dtype, device)
    impls = implementations(peers, dtype, device)
    peaks = {}
    for name, fn in impls.items():  # also the warm-up
        kept, peak = peak_bytes(
            partial(_forward_backward, fn, hidden, weight, labels, grads), device
        )
        peaks[name] = peak - sum(t.numel() * t.element_size() for t in kept)
        del kept
        release_memory(device)
    rss = {name: _rss_extra(setting, n, h, v, dtype, name) for name in impls}
    runs: dict[str, Callable[[], object]] = {
        name: partial(_forward_backward, fn, hidden, weight, labels, grads)
        for name, fn in impls.items()
    }
    times = interleaved(runs, device, repeats, warmup=False)
    fp32_logits = 4 * n * v
    # The memory bound also leaves out one fp32 buffer of the weight's shape for half weights.
    allowance = 4 * weight.numel() if dtype in (torch.bfloat16, torch.float16) else 0
    scale = 1e3 if device.type == "cuda" else 1.0  # ms on a GPU, s on a CPU
    base = times["unfused"]
    rows = []
    for name, fn in impls.items():
        extra_rss = rss[name]
        rows.append(
            [
                f"{n}×{h}×{v}",
                str(dtype).replace("torch.", ""),
                name,
                significant(times[name] * scale),
                f"{times[name] / base:.2f}",
                f"{peaks[name] / 2**20:.0f}",
                f"{100 * (peaks[name] - allowance) / fp32_logits:.1f}%",
                _mib(extra_rss),
                "n/a"
                if extra_rss is None
                else f"{100 * (extra_rss - allowance) / fp32_logits:.1f}%",
                _errors(fn, hidden, weight, labels),
            ]
        )
    return rows


def _mib(nbytes: int | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.0f}"


def run(
    setting: Setting,
    *,
    quick: bool = False,
    repeats: int | None = None,
    shapes: Sequence[tuple[int, int, int]] | None = None,
    dtypes: Sequence[str] = DTYPES,
) -> None:
    """Print the fused-head table: every shape × dtype (``shapes`` overrides ``quick``)."""
    repeats = check_repeats(DEFAULT_REPEATS if repeats is None else repeats)
    torch_dtypes = [floating_dtype(name) for name in dtypes]
    if shapes is None:
        shapes = QUICK_SHAPES if quick else FULL_SHAPES
    peers = find_peers(setting.peers)
    print("### Fused LM head\n")
    verl = f"verl: {'yes' if peers else 'no'}"
    library = f"the fused head's fp32 matmuls: {matmul_library(setting.device)}"
    print(header(setting, repeats, peers=f"{verl}; {library}") + "\n")
    print_header(fused_header("ms" if setting.device.type == "cuda" else "s"))
    for n, h, v in shapes:
        for dtype in torch_dtypes:
            print_rows(bench_case(setting, n, h, v, dtype, repeats, peers))
            release_memory(setting.device)
