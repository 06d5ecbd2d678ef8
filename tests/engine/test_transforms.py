"""Every public vocabulary function (and GAE) under torch.compile, torch.export and torch.func.

Compiled with ``fullgraph=True`` (a graph break is an error) and compared with
eager: values and gradients bitwise equal, since the operators are opaque
nodes that run the same eager code. ``torch.func`` transforms are compared
with references written from the math in fp64.
"""

from __future__ import annotations

import pytest
import torch
import torch.func as tf

import rlmath as R
from rlmath.distributed import vocab_parallel as vp
from rlmath.engine import DoubleBackwardError
from rlmath.fused_head import FusedLMHeadLogProbs

B, T, V, H = 2, 5, 11, 4


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, V, generator=g, dtype=dtype) * 2
    ref = torch.randn(B, T, V, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    temp = torch.rand(B, 1, generator=g, dtype=dtype) + 0.5
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype)
    return x, ref, labels, temp, mask, hidden, weight, bias


def _cases():
    """``name -> (function of differentiable inputs, inputs)``."""
    x, ref, labels, temp, mask, hidden, weight, bias = _data()
    ignored = labels.clone()
    ignored[1, 3] = -100
    packed = x[mask.bool()]
    idx = mask.view(-1).nonzero().squeeze(1)
    head = torch.nn.Linear(H, V, dtype=torch.float64)
    module = FusedLMHeadLogProbs(head, temperature=0.9)
    return {
        "log_probs_from_logits": (
            lambda x: R.log_probs_from_logits(x, labels, temperature=temp),
            (x,),
        ),
        "entropy_from_logits": (lambda x: R.entropy_from_logits(x, temperature=0.7), (x,)),
        "log_probs_and_entropy_from_logits": (
            lambda x: R.log_probs_and_entropy_from_logits(x, ignored, ignore_index=-100),
            (x,),
        ),
        "kl_from_logits": (lambda x, r: R.kl_from_logits(x, r, temperature=temp), (x, ref)),
        "log_probs_from_logits_response": (
            lambda x: R.log_probs_from_logits_response(labels, x, 3, temperature=temp),
            (x,),
        ),
        "log_probs_from_logits_response_rmpad": (
            lambda p: R.log_probs_from_logits_response_rmpad(labels, mask, p, 3, temperature=temp),
            (packed,),
        ),
        "log_probs_from_logits_all_rmpad": (
            lambda p: R.log_probs_from_logits_all_rmpad(labels.view(-1)[idx], p, idx, B, T, 3),
            (packed,),
        ),
        "log_probs_and_entropy_from_hidden": (
            lambda h, w, b: R.log_probs_and_entropy_from_hidden(
                h, w, ignored, bias=b, temperature=temp, chunk_size=3, vocab_chunk_size=4
            ),
            (hidden, weight, bias),
        ),
        "FusedLMHeadLogProbs": (lambda h: module(h, labels), (hidden,)),
        "vocab_parallel_log_probs_and_entropy": (
            lambda x: vp.vocab_parallel_log_probs_and_entropy(x, ignored),
            (x,),
        ),
        "vocab_parallel_kl_from_logits": (
            lambda x, r: vp.vocab_parallel_kl_from_logits(x, r),
            (x, ref),
        ),
        "vocab_parallel_log_probs_and_entropy_from_hidden": (
            lambda h, w: vp.vocab_parallel_log_probs_and_entropy_from_hidden(h, w, labels),
            (hidden, weight),
        ),
        "vocab_parallel_log_probs_from_logits_response_rmpad": (
            lambda p: vp.vocab_parallel_log_probs_from_logits_response_rmpad(labels, mask, p, 3),
            (packed,),
        ),
    }


CASES = _cases()


def _outputs(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [o for o in outs if o is not None]


def _run(fn, inputs, seed=1):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    outs = _outputs(fn(*leaves))
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cot, allow_unused=True)
    return [o.detach() for o in outs], grads


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(CASES))
def test_compile_fullgraph_equals_eager(name):
    fn, inputs = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want_out, want_grad = _run(fn, inputs)
    got_out, got_grad = _run(compiled, inputs)
    for a, b in zip(got_out + list(got_grad), want_out + list(want_grad), strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.integration
def test_compile_with_inductor_and_sum_pi_squared():
    x, *_ = _data(torch.float32)
    labels = torch.randint(0, V, (B, T))

    def loss(x):
        lp, ent = R.log_probs_and_entropy_from_logits(x, labels, temperature=0.8)
        return (lp * 2 - ent).sum() + R.sum_pi_squared_from_logits(x).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    loss(a).backward()
    compiled(b).backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6)


