"""Every public function under ``torch.compile(fullgraph=True)``, static and dynamic shapes.

The matrix is built from the registries and the modules' ``__all__`` when the
tests are collected: every registered policy loss, advantage estimator, KL
estimator and reward shaping, every vocabulary function of
:mod:`rlmath.log_probs` and :mod:`rlmath.fused_head`, the value, entropy and
aggregation losses, :func:`rlmath.compute_rewards` and the masked statistics.
A newly registered function is compiled with no edit here (or, when it needs
inputs no builder knows, fails ``test_every_public_function_has_a_case``).

Each case runs compiled with ``fullgraph=True`` (a graph break is an error)
once with static shapes and once with ``dynamic=True`` (symbolic sizes, as
verl compiles ``entropy_from_logits``), on the ``aot_eager`` backend: the
graph is traced through AOTAutograd, forward and backward, and run with the
eager kernels. Outputs and gradients equal eager mode bitwise: the traced
graph calls the same kernels on the same inputs in the same order.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch

import rlmath as R
import rlmath.fused_head
import rlmath.log_probs
import rlmath.masked
from tests.advantages import conformance as C
from tests.losses.helpers import LOSS_KWARGS, policy_batch

pytestmark = pytest.mark.integration

B, T, V, H = 3, 5, 7, 4


def _flat(out: Any) -> list[torch.Tensor]:
    """The tensors of a result (tuples, dicts, dataclasses, named tuples), in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return _flat([getattr(out, f.name) for f in dataclasses.fields(out)])
    if isinstance(out, dict):
        return _flat([out[k] for k in sorted(out)])
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _vocab_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ref = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[1, 3] = -100
    temp = torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    return x, ref, labels, temp, mask, hidden, weight, bias


Case = tuple[Callable[..., Any], tuple[torch.Tensor, ...]]


def _vocabulary_cases() -> dict[str, Case]:
    x, ref, labels, temp, mask, hidden, weight, bias = _vocab_data()
    packed = x[mask.bool()]
    idx = mask.view(-1).nonzero().squeeze(1)
    head = torch.nn.Linear(H, V, dtype=torch.float64)
    module = R.FusedLMHeadLogProbs(head, temperature=0.9)
    return {
        "log_probs_from_logits": (
            lambda x: R.log_probs_from_logits(x, labels, temperature=temp),
            (x,),
        ),
        "log_probs_from_logits (float temperature, K labels)": (
            lambda x: R.log_probs_from_logits(x, labels.abs()[..., None], temperature=0.7),
            (x,),
        ),
        "log_probs_from_logits (top_k, top_p, min_p per row)": (
            lambda x: R.log_probs_from_logits(
                x, labels, temperature=temp, top_k=5, top_p=0.8, min_p=temp * 0.1
            ),
            (x,),
        ),
        "log_probs_and_entropy_from_logits (replayed kept ids, hf)": (
            lambda x: R.log_probs_and_entropy_from_logits(
                x, labels, kept=torch.arange(4).expand(*labels.shape, 4), sampler="hf"
            ),
            (x,),
        ),
        "entropy_from_logits": (lambda x: R.entropy_from_logits(x), (x,)),
        "entropy_from_logits (float temperature)": (
            lambda x: R.entropy_from_logits(x, temperature=0.7),
            (x,),
        ),
        "log_probs_and_entropy_from_logits": (
            lambda x: R.log_probs_and_entropy_from_logits(x, labels, temperature=temp),
            (x,),
        ),
        "kl_from_logits": (lambda x, r: R.kl_from_logits(x, r, temperature=0.8), (x, ref)),
        "sum_pi_squared_from_logits": (
            lambda x: R.sum_pi_squared_from_logits(x, temperature=temp),
            (x,),
        ),
        "log_probs_from_logits_response": (
            lambda x: R.log_probs_from_logits_response(labels.abs(), x, 3, temperature=temp),
            (x,),
        ),
        "log_probs_from_logits_response_rmpad": (
            lambda p: R.log_probs_from_logits_response_rmpad(labels.abs(), mask, p, 3),
            (packed,),
        ),
        "log_probs_from_logits_all_rmpad": (
            lambda p: R.log_probs_from_logits_all_rmpad(
                labels.abs().view(-1)[idx], p, idx, B, T, 3
            ),
            (packed,),
        ),
        "log_probs_and_entropy_from_hidden": (
            lambda h, w, b: R.log_probs_and_entropy_from_hidden(
                h, w, labels, bias=b, temperature=0.9, chunk_size=4, vocab_chunk_size=4
            ),
            (hidden, weight, bias),
        ),
        "FusedLMHeadLogProbs": (lambda h: module(h, labels), (hidden,)),
    }


def _policy_loss_cases() -> dict[str, Case]:
    old, logp, adv, mask = policy_batch(B, T, 0)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(1), dtype=old.dtype) + 0.5
    cases: dict[str, Case] = {}
    for name in R.list_policy_losses():
        fn = R.get_policy_loss(name)
        kw = dict(LOSS_KWARGS[name])

        def loss(logp, fn=fn, kw=kw):
            return fn(old, logp, adv, mask, rollout_is_weights=weights, **kw)

        cases[f"policy loss {name}"] = (loss, (logp,))
    return cases


