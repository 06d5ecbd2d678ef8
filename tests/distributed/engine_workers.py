"""Worker for the engine's distributed tests: DTensor inputs and the shared autograd functions.

Runs on every rank of a 2-process gloo world; every check compares against the
single-process functions on the full tensors (the same seed on every rank) and
returns numbers or flags for the test to assert on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import rlmath as R
from rlmath.distributed import vocab_parallel as vp

B, T, V, H = 2, 3, 13, 4  # V = 13: uneven shards (7 + 6) for two ranks
IGNORE = -100


def problem() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 2] = IGNORE
    return {
        "logits": torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2,
        "ref": torch.randn(B, T, V, generator=g, dtype=torch.float64),
        "labels": labels,
        "temp": torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5,
        "hidden": torch.randn(B, T, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64),
        "bias": torch.randn(V, generator=g, dtype=torch.float64),
        "c1": torch.randn(B, T, generator=g, dtype=torch.float64),
        "c2": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def _local(x: Any) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _full(x: Any) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _max_diff(a: Any, b: torch.Tensor) -> float:
    return float((_full(a) - b).abs().max())


def single_logits(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = p["logits"].clone().requires_grad_()
    r = p["ref"].clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(
        x, p["labels"], temperature=p["temp"], ignore_index=IGNORE
    )
    kl = R.kl_from_logits(x, r, temperature=p["temp"])
    ((lp * p["c1"]).sum() + (ent * p["c2"]).sum() + kl.sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "kl": kl.detach(), "gx": x.grad, "gr": r.grad}


def dtensor_logits(p: dict[str, torch.Tensor], placement: Any, ref_plain: bool) -> dict[str, Any]:
    """The same computation on DTensors placed by ``placement``; differences to one process."""
    mesh = init_device_mesh("cpu", (2,))
    want = single_logits(p)
    x = distribute_tensor(p["logits"], mesh, [placement]).requires_grad_()
    r = p["ref"].clone() if ref_plain else distribute_tensor(p["ref"], mesh, [placement])
    r.requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_logits(
        x, p["labels"], temperature=p["temp"], ignore_index=IGNORE
    )
    kl = R.kl_from_logits(x, r, temperature=p["temp"])
    out_placements = [tuple(y.placements) for y in (lp, ent, kl)]
    # Each rank's loss over its local results (replicated results: every rank the same).
    c1, c2 = p["c1"], p["c2"]
    if isinstance(placement, Shard) and placement.dim == 0:
        rank = torch.distributed.get_rank()
        c1, c2 = c1.chunk(2)[rank], c2.chunk(2)[rank]
    loss = (_local(lp) * c1).sum() + (_local(ent) * c2).sum() + _local(kl).sum()
    loss.backward()
    gr = r.grad
    return {
        "is_dtensor": all(isinstance(y, DTensor) for y in (lp, ent, kl)),
        "placements": [[repr(q) for q in pl] for pl in out_placements],
        "lp": _max_diff(lp, want["lp"]),
        "ent": _max_diff(ent, want["ent"]),
        "kl": _max_diff(kl, want["kl"]),
        "gx": _max_diff(x.grad, want["gx"]),
        "gx_placement": [repr(q) for q in x.grad.placements],
        # A plain reference tensor gets this rank's share of the gradient: summed
        # over the ranks it is the single-process gradient (checked by the test).
        "gr_local": _local(gr),
        "gr_dtensor": isinstance(gr, DTensor),
        "gr": _max_diff(gr, want["gr"]) if isinstance(gr, DTensor) else None,
    }


def _kept_run(p: dict[str, torch.Tensor], x: Any, how: str) -> tuple[Any, Any]:
    """A sampler's kept set (``how``: per-row top-p with top-k, or replayed ids) on ``x``."""
    g = torch.Generator().manual_seed(11)
    top_p = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5 + 0.4
    ids = torch.randint(0, V, (B, T, 4), generator=g)
    kw: dict[str, Any] = (
        {"top_k": 6, "top_p": top_p, "min_p": 0.01} if how == "rule" else {"kept": ids}
    )
    return R.log_probs_and_entropy_from_logits(
        x, p["labels"], temperature=p["temp"], ignore_index=IGNORE, kept_stats=True, **kw
    ), top_p