@pytest.mark.integration
def test_compile_gae_equals_eager():
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(4, 37, generator=g), torch.randn(4, 37, generator=g)
    m = torch.rand(4, 37, generator=g) > 0.3
    for gamma, lam in ((0.99, 0.95), (1.0, 1.0)):

        def f(r, v, m, gamma=gamma, lam=lam):
            return R.compute_gae_advantage_return(r, v, m, gamma, lam)

        torch._dynamo.reset()
        got = torch.compile(f, fullgraph=True)(r, v, m)
        want = f(r, v, m)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_export():
    x, _, labels, *_ = _data(torch.float32)

    class LogProbs(torch.nn.Module):
        def forward(self, x, labels):
            return R.log_probs_and_entropy_from_logits(x, labels, temperature=0.7)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V)

        def forward(self, h, labels):
            return R.log_probs_and_entropy_from_hidden(h, self.lm_head.weight, labels)

    for module, args in ((LogProbs(), (x, labels)), (Head(), (torch.randn(B, T, H), labels))):
        program = torch.export.export(module, args)
        for a, b in zip(program.module()(*args), module(*args), strict=True):
            assert torch.equal(a, b)
        # The operator, possibly inside a submodule (older torch exports the autograd
        # function as a higher-order op with its own graph).
        codes = [m.code for m in program.graph_module.modules() if hasattr(m, "code")]
        assert any("torch.ops.rlmath" in code for code in codes)


# ---------------------------------------------------------------- torch.func


def _ref_lp_ent(x, labels, t=1.0):
    ls = torch.log_softmax(x / t, -1)
    return ls.gather(-1, labels[..., None]).squeeze(-1), -(ls.exp() * ls).sum(-1)


def _ref_kl(x, r):
    lx, lr = torch.log_softmax(x, -1), torch.log_softmax(r, -1)
    return (lx.exp() * (lx - lr)).sum(-1)


def _func_pairs():
    x, ref, labels, temp, _, hidden, weight, bias = _data()
    lab = labels[0]
    return {
        "log_probs": (
            lambda x: R.log_probs_from_logits(x, lab, temperature=0.7),
            lambda x: _ref_lp_ent(x, lab, 0.7)[0],
            x[0],
        ),
        "entropy": (R.entropy_from_logits, lambda x: _ref_lp_ent(x, lab)[1], x[0]),
        "kl": (lambda x: R.kl_from_logits(x, ref[0]), lambda x: _ref_kl(x, ref[0]), x[0]),
        "fused_head": (
            lambda h: R.log_probs_and_entropy_from_hidden(h, weight, lab, bias=bias)[0],
            lambda h: _ref_lp_ent(h @ weight.T + bias, lab)[0],
            hidden[0],
        ),
    }


FUNC = _func_pairs()


@pytest.mark.parametrize("name", sorted(FUNC))
def test_func_grad_and_jacrev(name):
    ours, ref, x = FUNC[name]
    torch.testing.assert_close(
        tf.grad(lambda x: ours(x).sum())(x), tf.grad(lambda x: ref(x).sum())(x)
    )
    torch.testing.assert_close(tf.jacrev(ours)(x), tf.jacrev(ref)(x))


@pytest.mark.parametrize("name", sorted(FUNC))
def test_func_vmap_over_a_leading_batch_dim(name):
    ours, ref, x = FUNC[name]
    xs = torch.stack([x, x * 0.5 + 1, -x])
    torch.testing.assert_close(tf.vmap(ours)(xs), tf.vmap(ref)(xs))
    # vmap of grad: per-example gradients.
    torch.testing.assert_close(
        tf.vmap(tf.grad(lambda x: ours(x).sum()))(xs), tf.vmap(tf.grad(lambda x: ref(x).sum()))(xs)
    )


def test_func_vmap_with_batched_labels_and_weight():
    x, _, labels, _, _, hidden, weight, _ = _data()
    got = tf.vmap(R.log_probs_from_logits)(x, labels)
    torch.testing.assert_close(got, _ref_lp_ent(x, labels)[0])
    weights = torch.stack([weight, weight.flip(0)])
    got = tf.vmap(lambda h, w, lab: R.log_probs_and_entropy_from_hidden(h, w, lab)[1])(
        hidden, weights, labels
    )
    want = torch.stack([_ref_lp_ent(hidden[i] @ weights[i].T, labels[i])[1] for i in range(B)])
    torch.testing.assert_close(got, want)


def test_vmap_gae_equals_a_loop():
    g = torch.Generator().manual_seed(5)
    r = torch.randn(3, 4, 29, generator=g, dtype=torch.float64)
    v = torch.randn(3, 4, 29, generator=g, dtype=torch.float64)
    m = torch.rand(3, 4, 29, generator=g) > 0.4
    adv, ret = tf.vmap(lambda r, v, m: R.compute_gae_advantage_return(r, v, m, 0.9, 0.8))(r, v, m)
    for i in range(3):
        a, b = R.compute_gae_advantage_return(r[i], v[i], m[i], 0.9, 0.8)
        assert torch.equal(adv[i], a) and torch.equal(ret[i], b)
    # Unbatched values, batched rewards (in_dims None for values).
    adv2, _ = tf.vmap(
        lambda r, m: R.compute_gae_advantage_return(r, v[0], m, 0.9, 0.8), in_dims=(0, 0)
    )(r, m)
    a, _ = R.compute_gae_advantage_return(r[1], v[0], m[1], 0.9, 0.8)
    assert torch.equal(adv2[1], a)


# ---------------------------------------------------------------- double backward


@pytest.mark.parametrize("name", sorted(FUNC))
def test_double_backward_raises_instead_of_a_silent_zero(name):
    ours, _, x = FUNC[name]
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(ours(x).sum(), x, create_graph=True)
    assert g.requires_grad  # the gradient is not silently a constant
    with pytest.raises(DoubleBackwardError, match="first-order gradients only"):
        (g * g).sum().backward()
