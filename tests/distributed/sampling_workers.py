"""Worker side of the vocabulary-parallel kept-set tests (``test_vocab_parallel_sampling.py``).

Each case builds the same logits, labels and sampler arguments on every rank
(from a seed), hands the rank its columns, and returns the rank's log-probs,
entropy, kept-set statistics and the gradient of its columns.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import rlmath as R
from rlmath import VocabParallel
from rlmath.engine.torch_backend import kept_shards

IGNORE = -100


@dataclass(frozen=True)
class SamplingCase:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    sampler: str = "vllm"
    vocab: int = 1024  # shards of 512 and 256 columns: on the 128-column tile grid
    rows: int = 40
    dtype: torch.dtype = torch.float32
    temperature: float | str = 0.8  # "rows": one per row
    per_row: tuple[str, ...] = ()  # parameters given one per row
    ties: bool = False  # integer logits: many ties at every threshold
    response: bool = False  # through log_probs_from_logits_response_rmpad
    explicit: bool = False  # shards placed by VocabParallel(start=...), uneven
    blocked: bool = False  # the all-gathers split into blocks of a few rows
    replay: str = ""  # "mask" / "ids": the params' kept set, replayed with kept=


CASES = [
    SamplingCase("top_p", {"top_p": 0.9}),
    SamplingCase("top_p_small", {"top_p": 0.05}),
    SamplingCase("top_k", {"top_k": 50}),
    SamplingCase("top_k_1", {"top_k": 1}),
    SamplingCase("top_k_beyond_a_shard", {"top_k": 700}),
    SamplingCase("min_p", {"min_p": 0.05}),
    SamplingCase("all_three", {"top_k": 200, "top_p": 0.8, "min_p": 0.01}),
    SamplingCase("sglang", {"top_k": 200, "top_p": 0.8, "min_p": 0.01}, sampler="sglang"),
    SamplingCase("hf", {"top_k": 200, "top_p": 0.8, "min_p": 0.01}, sampler="hf"),
    SamplingCase(
        "per_row",
        {"top_k": 100, "top_p": 0.7, "min_p": 0.02},
        per_row=("top_k", "top_p", "min_p"),
        temperature="rows",
    ),
    SamplingCase("ties", {"top_k": 30, "top_p": 0.6}, ties=True),
    SamplingCase("bf16", {"top_p": 0.9, "top_k": 100}, dtype=torch.bfloat16),
    SamplingCase("fp64", {"top_p": 0.9, "min_p": 0.001}, dtype=torch.float64),
    SamplingCase("response_rmpad", {"top_p": 0.85}, response=True),
    SamplingCase("uneven_shards", {"top_k": 60, "top_p": 0.9}, vocab=1000, explicit=True),
    SamplingCase("blocked_gathers", {"top_k": 40, "top_p": 0.8}, blocked=True),
    SamplingCase("replay_mask", {"top_k": 60, "top_p": 0.8}, replay="mask"),
    SamplingCase("replay_ids", {"top_k": 60, "top_p": 0.8}, replay="ids"),
    SamplingCase(
        "replay_ids_uneven", {"top_k": 60, "top_p": 0.8}, replay="ids", vocab=1000, explicit=True
    ),
]
BY_NAME = {c.name: c for c in CASES}


def build(case: SamplingCase) -> dict[str, Any]:
    """The whole problem, the same on every rank (and in the test process)."""
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # the same in every process
    M, V = case.rows, case.vocab
    logits = torch.randn(M, V, generator=g, dtype=torch.float64) * 3
    if case.ties:
        logits = logits.round()
    logits = logits.to(case.dtype)
    # Labels drawn where the mass is (most inside the kept set), a few ignored.
    probs = torch.softmax(logits.double() / 0.8, -1)
    labels = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    labels[::9] = IGNORE
    kwargs: dict[str, Any] = {"sampler": case.sampler}
    for name, value in case.params.items():
        if name in case.per_row:
            scale = torch.rand(M, generator=g, dtype=torch.float64)
            if name == "top_k":
                kwargs[name] = (1 + scale * value).to(torch.int64)
            elif name == "top_p":
                kwargs[name] = 0.3 + scale * (value - 0.3) * 2
                kwargs[name] = kwargs[name].clamp(0.05, 1.0)
            else:
                kwargs[name] = scale * value
        else:
            kwargs[name] = value
    temperature: Any = case.temperature
    if temperature == "rows":
        temperature = 0.5 + torch.rand(M, generator=g, dtype=torch.float64)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(case.dtype if case.dtype != torch.bfloat16 else torch.float32)
    if case.replay:
        # The rollout's kept set, replayed: from the rule in one process, every token a label.
        every = torch.arange(V).expand(M, V)
        rule = R.log_probs_from_logits(
            logits, every, temperature=temperature, kept_stats=True, **kwargs
        )
        mask = ~rule.outside
        if case.replay == "mask":
            kwargs = {"kept": mask}
        else:
            ids = torch.full((M, V), -1)
            for i in range(M):
                row = mask[i].nonzero().flatten()
                ids[i, : row.numel()] = row.flip(0)  # any order, padded with -1
            kwargs = {"kept": ids[:, : int(mask.sum(-1).max())]}
    return {"logits": logits, "labels": labels, "temperature": temperature, "kwargs": kwargs}


def shard_bounds(case: SamplingCase, world: int, rank: int) -> tuple[int, int]:
    """Equal shards, or (``explicit``) uneven ones: rank r holds a share growing with r."""
    if not case.explicit:
        width = case.vocab // world
        return rank * width, (rank + 1) * width
    weights = [k + 1 for k in range(world)]
    edges = [case.vocab * sum(weights[:k]) // sum(weights) for k in range(world + 1)]
    return edges[rank], edges[rank + 1]


def response_problem(case: SamplingCase, logits: torch.Tensor) -> dict[str, Any]:
    """Packed sequences for the response function: the rows of ``logits`` are the packed positions."""
    g = torch.Generator().manual_seed(7)
    B, S = 4, 10
    total = logits.shape[0]
    assert total == B * S
    input_ids = torch.randint(0, case.vocab, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.int64)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "R": 4}


def call(case: SamplingCase, logits: torch.Tensor, problem: dict, vp: VocabParallel | None):
    """The case's function on ``logits`` (the whole vocabulary, or a shard with ``vp``)."""
    extra = {"vocab_parallel": vp} if vp is not None else {}
    kw = problem["kwargs"]
    if case.response:
        rp = response_problem(case, logits)
        return R.log_probs_from_logits_response_rmpad(
            rp["input_ids"], rp["attention_mask"], logits, response_length=rp["R"],
            temperature=problem["temperature"], kept_stats=True, **kw, **extra,
        )  # fmt: skip
    return R.log_probs_and_entropy_from_logits(
        logits, problem["labels"], temperature=problem["temperature"], kept_stats=True,
        **kw, **extra,
    )  # fmt: skip


