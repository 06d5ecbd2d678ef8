"""``rlmath bench small``: one call of each public function at verl's micro-batch shapes.

A training step calls the losses, the KL estimators, the aggregation and the
advantage estimators once per micro-batch on ``(B, T)`` tensors, and the
vocabulary functions on a micro-batch's logits: calls small enough that the
Python and launch overhead around the torch operations decides their time.
Each row times one such call of rlmath against

* verl's formula written as straightforward torch code
  (:mod:`rlmath.bench.verl_formulas`), the code a verl user runs;
* verl's own function, where ``import verl`` works and peers are on;
* the naive code: the fewest torch operations computing the quantity (the
  ``_naive_*`` functions here), no masking of NaN, no checks.

Inputs: ``(B, T) = (8, 1024)`` fp32 tokens for the losses and estimators
(the trained input requiring grad, as in a training step), ``(8, V)`` logits
for the vocabulary functions with ``V`` = 32000 (Llama 2) and 151936 (Qwen 2)
in bf16 and fp32; the full ``(B·T, V)`` logits are the ``logprobs`` area's.
Each timed run makes enough calls to take about 5 ms; the table gives the
median per call of interleaved runs and the peak RSS of one call in a fresh
process (:func:`rlmath.bench.memory.peak_rss_bytes`). Times are forward
calls (the losses build their autograd graph); ``× verl formula`` is
rlmath's time over the verl formula's in the same run. verl has no exact KL
over the vocabulary, hence no verl column for ``kl_from_logits``; the verl
formula of a policy loss returns its metrics as tensors (verl calls
``.item()`` on each, a host sync on a GPU).

A second table gives, for the calls over logits, each implementation's
largest absolute error against the fp64 value of the same inputs
(:func:`accuracy_case`): a time is comparable only with the accuracy it
buys (verl's formulas run ``log_softmax`` and ``softmax`` in the logits'
dtype, so on bf16 logits their outputs have bf16's 8 significant bits).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import rlmath as R
from rlmath.bench import verl_formulas as vf
from rlmath.bench.memory import RssCase, peak_rss_bytes
from rlmath.bench.setting import (
    Setting,
    check_repeats,
    elapsed,
    header,
    interleaved,
    release_memory,
)
from rlmath.bench.tables import print_header, print_rows, significant

__all__ = [
    "ACCURACY_HEADER",
    "CASES",
    "SMALL_HEADER",
    "accuracy_case",
    "case_calls",
    "rss_case",
    "run",
]

DEFAULT_REPEATS = 15
B, T = 8, 1024
#: The rows of a whole training batch (groups of :data:`GROUP` responses per prompt).
BATCH, GROUP = 512, 8
VOCABS = (32000, 151936)
#: Seconds one timed run should last: enough calls to average out the clock.
RUN_SECONDS = 5e-3

SMALL_HEADER = [
    "function",
    "input",
    "dtype",
    "rlmath µs",
    "verl formula µs",
    "verl µs",
    "naive µs",
    "× verl formula",
    "× verl",
    "× naive",
    "rlmath peak RSS MiB",
    "verl formula peak RSS MiB",
]

#: The accuracy table: the largest error of each implementation's outputs against fp64.
ACCURACY_HEADER = ["outputs of", "input", "dtype", "rlmath", "verl formula", "verl", "naive"]

Call = Callable[[], object]

# ----------------------------------------------------------------------------- inputs


def _tokens(device: torch.device, seed: int = 0, rows: int = B) -> dict[str, torch.Tensor]:
    """``(rows, T)`` fp32 inputs of the losses: log-probs, advantages, a ragged mask, values."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (rows,), generator=g)
    mask = torch.arange(T).expand(rows, T) < lengths[:, None]
    old = -torch.rand(rows, T, generator=g) * 3
    out = {
        "old": old,
        "logp": old + torch.randn(rows, T, generator=g) * 0.1,
        "ref": old + torch.randn(rows, T, generator=g) * 0.1,
        "adv": torch.randn(rows, T, generator=g),
        "mask": mask,
        "fmask": mask.float(),
        "values": torch.randn(rows, T, generator=g),
        "returns": torch.randn(rows, T, generator=g),
        "vpreds": torch.randn(rows, T, generator=g),
        "rewards": torch.randn(rows, T, generator=g) * 0.1,
    }
    out = {k: v.to(device) for k, v in out.items()}
    # The trained inputs require grad, as in a training step.
    out["logp"].requires_grad_()
    out["vpreds"].requires_grad_()
    return out