def dtensor_kept(p: dict[str, torch.Tensor], placement: Any, how: str) -> dict[str, Any]:
    """A sampler's kept set on DTensor logits against the full tensor (per-row ``top_p`` and a
    replayed ``kept`` given as plain global tensors, cut by rlmath like the temperature)."""
    mesh = init_device_mesh("cpu", (2,))
    full = p["logits"].clone().requires_grad_()
    want, _ = _kept_run(p, full, how)
    ((want.log_probs * p["c1"]).sum() + (want.entropy * p["c2"]).sum()).backward()
    x = distribute_tensor(p["logits"], mesh, [placement]).requires_grad_()
    got, _ = _kept_run(p, x, how)
    c1, c2 = p["c1"], p["c2"]
    if isinstance(placement, Shard) and placement.dim == 0:
        rank = torch.distributed.get_rank()
        c1, c2 = c1.chunk(2)[rank], c2.chunk(2)[rank]
    ((_local(got.log_probs) * c1).sum() + (_local(got.entropy) * c2).sum()).backward()
    return {
        "is_dtensor": all(isinstance(y, DTensor) for y in got),
        "lp": _max_diff(got.log_probs, want.log_probs.detach()),
        "ent": _max_diff(got.entropy, want.entropy.detach()),
        "gx": _max_diff(x.grad, full.grad),
        "outside": bool(torch.equal(_full(got.outside), want.outside)),
        "count": bool(torch.equal(_full(got.kept_count), want.kept_count)),
        "some_cut": bool((want.kept_count < V).any()),
    }