def loss_of(out) -> torch.Tensor:
    """A loss that weighs every output differently (so a misplaced gradient shows)."""
    lp = out.log_probs
    w = torch.linspace(0.5, 1.5, lp.numel(), dtype=lp.dtype).view(lp.shape)
    loss = (lp * w).sum()
    if out.entropy is not None:
        e = out.entropy
        loss = loss + (e * torch.linspace(-1.0, 1.0, e.numel(), dtype=e.dtype).view(e.shape)).sum()
    return loss


def sampling_worker(names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in names:
        case = BY_NAME[name]
        problem = build(case)
        start, stop = shard_bounds(case, world, rank)
        local = problem["logits"][:, start:stop].clone().requires_grad_(True)
        vp = VocabParallel(start=start) if case.explicit else VocabParallel()
        budget = kept_shards._GATHER_BUDGET
        if case.blocked:
            kept_shards._GATHER_BUDGET = 7 * world * 40  # 7 rows of 40 values per gather
        try:
            res = call(case, local, problem, vp)
        finally:
            kept_shards._GATHER_BUDGET = budget
        loss_of(res).backward()
        out[name] = {
            "log_probs": res.log_probs.detach(),
            "entropy": res.entropy.detach() if res.entropy is not None else None,
            "outside": res.outside,
            "kept_count": res.kept_count,
            "grad": local.grad,
            "start": start,
        }
    return out


# ------------------------------------------------------------------ the fused head

HEAD_CASES = {
    "head_top_p": {"top_p": 0.9},
    "head_all_three_sglang": {"top_k": 100, "top_p": 0.8, "min_p": 0.01, "sampler": "sglang"},
    "head_uneven": {"top_k": 50, "top_p": 0.9},
}
HEAD_ROWS, HEAD_HIDDEN, HEAD_VOCAB = 24, 16, 1000


def head_problem(name: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return {
        "hidden": torch.randn(HEAD_ROWS, HEAD_HIDDEN, generator=g, dtype=torch.float64),
        "weight": torch.randn(HEAD_VOCAB, HEAD_HIDDEN, generator=g, dtype=torch.float64),
        "bias": torch.randn(HEAD_VOCAB, generator=g, dtype=torch.float64),
        "labels": torch.randint(0, HEAD_VOCAB, (HEAD_ROWS,), generator=g),
        "kwargs": dict(HEAD_CASES[name], temperature=0.8, softcap=6.0),
    }


def head_shard(name: str, world: int, rank: int) -> tuple[int, int]:
    case = SamplingCase(name, vocab=HEAD_VOCAB, explicit=name == "head_uneven")
    return shard_bounds(case, world, rank)


def head_sampling_worker(names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name in names:
        pr = head_problem(name)
        start, stop = head_shard(name, world, rank)
        h = pr["hidden"].clone().requires_grad_(True)
        w = pr["weight"][start:stop].clone().requires_grad_(True)
        b = pr["bias"][start:stop].clone().requires_grad_(True)
        vp = VocabParallel(start=start) if name == "head_uneven" else VocabParallel()
        res = R.log_probs_and_entropy_from_hidden(
            h, w, pr["labels"], bias=b, vocab_parallel=vp, kept_stats=True, **pr["kwargs"]
        )
        loss_of(res).backward()
        out[name] = {
            "log_probs": res.log_probs.detach(),
            "entropy": res.entropy.detach(),
            "kept_count": res.kept_count,
            "outside": res.outside,
            "grad_hidden": h.grad,
            "grad_weight": w.grad,
            "grad_bias": b.grad,
        }
    return out


def dead_rows_worker() -> Any:
    """A response function whose packed logits have no row (every position masked)."""
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 6, dtype=torch.long)
    logits = torch.randn(0, 32)
    return R.log_probs_from_logits_response_rmpad(
        ids, mask, logits, response_length=3, top_p=0.8, vocab_parallel=VocabParallel(),
        kept_stats=True,
    )  # fmt: skip
