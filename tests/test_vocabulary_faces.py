"""Every vocabulary function has one face: the same arguments in one process and over shards.

One parametrisation (:data:`FACES`, one entry per public vocabulary function,
checked against ``rlmath.log_probs.__all__`` and ``rlmath.fused_head.__all__``
so that a new function fails here until it is added) drives both paths: each
face runs in one process on the whole vocabulary and on two gloo ranks, each
holding half of the columns (``vocab_parallel=VocabParallel(...)``), with the
same keyword arguments (K labels, ``ignore_index``, per-row temperatures,
``vocab_size``, ``logit_scale``, ``softcap``); values and gradients must agree.
A signature check makes sure no argument exists on one path only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rlmath
import rlmath.fused_head
import rlmath.log_probs
from rlmath import VocabParallel
from rlmath.distributed import run_distributed

V, REAL, H = 12, 11, 5  # 12 columns, the last one padding (vocab_size = 11)

#: The arguments every vocabulary function takes, with their defaults.
COMMON = {
    "temperature": 1.0,
    "vocab_size": None,
    "vocab_parallel": None,
    "chunk_size": None,
    "backend": "auto",
    "validate": False,
}


@dataclass(frozen=True)
class Face:
    """One public vocabulary function: how to call it on the whole problem or one shard.

    ``call(columns, width_start, vocab_parallel)`` runs it on the columns
    ``[width_start, width_start + columns.shape[-1])`` of the problem's logits
    (or weight rows) and returns ``(outputs, inputs that get a gradient)``.
    """

    fn: Callable[..., Any]
    labels: bool
    call: Callable[[dict[str, torch.Tensor], int, int, Any], tuple[tuple, tuple]]


def problem() -> dict[str, torch.Tensor]:
    """The shared problem: logits, reference logits, hidden states, a head, labels (K = 2)."""
    g = torch.Generator().manual_seed(0)
    data = {
        "logits": torch.randn(2, 4, V, generator=g, dtype=torch.float64) * 2,
        "ref": torch.randn(2, 4, V, generator=g, dtype=torch.float64),
        "hidden": torch.randn(2, 4, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64),
        "bias": torch.randn(V, generator=g, dtype=torch.float64),
        "labels": torch.randint(0, REAL, (2, 4, 2), generator=g),
        "temperature": torch.rand(2, 1, generator=g, dtype=torch.float64) + 0.5,
        "ids": torch.randint(0, REAL, (2, 5), generator=g),
        "mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool),
        "packed": torch.randn(8, V, generator=g, dtype=torch.float64),
    }
    data["labels"][0, 1, 0] = -100
    data["labels"][1, :, :] = torch.where(data["labels"][1] % 3 == 0, -100, data["labels"][1])
    return data


def _cols(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return x[..., a:b].clone().requires_grad_()


def _logits_face(fn: Callable[..., Any], labels: bool, entropy_too: bool = False) -> Face:
    def call(d, a, b, vp):
        x = _cols(d["logits"], a, b)
        kw = {"temperature": d["temperature"][..., None][:, :, 0], "vocab_size": REAL}
        kw["vocab_parallel"] = vp
        out = fn(x, d["labels"], ignore_index=-100, **kw) if labels else fn(x, **kw)
        return (out if isinstance(out, tuple) else (out,)), (x,)

    return Face(fn, labels, call)


def _kl(d, a, b, vp):
    x, r = _cols(d["logits"], a, b), _cols(d["ref"], a, b)
    out = rlmath.kl_from_logits(x, r, temperature=0.8, vocab_size=REAL, vocab_parallel=vp)
    return (out,), (x, r)


def _sum_pi_squared(d, a, b, vp):
    x = d["logits"][..., a:b]
    out = rlmath.sum_pi_squared_from_logits(x, temperature=0.8, vocab_size=REAL, vocab_parallel=vp)
    return (out,), ()


def _response(d, a, b, vp):
    x = _cols(torch.cat([d["logits"], d["logits"][:, :1]], 1), a, b)  # (2, 5, V)
    out = rlmath.log_probs_from_logits_response(
        d["ids"], x, 3, temperature=0.9, vocab_size=REAL, vocab_parallel=vp
    )
    return (out,), (x,)


def _response_rmpad(d, a, b, vp):
    x = _cols(d["packed"], a, b)
    out = rlmath.log_probs_from_logits_response_rmpad(
        d["ids"], d["mask"], x, 3, temperature=d["temperature"], vocab_size=REAL,
        vocab_parallel=vp,
    )  # fmt: skip
    return (out,), (x,)


def _all_rmpad(d, a, b, vp):
    x = _cols(d["packed"], a, b)
    flat = d["mask"].reshape(-1)
    indices = torch.nonzero(flat).squeeze(1)
    ids_rmpad = d["ids"].reshape(-1)[indices]
    out = rlmath.log_probs_from_logits_all_rmpad(
        ids_rmpad, x, indices, 2, 5, 3, temperature=0.9, vocab_size=REAL, vocab_parallel=vp
    )
    return (out,), (x,)


def _head_kwargs(d: dict[str, torch.Tensor], vp: Any) -> dict[str, Any]:
    return {
        "temperature": d["temperature"], "ignore_index": -100, "logit_scale": 0.7,
        "softcap": 4.0, "vocab_size": REAL, "vocab_parallel": vp, "chunk_size": 3,
        "vocab_chunk_size": 4,
    }  # fmt: skip


def _from_hidden(d, a, b, vp):
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"][a:b].clone().requires_grad_()
    bias = d["bias"][a:b].clone().requires_grad_()
    out = rlmath.log_probs_and_entropy_from_hidden(
        h, w, d["labels"], bias=bias, **_head_kwargs(d, vp)
    )
    return out, (h, w, bias)


def _module(d, a, b, vp):
    head = torch.nn.Linear(H, b - a, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(d["weight"][a:b])
        head.bias.copy_(d["bias"][a:b])
    kw = _head_kwargs(d, vp)
    temperature = kw.pop("temperature")
    module = rlmath.FusedLMHeadLogProbs(head, **kw)
    h = d["hidden"].clone().requires_grad_()
    out = module(h, d["labels"], temperature=temperature)
    return out, (h, head.weight, head.bias)


FACES: dict[str, Face] = {
    "log_probs_from_logits": _logits_face(rlmath.log_probs_from_logits, True),
    "log_probs_and_entropy_from_logits": _logits_face(
        rlmath.log_probs_and_entropy_from_logits, True
    ),
    "entropy_from_logits": _logits_face(rlmath.entropy_from_logits, False),
    "kl_from_logits": Face(rlmath.kl_from_logits, False, _kl),
    "sum_pi_squared_from_logits": Face(rlmath.sum_pi_squared_from_logits, False, _sum_pi_squared),
    "log_probs_from_logits_response": Face(rlmath.log_probs_from_logits_response, False, _response),
    "log_probs_from_logits_response_rmpad": Face(
        rlmath.log_probs_from_logits_response_rmpad, False, _response_rmpad
    ),
    "log_probs_from_logits_all_rmpad": Face(
        rlmath.log_probs_from_logits_all_rmpad, False, _all_rmpad
    ),
    "log_probs_and_entropy_from_hidden": Face(
        rlmath.log_probs_and_entropy_from_hidden, True, _from_hidden
    ),
    "FusedLMHeadLogProbs": Face(rlmath.FusedLMHeadLogProbs, True, _module),
}


def test_every_vocabulary_function_has_a_face():
    public = {
        name
        for module in (rlmath.log_probs, rlmath.fused_head)
        for name in module.__all__
        if name not in ("VocabParallel", "SampledLogProbs")
    }
    assert public == set(FACES), (
        f"add {sorted(public - set(FACES))} to FACES (or drop {sorted(set(FACES) - public)})"
    )


@pytest.mark.parametrize("name", sorted(FACES))
def test_one_signature_for_one_process_and_shards(name):
    face = FACES[name]
    params = inspect.signature(face.fn).parameters
    for arg, default in COMMON.items():
        if name == "FusedLMHeadLogProbs" and arg in ("temperature",):
            continue
        assert arg in params, f"{name} lacks {arg}"
        assert params[arg].kind is inspect.Parameter.KEYWORD_ONLY, (name, arg)
        assert params[arg].default == default, (name, arg, params[arg].default)
    if face.labels:
        assert params["ignore_index"].default == -100, name


def _run(names: list[str], rank: int, world: int) -> dict[str, Any]:
    data = problem()
    width = V // world
    a, b = rank * width, (rank + 1) * width
    vp = VocabParallel(group=dist.group.WORLD) if world > 1 else None
    out = {}
    for name in names:
        outputs, inputs = FACES[name].call(data, a, b, vp)
        values = [o.detach() for o in outputs if o is not None]
        live = [o for o in outputs if o is not None and o.requires_grad]
        grads: list[torch.Tensor] = []
        if live:
            g = torch.Generator().manual_seed(7)
            total = sum((torch.randn(o.shape, generator=g, dtype=o.dtype) * o).sum() for o in live)
            grads = list(torch.autograd.grad(total, inputs))
        out[name] = (values, grads)
    return out


def _tp_worker(names: list[str]) -> dict[str, Any]:
    return _run(names, dist.get_rank(), dist.get_world_size())


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_tp_worker, 2, sorted(FACES))


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(FACES))
def test_two_ranks_equal_one_process(name, two_ranks):
    values, grads = _run([name], 0, 1)[name]
    for rank, result in enumerate(two_ranks):
        got_values, got_grads = result[name]
        for got, want in zip(got_values, values, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
        width = V // 2
        for got, want in zip(got_grads, grads, strict=True):
            if got.shape == want.shape:  # hidden: the whole gradient on every rank
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            else:  # this rank's columns (rows) of the whole gradient
                dim = -1 if got.dim() > 1 and got.shape[-1] != want.shape[-1] else 0
                part = want.narrow(dim, rank * width, width)
                torch.testing.assert_close(got, part, rtol=1e-12, atol=1e-12)