def _advantage_cases() -> dict[str, Case]:
    batch = C.make_batch()
    cases: dict[str, Case] = {}
    for name in R.list_advantage_estimators():
        fn = R.get_advantage_estimator(name)
        kwargs = C.build_inputs(fn, batch)
        diff = "token_level_rewards"

        def estimate(x, fn=fn, kwargs=kwargs, diff=diff):
            return fn(**{**kwargs, diff: x})

        cases[f"advantage {name}"] = (estimate, (kwargs[diff],))
    return cases


def _loss_and_statistics_cases() -> dict[str, Case]:
    old, logp, adv, mask = policy_batch(B, T, 2)
    x, *_ = _vocab_data()
    cases: dict[str, Case] = {}
    # Every estimator in one graph (one compilation instead of one per estimator).
    cases["kl_penalty (every estimator)"] = (
        lambda lp: [R.kl_penalty(lp, old, est, response_mask=mask) for est in R.KL_ESTIMATORS],
        (logp,),
    )
    for mode in R.LOSS_AGG_MODES:
        extra: dict[str, Any] = {"norm_length": T}
        if mode == "prompt-mean":
            extra.update(R.prompt_batch_info(mask, torch.arange(B) // 2))
        cases[f"agg_loss {mode}"] = (
            lambda lp, mode=mode, extra=extra: R.agg_loss(lp, mask, loss_agg_mode=mode, **extra),
            (logp,),
        )
    cases["compute_value_loss"] = (
        lambda v: R.compute_value_loss(v, adv, old, mask, cliprange_value=0.2),
        (logp,),
    )
    cases["compute_entropy_loss"] = (
        lambda x: R.compute_entropy_loss(x, mask, temperature=0.9),
        (x,),
    )
    cases["compute_rewards"] = (
        lambda s: R.compute_rewards(s, logp, old, 0.1, estimator="k3", response_mask=mask),
        (adv,),
    )
    for name in rlmath.masked.__all__:
        fn = getattr(R, name)
        cases[name] = (lambda v, fn=fn: fn(v, mask), (adv,))
        if "axis" in inspect.signature(fn).parameters:
            cases[f"{name} axis=-1"] = (lambda v, fn=fn: fn(v, mask, axis=-1), (adv,))
    return cases


def _reward_shaping_cases() -> dict[str, Case]:
    _, _, rewards, mask = policy_batch(B, T, 3)
    truncated = torch.tensor([True, False, True])
    kwargs = {
        "soft_overlong_punishment": {"max_response_length": T, "overlong_buffer_length": 2},
        "overlong_filter": {"truncated": truncated},
        "stop_properly_penalty": {"stop_properly_penalty_coef": 0.5, "truncated": truncated},
    }
    return {
        f"reward shaping {name}": (
            lambda r, name=name: R.get_reward_shaping(name)(r, mask, **kwargs[name]),
            (rewards,),
        )
        for name in R.list_reward_shapings()
    }


CASES: dict[str, Case] = {
    **_vocabulary_cases(),
    **_policy_loss_cases(),
    **_advantage_cases(),
    **_loss_and_statistics_cases(),
    **_reward_shaping_cases(),
}


def test_every_public_function_has_a_case():
    public = [
        *rlmath.log_probs.__all__,
        *rlmath.fused_head.__all__,
        *rlmath.masked.__all__,
        "agg_loss",
        "compute_value_loss",
        "compute_entropy_loss",
        "compute_rewards",
        "kl_penalty",
    ]
    public = [n for n in public if n not in ("VocabParallel", "SampledLogProbs")]
    missing = [n for n in public if not any(c == n or c.startswith(f"{n} ") for c in CASES)]
    missing += [
        f"policy loss {n}" for n in R.list_policy_losses() if f"policy loss {n}" not in CASES
    ]
    missing += [
        f"advantage {n}" for n in R.list_advantage_estimators() if f"advantage {n}" not in CASES
    ]
    missing += [
        f"reward shaping {n}"
        for n in R.list_reward_shapings()
        if f"reward shaping {n}" not in CASES
    ]
    assert not missing, f"no compile case for {missing}"


def _run(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]):
    """Outputs and the gradients of a fixed random cotangent with respect to ``inputs``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    torch.manual_seed(0)  # the same random draws (clip_cov, kl_cov) in both runs
    outs = _flat(fn(*leaves))
    diff = [o for o in outs if o.requires_grad]
    grads: tuple[torch.Tensor | None, ...] = ()
    if diff:
        g = torch.Generator().manual_seed(1)
        cot = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in diff]
        grads = torch.autograd.grad(diff, leaves, cot, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_without_graph_break_and_equals_eager(name, dynamic):
    fn, inputs = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    try:
        got_out, got_grad = _run(compiled, inputs)
    finally:
        torch._dynamo.reset()
    want_out, want_grad = _run(fn, inputs)
    assert len(got_out) == len(want_out) and len(got_grad) == len(want_grad)
    for a, b in zip(got_out + got_grad, want_out + want_grad, strict=True):
        assert (a is None) == (b is None)
        if a is not None:  # bitwise equal (NaN where eager has NaN), same dtype and shape
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