def _logits(
    v: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": (torch.randn(B, v, generator=g) * 2).to(dtype).to(device).requires_grad_(),
        "r": (torch.randn(B, v, generator=g) * 2).to(dtype).to(device),
        "labels": torch.randint(0, v, (B,), generator=g).to(device),
        "mask": torch.ones(1, B, dtype=torch.bool, device=device),
    }


# ----------------------------------------------------------------------------- naive code


def _naive_logp(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), -1).gather(-1, labels[:, None]).squeeze(-1)


def _naive_entropy(x: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(x.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def _naive_kl(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    lz, lr = torch.log_softmax(x.float(), -1), torch.log_softmax(r.float(), -1)
    return (lz.exp() * (lz - lr)).sum(-1)


def _naive_agg(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    m = mask.float()
    if mode == "token-mean":
        return (loss * m).sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return ((loss * m).sum(-1) / m.sum(-1)).mean()
    if mode == "seq-mean-token-sum":
        return (loss * m).sum(-1).mean()
    return (loss * m).sum(-1).mean() / loss.shape[-1]


def _naive_ppo(old: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor):
    ratio = torch.exp(logp - old)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    m = mask.float()
    return (loss * m).sum() / m.sum()


def _naive_value(vpreds, returns, values, mask):  # type: ignore[no-untyped-def]
    clipped = torch.clamp(vpreds, values - 0.5, values + 0.5)
    loss = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    m = mask.float()
    return 0.5 * (loss * m).sum() / m.sum()


def _naive_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.float()
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


# ----------------------------------------------------------------------------- cases

VOCAB_FUNCTIONS = (
    "log_probs_from_logits",
    "log_probs_and_entropy_from_logits",
    "entropy_from_logits",
    "kl_from_logits",
)
#: The one logits case per vocabulary function of ``--quick``.
QUICK_LOGITS = (f"({B}, {VOCABS[0]})", "bfloat16")

#: ``(function, input, dtype)`` of every row, in the table's order.
CASES: list[tuple[str, str, str]] = [
    *[
        (fn, f"({B}, {v})", dt)
        for fn in VOCAB_FUNCTIONS
        for v in VOCABS
        for dt in ("bfloat16", "float32")
    ],
    *[
        (f"agg_loss {mode}", f"({B}, {T})", "float32")
        for mode in (
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum",
            "seq-mean-token-sum-norm",
        )
    ],
    ("policy loss vanilla", f"({B}, {T})", "float32"),
    ("compute_value_loss", f"({B}, {T})", "float32"),
    ("compute_entropy_loss", f"(1, {B}, {VOCABS[0]})", "bfloat16"),
    ("kl_penalty k1", f"({B}, {T})", "float32"),
    ("kl_penalty k3", f"({B}, {T})", "float32"),
    ("kl_penalty k3+", f"({B}, {T})", "float32"),
    ("compute_gae_advantage_return", f"({B}, {T})", "float32"),
    ("compute_grpo_outcome_advantage", f"({B}, {T})", "float32"),
    # verl computes the outcome advantages once per step, on the whole batch.
    ("compute_grpo_outcome_advantage", f"({BATCH}, {T})", "float32"),
    ("masked_mean", f"({B}, {T})", "float32"),
    ("masked_whiten", f"({B}, {T})", "float32"),
]


def _vocab_calls(
    function: str, v: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Call | None]:
    d = _logits(v, dtype, device)
    x, r, labels = d["x"], d["r"], d["labels"]
    if function == "log_probs_from_logits":
        return {
            "rlmath": partial(R.log_probs_from_logits, x, labels),
            "verl formula": partial(vf.logprobs_from_logits, x, labels),
            "naive": partial(_naive_logp, x, labels),
        }
    if function == "log_probs_and_entropy_from_logits":
        return {
            "rlmath": partial(R.log_probs_and_entropy_from_logits, x, labels),
            "verl formula": lambda: (
                vf.logprobs_from_logits(x, labels),
                vf.entropy_from_logits(x),
            ),
            "naive": lambda: (_naive_logp(x, labels), _naive_entropy(x)),
        }
    if function == "entropy_from_logits":
        return {
            "rlmath": partial(R.entropy_from_logits, x),
            "verl formula": partial(vf.entropy_from_logits, x),
            "naive": partial(_naive_entropy, x),
        }
    # verl has no exact KL over the vocabulary ("full" raises there).
    return {
        "rlmath": partial(R.kl_from_logits, x, r),
        "verl formula": None,
        "naive": partial(_naive_kl, x, r),
    }


def _token_calls(
    function: str, verl: dict[str, Callable[..., Any]], device: torch.device, rows: int = B
) -> dict[str, Call | None]:
    d = _tokens(device, rows=rows)
    old, logp, ref, adv = d["old"], d["logp"], d["ref"], d["adv"]
    mask, fmask, values, returns, vpreds = (d[k] for k in ("mask", "fmask", "values", "returns", "vpreds"))  # fmt: skip
    calls: dict[str, Call | None] = {}
    if function.startswith("agg_loss "):
        mode = function.removeprefix("agg_loss ")
        extra = {"norm_length": T} if mode == "seq-mean-token-sum-norm" else {}
        calls["rlmath"] = partial(R.agg_loss, logp, mask, loss_agg_mode=mode, **extra)  # type: ignore[arg-type]
        calls["verl formula"] = partial(vf.agg_loss, logp, fmask, mode)
        if "agg_loss" in verl:
            calls["verl"] = partial(verl["agg_loss"], logp, fmask, mode)
        calls["naive"] = partial(_naive_agg, logp, mask, mode)
    elif function == "policy loss vanilla":
        calls["rlmath"] = partial(R.compute_policy_loss_vanilla, old, logp, adv, mask)
        calls["verl formula"] = partial(vf.compute_policy_loss_vanilla, old, logp, adv, fmask)
        calls["naive"] = partial(_naive_ppo, old, logp, adv, mask)
    elif function == "compute_value_loss":
        calls["rlmath"] = partial(
            R.compute_value_loss, vpreds, returns, values, mask, cliprange_value=0.5
        )
        calls["verl formula"] = partial(vf.compute_value_loss, vpreds, returns, values, fmask, 0.5)
        if "compute_value_loss" in verl:
            calls["verl"] = partial(verl["compute_value_loss"], vpreds, returns, values, fmask, 0.5)
        calls["naive"] = partial(_naive_value, vpreds, returns, values, mask)
    elif function == "compute_entropy_loss":
        lg = _logits(VOCABS[0], torch.bfloat16, device)
        x3, m3 = lg["x"][None], lg["mask"]
        calls["rlmath"] = partial(R.compute_entropy_loss, x3, m3)
        calls["verl formula"] = partial(vf.compute_entropy_loss, x3, m3.float())
        if "compute_entropy_loss" in verl:
            calls["verl"] = partial(verl["compute_entropy_loss"], x3, m3.float())
        calls["naive"] = lambda: _naive_entropy(x3[0]).mean()
    elif function.startswith("kl_penalty "):
        est = function.removeprefix("kl_penalty ")
        calls["rlmath"] = partial(R.kl_penalty, logp, ref, est)
        calls["verl formula"] = partial(vf.kl_penalty, logp, ref, est)
        if "kl_penalty" in verl:
            calls["verl"] = partial(verl["kl_penalty"], logp, ref, est)
        if est == "k1":
            calls["naive"] = lambda: logp - ref
        else:
            calls["naive"] = lambda: torch.expm1(ref - logp) - (ref - logp)
    elif function == "compute_gae_advantage_return":
        rw = d["rewards"]
        calls["rlmath"] = partial(R.compute_gae_advantage_return, rw, values, mask, 1.0, 0.95)
        calls["verl formula"] = partial(vf.compute_gae_advantage_return, rw, values, fmask, 1.0, 0.95)  # fmt: skip
        if "compute_gae_advantage_return" in verl:
            calls["verl"] = partial(verl["compute_gae_advantage_return"], rw, values, fmask, 1.0, 0.95)  # fmt: skip
        calls["naive"] = None
    elif function == "compute_grpo_outcome_advantage":
        # 0/1 outcome rewards on each response's last valid token; groups of 4 in a
        # micro-batch, of 8 in the batch.
        rw = torch.zeros(rows, T, device=device)
        last = mask.sum(-1) - 1
        rows_at = torch.arange(rows, device=device)
        rw[rows_at, last] = (rows_at % 2).float()
        size = 4 if rows == B else GROUP
        index = [str(i // size) for i in range(rows)]
        calls["rlmath"] = partial(R.compute_grpo_outcome_advantage, rw, mask, index)
        calls["verl formula"] = partial(vf.compute_grpo_outcome_advantage, rw, fmask, index)
        if "compute_grpo_outcome_advantage" in verl:
            import numpy as np

            ids = np.array(index, dtype=object)
            calls["verl"] = partial(verl["compute_grpo_outcome_advantage"], rw, fmask, ids)

        def grpo_naive() -> torch.Tensor:
            s = rw.sum(-1).view(-1, size)
            a = (s - s.mean(-1, keepdim=True)) / (s.std(-1, keepdim=True) + 1e-6)
            return a.view(-1, 1) * fmask

        calls["naive"] = grpo_naive
    elif function == "masked_mean":
        calls["rlmath"] = partial(R.masked_mean, values, mask)
        calls["verl formula"] = partial(vf.masked_mean, values, fmask)
        if "masked_mean" in verl:
            calls["verl"] = partial(verl["masked_mean"], values, fmask)
        calls["naive"] = lambda: (values * fmask).sum() / fmask.sum()
    elif function == "masked_whiten":
        calls["rlmath"] = partial(R.masked_whiten, values, mask)
        calls["verl formula"] = partial(vf.masked_whiten, values, fmask)
        if "masked_whiten" in verl:
            calls["verl"] = partial(verl["masked_whiten"], values, fmask)
        calls["naive"] = partial(_naive_whiten, values, mask)
    else:
        raise ValueError(f"unknown function {function!r}")
    return calls


def case_calls(
    function: str, shape: str, dtype: str, *, peers: bool, device: str | torch.device = "cpu"
) -> dict[str, Call | None]:
    """The calls of one row: ``rlmath``, ``verl formula``, ``verl`` (if found), ``naive``."""
    dev = torch.device(device)
    verl = vf.find_verl() if peers else {}
    if function in VOCAB_FUNCTIONS:
        v = int(shape.strip("()").split(",")[1])
        calls = _vocab_calls(function, v, getattr(torch, dtype), dev)
        real = {"log_probs_from_logits": "logprobs_from_logits",
                "entropy_from_logits": "entropy_from_logits"}.get(function)  # fmt: skip
        if real in verl:
            d = _logits(v, getattr(torch, dtype), dev)
            args = (d["x"], d["labels"]) if real == "logprobs_from_logits" else (d["x"],)
            calls["verl"] = partial(verl[real], *args)
        return calls
    return _token_calls(function, verl, dev, rows=int(shape.strip("()").split(",")[0]))


def rss_case(function: str, shape: str, dtype: str, impl: str, peers: bool) -> RssCase:
    """One call of ``impl`` for :func:`~rlmath.bench.memory.peak_rss_bytes`."""
    fn = case_calls(function, shape, dtype, peers=peers)[impl]
    assert fn is not None

    def call() -> list[torch.Tensor]:
        fn()
        return []

    return fn, call


def _per_call(fn: Call, device: torch.device) -> Call:
    """``fn`` repeated enough times for one run to take about :data:`RUN_SECONDS`."""
    fn()
    once = statistics.median(elapsed(fn, device) for _ in range(3))
    n = max(1, min(1000, int(RUN_SECONDS / max(once, 1e-7))))

    def run() -> None:
        for _ in range(n):
            fn()

    run.calls = n  # type: ignore[attr-defined]
    return run


def bench_case(
    setting: Setting, function: str, shape: str, dtype: str, repeats: int, *, rss: bool = True
) -> list[str]:
    """The row of one function: µs per call of each implementation, ratios, peak RSS."""
    calls = case_calls(function, shape, dtype, peers=setting.peers, device=setting.device)
    runs = {name: _per_call(fn, setting.device) for name, fn in calls.items() if fn is not None}
    times = interleaved(runs, setting.device, repeats)
    us = {name: 1e6 * times[name] / runs[name].calls for name in runs}  # type: ignore[attr-defined]

    def cell(name: str) -> str:
        return significant(us[name]) if name in us else "n/a"

    def ratio(name: str) -> str:
        return f"{us['rlmath'] / us[name]:.2f}" if name in us else "n/a"

    peak: dict[str, str] = {}
    for name in ("rlmath", "verl formula"):
        value = None
        if name in us and setting.device.type == "cpu" and setting.rss and rss:
            case = {"function": function, "shape": shape, "dtype": dtype, "impl": name,
                    "peers": setting.peers}  # fmt: skip
            value = peak_rss_bytes("rlmath.bench.small", case, threads=torch.get_num_threads())
        # The resident set may shrink during a call that frees memory: 0, not negative.
        peak[name] = "n/a" if value is None else f"{max(value, 0) / 2**20:.1f}"
    return [
        function, shape, dtype,
        cell("rlmath"), cell("verl formula"), cell("verl"), cell("naive"),
        ratio("verl formula"), ratio("verl"), ratio("naive"),
        peak["rlmath"], peak["verl formula"],
    ]  # fmt: skip


# ----------------------------------------------------------------------------- accuracy


def _reference(function: str, d: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The outputs of ``function`` on ``d``'s inputs, from the definitions in fp64."""
    x = d["x"].detach().double()
    ls = torch.log_softmax(x, -1)
    logp = ls.gather(-1, d["labels"][:, None]).squeeze(-1)
    entropy = -(ls.exp() * ls).sum(-1)
    if function == "log_probs_from_logits":
        return [logp]
    if function == "log_probs_and_entropy_from_logits":
        return [logp, entropy]
    if function == "entropy_from_logits":
        return [entropy]
    if function == "compute_entropy_loss":  # every token of the one sequence counts
        return [entropy.mean()]
    lr = torch.log_softmax(d["r"].double(), -1)
    return [(ls.exp() * (ls - lr)).sum(-1)]


def _error(out: object, want: list[torch.Tensor]) -> float:
    # A tuple's tensors (a loss's metrics dict is not an output compared here).
    items = out if isinstance(out, tuple) else (out,)
    got = [o for o in items if isinstance(o, torch.Tensor)]
    return max(float((g.detach().double() - w).abs().max()) for g, w in zip(got, want, strict=True))


def accuracy_case(
    function: str, shape: str, dtype: str, *, peers: bool, device: str | torch.device = "cpu"
) -> list[str]:
    """The accuracy row of one vocabulary call: each implementation's largest absolute error
    against the fp64 value of the same inputs (``n/a`` where it has no such call)."""
    dev = torch.device(device)
    calls = case_calls(function, shape, dtype, peers=peers, device=dev)
    v = int(shape.strip("()").split(",")[-1])
    want = _reference(function, _logits(v, getattr(torch, dtype), dev))
    cells = []
    for name in ACCURACY_HEADER[3:]:
        fn = calls.get(name)
        cells.append("n/a" if fn is None else f"{_error(fn(), want):.1e}")
    return [function, shape, dtype, *cells]


def run(
    setting: Setting,
    *,
    quick: bool = False,
    repeats: int | None = None,
    functions: list[str] | None = None,
) -> None:
    """Print the small-call table.

    ``quick``: the vocabulary functions on bf16 logits of the 32000-token
    vocabulary only, and no peak RSS (a fresh process per implementation and row).
    ``functions``: only these rows (names of the first column).
    """
    repeats = check_repeats(DEFAULT_REPEATS if repeats is None else repeats)
    cases = CASES
    if quick:
        cases = [c for c in CASES if c[0] not in VOCAB_FUNCTIONS or c[1:] == QUICK_LOGITS]
    if functions is not None:
        cases = [c for c in cases if c[0] in functions]
    found = "yes" if setting.peers and vf.find_verl() else "no"
    print("### Small calls at verl's micro-batch shapes\n")
    print(header(setting, repeats, peers=f"verl: {found}") + "\n")
    print_header(SMALL_HEADER)
    for function, shape, dtype in cases:
        print_rows([bench_case(setting, function, shape, dtype, repeats, rss=not quick)])
        release_memory(setting.device)
    vocab = [c for c in cases if c[0] in (*VOCAB_FUNCTIONS, "compute_entropy_loss")]
    if vocab:
        print(
            "\nLargest absolute error of the same calls' outputs (log-probs, entropy, KL) "
            "against their fp64 values on the same inputs:\n"
        )
        print_header(ACCURACY_HEADER)
        for function, shape, dtype in vocab:
            print_rows([accuracy_case(function, shape, dtype, peers=setting.peers,
                                      device=setting.device)])  # fmt: skip
