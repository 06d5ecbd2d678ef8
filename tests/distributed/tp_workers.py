"""Functions run inside spawned ranks by the vocabulary-parallel tests.

Every rank rebuilds the same global problem from its name (a deterministic
generator), keeps its own vocabulary columns, runs the tensor-parallel
functions and a backward pass on a fixed loss, and returns values and its
columns' gradients. The test process rebuilds the same problem and compares
with the single-process rlmath functions on the whole vocabulary.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

import rlmath as R
from rlmath import VocabParallel

IGNORE = -100


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    vocab: int
    batch: tuple[int, ...]
    layout: str  # even | explicit | pad_inf | vocab_size
    temperature: str | float  # "tensor" or a float
    k: int | None = None  # candidate labels per row
    hidden: int = 0  # > 0: fused-head case with this H


CASES = [
    Case("even_f64", torch.float64, 96, (3, 11), "even", "tensor"),
    Case("explicit_f64", torch.float64, 101, (4, 9), "explicit", 0.7),
    Case("explicit_f32", torch.float32, 101, (4, 9), "explicit", "tensor"),
    Case("pad_inf_f64", torch.float64, 101, (29,), "pad_inf", 1.0),
    Case("vocab_size_f32", torch.float32, 101, (29,), "vocab_size", 1.3),
    Case("k3_f64", torch.float64, 67, (2, 10), "explicit", 0.9, k=3),
    Case("gpt2_f64", torch.float64, 50257, (3,), "explicit", 0.8),
    Case("gpt2_padded_f32", torch.float32, 50257, (2,), "vocab_size", 1.0),
    Case("bf16", torch.bfloat16, 96, (5, 7), "even", 1.0),
    Case("head_f64", torch.float64, 101, (3, 8), "explicit", "tensor", hidden=16),
    Case("head_vocab_size_f32", torch.float32, 101, (20,), "vocab_size", 0.7, hidden=12),
    Case("head_even_f32", torch.float32, 96, (2, 9), "even", 1.0, hidden=8),
]


def layout(case: Case, world: int) -> tuple[int, list[tuple[int, int]]]:
    """``(padded vocabulary, [(start, width)] per rank)``."""
    v = case.vocab
    if case.layout == "explicit":
        bounds = [round(r * v / world) for r in range(world + 1)]
        return v, [(bounds[r], bounds[r + 1] - bounds[r]) for r in range(world)]
    padded = v if case.layout == "even" else math.ceil(v / world) * world
    if case.layout == "even":
        assert v % world == 0, (case.name, world)
    width = padded // world
    return padded, [(r * width, width) for r in range(world)]


def tp_kwargs(case: Case, world: int, r: int, group=None) -> dict:
    """The keyword arguments that make a call vocabulary-parallel on rank ``r`` of ``group``."""
    padded, shards = layout(case, world)
    start = shards[r][0] if case.layout == "explicit" else None
    kw: dict = {"vocab_parallel": VocabParallel(group=group, start=start)}
    if case.layout == "vocab_size":
        kw["vocab_size"] = case.vocab
    return kw


def build(case: Case, padded: int) -> dict:
    """The global problem, ``padded`` columns wide (see :func:`layout`)."""
    g = torch.Generator().manual_seed(sum(map(ord, case.name)))
    v, batch = case.vocab, case.batch
    n = math.prod(batch)
    out: dict = {}
    label_shape = (*batch, case.k) if case.k else batch
    labels = torch.randint(0, v, label_shape, generator=g)
    labels[torch.rand(label_shape, generator=g) < 0.2] = IGNORE
    out["labels"] = labels
    if case.temperature == "tensor":
        temp_shape = (*batch[:-1], 1) if len(batch) > 1 else batch
        out["temperature"] = (torch.rand(temp_shape, generator=g, dtype=torch.float64) + 0.5).to(
            torch.float32 if case.dtype != torch.float64 else torch.float64
        )
    else:
        out["temperature"] = case.temperature
    if case.hidden:
        h = case.hidden
        out["hidden"] = torch.randn(*batch, h, generator=g, dtype=torch.float64).to(case.dtype)
        out["weight"] = (torch.randn(padded, h, generator=g, dtype=torch.float64) * 0.7).to(
            case.dtype
        )
        out["bias"] = torch.randn(padded, generator=g, dtype=torch.float64).to(case.dtype)
    else:
        x = torch.randn(*batch, padded, generator=g, dtype=torch.float64) * 3
        ref = x + torch.randn(*batch, padded, generator=g, dtype=torch.float64) * 0.5
        if case.layout == "pad_inf":
            x[..., v:] = float("-inf")
            ref[..., v:] = float("-inf")
            # Row 0 has no finite logit on the first 26 columns (a whole shard at
            # world 4): that shard has no mass there; its label lies elsewhere.
            x[0, :26] = float("-inf")
            ref[0, :26] = float("-inf")
            if labels[0] != IGNORE:
                labels[0] = 60
        out["logits"] = x.to(case.dtype)
        out["ref_logits"] = ref.to(case.dtype)
    out["coef"] = [torch.randn(label_shape if i % 2 == 0 else batch, generator=g) for i in range(6)]
    del n
    return out


def _loss(coef: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (coef.to(y.dtype) * y).sum()


def run_logits_case(case: Case, world: int, r: int, group=None) -> dict:
    """``world``/``r``: size of and rank in the tensor-parallel ``group`` (None: the world)."""
    padded, shards = layout(case, world)
    data = build(case, padded)
    start, width = shards[r]
    kw = tp_kwargs(case, world, r, group)
    x = data["logits"][..., start : start + width].clone()
    ref = data["ref_logits"][..., start : start + width].clone()
    x_before, ref_before = x.clone(), ref.clone()
    temp, labels, coef = data["temperature"], data["labels"], data["coef"]
    leaves = [x.clone().requires_grad_() for _ in range(4)]
    ref_leaf = ref.clone().requires_grad_()
    lp = R.log_probs_from_logits(leaves[0], labels, temperature=temp, **kw)
    ent = R.entropy_from_logits(leaves[1], temperature=temp, **kw)
    lp2, ent2 = R.log_probs_and_entropy_from_logits(leaves[2], labels, temperature=temp, **kw)
    kl = R.kl_from_logits(leaves[3], ref_leaf, temperature=temp, **kw)
    loss = _loss(coef[0], lp) + _loss(coef[1], ent) + _loss(coef[2], lp2) + _loss(coef[3], ent2)
    (loss + _loss(coef[5], kl)).backward()
    res = {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "lp2": lp2.detach(),
        "ent2": ent2.detach(),
        "kl": kl.detach(),
        "grad_lp": leaves[0].grad,
        "grad_ent": leaves[1].grad,
        "grad_lp_ent": leaves[2].grad,
        "grad_kl": leaves[3].grad,
        "grad_kl_ref": ref_leaf.grad,
        "unchanged": torch.equal(x, x_before) and torch.equal(ref, ref_before),
    }
    # The chunk size changes nothing but speed and memory.
    res["lp_chunk3"] = R.log_probs_from_logits(x, labels, temperature=temp, chunk_size=3, **kw)
    res["validated"] = R.log_probs_and_entropy_from_logits(
        x, labels, temperature=temp, validate=True, **kw
    )[0]
    res["sum_pi_sq"] = R.sum_pi_squared_from_logits(x, temperature=temp, **kw)
    return res


def rmpad_problem():
    """Packed logits of 3 sequences: left padding, right padding, interior holes."""
    g = torch.Generator().manual_seed(23)
    b, s, v = 3, 9, 101
    ids = torch.randint(0, v, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, :3] = False
    mask[1, -2:] = False
    mask[2, [0, 5]] = False
    nnz = int(mask.sum())
    logits = torch.randn(nnz, v, generator=g, dtype=torch.float64) * 2
    temperature = torch.rand(b, 1, generator=g, dtype=torch.float64) + 0.5
    coef = torch.randn(b, RMPAD_R, generator=g, dtype=torch.float64)
    return ids, mask, logits, temperature, coef


RMPAD_R = 4


def run_rmpad_case(world: int, r: int) -> dict:
    ids, mask, logits, temperature, coef = rmpad_problem()
    bounds = [round(k * logits.shape[1] / world) for k in range(world + 1)]
    x = logits[:, bounds[r] : bounds[r + 1]].clone().requires_grad_()
    logp = R.log_probs_from_logits_response_rmpad(
        ids, mask, x.unsqueeze(0), RMPAD_R, temperature=temperature,
        vocab_parallel=VocabParallel(start=bounds[r]),
    )  # fmt: skip
    (coef * logp).sum().backward()
    return {"logp": logp.detach(), "grad": x.grad, "bounds": bounds}


def run_head_case(case: Case, world: int, r: int) -> dict:
    padded, shards = layout(case, world)
    data = build(case, padded)
    start, width = shards[r]
    kw = tp_kwargs(case, world, r)
    h = data["hidden"].clone().requires_grad_()
    w = data["weight"][start : start + width].clone().requires_grad_()
    b = data["bias"][start : start + width].clone().requires_grad_()
    labels, coef = data["labels"], data["coef"]
    lp, ent = R.log_probs_and_entropy_from_hidden(
        h,
        w,
        labels,
        bias=b,
        temperature=data["temperature"],
        chunk_size=7,
        vocab_chunk_size=10,
        **kw,
    )
    (_loss(coef[0], lp) + _loss(coef[1], ent)).backward()
    # Without bias and entropy, default chunk and tile sizes, and each rank keeps
    # its own part of grad_hidden (the test sums them).
    h2 = data["hidden"].clone().requires_grad_()
    w2 = data["weight"][start : start + width].clone().requires_grad_()
    own_part = {**kw, "vocab_parallel": replace(kw["vocab_parallel"], reduce_grad_hidden=False)}
    lp_nb, none = R.log_probs_and_entropy_from_hidden(
        h2, w2, labels, temperature=data["temperature"], return_entropy=False, **own_part
    )
    _loss(coef[2], lp_nb).backward()
    return {
        "lp": lp.detach(),
        "ent": ent.detach(),
        "grad_hidden": h.grad,
        "grad_weight": w.grad,
        "grad_bias": b.grad,
        "lp_nb": lp_nb.detach(),
        "ent_none": none is None,
        "grad_hidden_nb": h2.grad,
        "grad_weight_nb": w2.grad,
    }


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def run_validation_checks(world: int, r: int) -> dict:
    """Bad layouts and labels are caught by ``validate=True`` on every rank alike."""
    g = torch.Generator().manual_seed(5)  # the same tokens on every rank
    x = torch.randn(4, 10, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 10 * world, (4,), generator=g)
    shard = VocabParallel()
    out = {
        # Every rank claims column 0: overlapping shards.
        "overlap": _error(
            lambda: R.entropy_from_logits(x, vocab_parallel=VocabParallel(start=0), validate=True)
        ),
        "label_range": _error(
            lambda: R.log_probs_from_logits(
                x, torch.full((4,), 10 * world), vocab_parallel=shard, validate=True
            )
        ),
        "rows": _error(
            lambda: R.entropy_from_logits(x[: 1 + r % 2], vocab_parallel=shard, validate=True)
        ),
        "labels_differ": _error(
            lambda: R.log_probs_from_logits(x, labels + r, vocab_parallel=shard, validate=True)
        ),
        "ok": _error(
            lambda: R.log_probs_from_logits(x, labels, vocab_parallel=shard, validate=True)
        ),
    }
    return out


def tp_worker(case_names: list[str]) -> dict:
    world, r = dist.get_world_size(), dist.get_rank()
    out: dict = {}
    for case in CASES:
        if case.name not in case_names:
            continue
        if case.layout == "even" and case.vocab % world:
            continue
        out[case.name] = (run_head_case if case.hidden else run_logits_case)(case, world, r)
    out["validation"] = run_validation_checks(world, r)
    out["rmpad"] = run_rmpad_case(world, r)
    out["example"] = _example_module().demo(verbose=False)
    if world == 4:
        # TP x DP = 2 x 2: tensor-parallel subgroups {0, 1} and {2, 3}; the default
        # layout (rank in the subgroup · width) and every collective use the subgroup.
        subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        case = next(c for c in CASES if c.name == "pad_inf_f64")
        out["subgroup"] = run_logits_case(case, 2, r % 2, group=subgroups[r // 2])
    return out


def _example_module():
    """``examples/distributed_logprobs.py``, run inside this spawn (no extra process start-up)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "distributed_logprobs.py"
    spec = importlib.util.spec_from_file_location("distributed_logprobs_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