def single_head(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    h = p["hidden"].clone().requires_grad_()
    w, b = p["weight"].clone().requires_grad_(), p["bias"].clone().requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_hidden(
        h, w, p["labels"], bias=b, temperature=p["temp"], chunk_size=2, vocab_chunk_size=3
    )
    ((lp * p["c1"]).sum() + (ent * p["c2"]).sum()).backward()
    return {"lp": lp.detach(), "ent": ent.detach(), "gh": h.grad, "gw": w.grad, "gb": b.grad}


def dtensor_head(p: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Weight ``Shard(0)`` (the vocabulary), hidden ``Replicate()``: a vocabulary-parallel head."""
    mesh = init_device_mesh("cpu", (2,))
    want = single_head(p)
    h = distribute_tensor(p["hidden"], mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(p["weight"], mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(p["bias"], mesh, [Shard(0)]).requires_grad_()
    lp, ent = R.log_probs_and_entropy_from_hidden(
        h, w, p["labels"], bias=b, temperature=p["temp"], chunk_size=2, vocab_chunk_size=3
    )
    ((_local(lp) * p["c1"]).sum() + (_local(ent) * p["c2"]).sum()).backward()
    out = {
        "lp": _max_diff(lp, want["lp"]),
        "ent": _max_diff(ent, want["ent"]),
        "gh": _max_diff(h.grad, want["gh"]),
        "gw": _max_diff(w.grad, want["gw"]),
        "gb": _max_diff(b.grad, want["gb"]),
    }
    try:
        R.log_probs_and_entropy_from_hidden(p["hidden"], w, p["labels"])
        out["plain_hidden_error"] = ""
    except TypeError as e:
        out["plain_hidden_error"] = str(e)
    return out


def dtensor_kept_errors(p: dict[str, torch.Tensor]) -> dict[str, str]:
    """The messages of bad sampler arguments with DTensor logits (empty: nothing raised)."""
    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(p["logits"], mesh, [Shard(-1)])
    top_p = torch.full((B, T), 0.9, dtype=torch.float64)
    cases = {
        # A per-row parameter sharded where the logits' rows are not.
        "placement": dict(top_p=distribute_tensor(top_p, mesh, [Shard(0)])),
        "shape": dict(top_p=torch.full((B, T + 1), 0.9, dtype=torch.float64)),
        "range": dict(top_p=1.5),
        "kept_shape": dict(kept=torch.zeros(B, T + 1, 3, dtype=torch.long)),
    }
    out = {}
    for name, kw in cases.items():
        try:
            R.log_probs_from_logits(x, p["labels"].clamp_min(0), **kw)
            out[name] = ""
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def dtensor_head_kept(p: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The fused head under a sampler's kept set with a vocabulary-sharded DTensor weight."""
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(12)
    top_p = torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5 + 0.4
    kw: dict[str, Any] = dict(temperature=p["temp"], top_k=6, top_p=top_p, kept_stats=True)
    h, w, b = (p[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    want = R.log_probs_and_entropy_from_hidden(h, w, p["labels"], bias=b, **kw)
    ((want.log_probs * p["c1"]).sum() + (want.entropy * p["c2"]).sum()).backward()
    hd = distribute_tensor(p["hidden"], mesh, [Replicate()]).requires_grad_()
    wd = distribute_tensor(p["weight"], mesh, [Shard(0)]).requires_grad_()
    bd = distribute_tensor(p["bias"], mesh, [Shard(0)]).requires_grad_()
    got = R.log_probs_and_entropy_from_hidden(hd, wd, p["labels"], bias=bd, **kw)
    ((_local(got.log_probs) * p["c1"]).sum() + (_local(got.entropy) * p["c2"]).sum()).backward()
    return {
        "is_dtensor": all(isinstance(y, DTensor) for y in got),
        "lp": _max_diff(got.log_probs, want.log_probs.detach()),
        "ent": _max_diff(got.entropy, want.entropy.detach()),
        "gh": _max_diff(hd.grad, h.grad),
        "gw": _max_diff(wd.grad, w.grad),
        "gb": _max_diff(bd.grad, b.grad),
        "outside": bool(torch.equal(_full(got.outside), want.outside)),
        "count": bool(torch.equal(_full(got.kept_count), want.kept_count)),
        "some_cut": bool((want.kept_count < V).any()),
    }


def partial_error(p: dict[str, torch.Tensor]) -> str:
    mesh = init_device_mesh("cpu", (2,))
    x = DTensor.from_local(p["logits"] / 2, mesh, [Partial()], run_check=False)
    try:
        R.log_probs_from_logits(x, p["labels"].clamp_min(0))
    except TypeError as e:
        return str(e)
    return ""


def _function_nodes(y: torch.Tensor) -> set[str]:
    """Names of the custom autograd nodes reachable from ``y``'s grad_fn."""
    seen, stack, names = set(), [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name.endswith("FunctionBackward"):
            names.add(name)
        stack.extend(n for n, _ in node.next_functions)
    return names


def same_functions(p: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The autograd node behind each single-process and vocabulary-parallel result."""
    rank = torch.distributed.get_rank()
    lo, hi = (0, 7) if rank == 0 else (7, V)
    x = p["logits"].clone().requires_grad_()
    shard = p["logits"][..., lo:hi].clone().requires_grad_()
    ref_shard = p["ref"][..., lo:hi].clone()
    labels = p["labels"]
    pairs = {
        "log_probs": (
            R.log_probs_from_logits(x, labels.clamp_min(0)),
            vp.vocab_parallel_log_probs_from_logits(shard, labels, vocab_start_index=lo),
        ),
        "entropy": (
            R.entropy_from_logits(x),
            vp.vocab_parallel_entropy(shard, vocab_start_index=lo),
        ),
        "kl": (
            R.kl_from_logits(x, p["ref"]),
            vp.vocab_parallel_kl_from_logits(shard, ref_shard, vocab_start_index=lo),
        ),
        "fused_head": (
            R.log_probs_and_entropy_from_hidden(
                p["hidden"].clone().requires_grad_(), p["weight"], labels
            )[0],
            vp.vocab_parallel_log_probs_and_entropy_from_hidden(
                p["hidden"].clone().requires_grad_(),
                p["weight"][lo:hi],
                labels,
                vocab_start_index=lo,
            )[0],
        ),
    }
    return {
        k: (sorted(_function_nodes(a)), sorted(_function_nodes(b))) for k, (a, b) in pairs.items()
    }


def ignored_rows_temperature(p: dict[str, torch.Tensor]) -> dict[str, bool]:
    """A zero or NaN temperature on ignored rows reaches no vocabulary-parallel gradient."""
    rank = torch.distributed.get_rank()
    lo, hi = (0, 7) if rank == 0 else (7, V)
    labels = p["labels"]
    out = {}
    for bad in (0.0, float("nan")):
        temp = p["temp"].expand(B, T).clone()
        temp[labels == IGNORE] = bad
        shard = p["logits"][..., lo:hi].clone().requires_grad_()
        lp, ent = vp.vocab_parallel_log_probs_and_entropy(
            shard, labels, temperature=temp, vocab_start_index=lo
        )
        (lp.sum() + ent.sum()).backward()
        h = p["hidden"].clone().requires_grad_()
        w = p["weight"][lo:hi].clone().requires_grad_()
        b = p["bias"][lo:hi].clone().requires_grad_()
        lp2, ent2 = vp.vocab_parallel_log_probs_and_entropy_from_hidden(
            h, w, labels, bias_shard=b, temperature=temp, vocab_start_index=lo
        )
        (lp2.sum() + ent2.sum()).backward()
        grads = [shard.grad, h.grad, w.grad, b.grad]
        out[str(bad)] = all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    return out


def worker() -> dict[str, Any]:
    p = problem()
    out = {
        "shard_vocab": dtensor_logits(p, Shard(-1), ref_plain=False),
        "shard_vocab_plain_ref": dtensor_logits(p, Shard(-1), ref_plain=True),
        "replicate": dtensor_logits(p, Replicate(), ref_plain=False),
        "shard_rows": dtensor_logits(p, Shard(0), ref_plain=False),
        "head": dtensor_head(p),
        "kept_shard_vocab": dtensor_kept(p, Shard(-1), "rule"),
        "kept_shard_vocab_ids": dtensor_kept(p, Shard(-1), "ids"),
        "kept_shard_rows": dtensor_kept(p, Shard(0), "rule"),
        "kept_head": dtensor_head_kept(p),
        "kept_errors": dtensor_kept_errors(p),
        "partial_error": partial_error(p),
        "same_functions": same_functions(p),
        "ignored_rows_temperature": ignored_rows_temperature(p),
    }
    # Every rank leaves together: DTensor's collectives are complete on both sides
    # before the launcher tears the process group down.
    torch.distributed.barrier()
    return out
