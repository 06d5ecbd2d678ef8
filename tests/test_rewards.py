"""compute_rewards against a per-token fp64 reference, with masks and every estimator."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import KL_ESTIMATORS, compute_rewards


def ref_kl(name, old, ref):
    """Per-token KL value from its definition, d = old − ref (k3 clamped at 10 like verl)."""
    d = old - ref
    base = name.rstrip("+")
    if base in ("k1", "kl"):
        return d
    if base == "abs":
        return abs(d)
    if base in ("k2", "mse"):
        return 0.5 * d * d
    x = max(min(-d, 20.0), -20.0)
    return min(math.expm1(x) - x, 10.0)


def ref_rewards(scores, old, ref, coef, name="k1", mask=None):
    out = []
    for i in range(len(scores)):
        row = []
        for t in range(len(scores[i])):
            if mask is not None and not mask[i][t]:
                row.append(0.0)
            else:
                row.append(scores[i][t] - coef * ref_kl(name, old[i][t], ref[i][t]))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def case(seed, shape=(3, 8), p=0.7):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape, generator=g, dtype=torch.float64)
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    ref = old + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(shape, generator=g) < p
    return scores, old, ref, mask


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_matches_reference_fp64(name):
    scores, old, ref, mask = case(0)
    expected = ref_rewards(scores.tolist(), old.tolist(), ref.tolist(), 0.05, name, mask.tolist())
    out = compute_rewards(scores, old, ref, 0.05, estimator=name, response_mask=mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)


def test_default_is_verl_formula_without_mask():
    scores, old, ref, _ = case(1)
    out = compute_rewards(scores, old, ref, 0.2)
    expected = ref_rewards(scores.tolist(), old.tolist(), ref.tolist(), 0.2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)


def test_tensor_coefficient_broadcasts():
    scores, old, ref, mask = case(2)
    coefs = torch.tensor([[0.0], [0.1], [1.0]], dtype=torch.float64)
    out = compute_rewards(scores, old, ref, coefs, response_mask=mask)
    for i, c in enumerate([0.0, 0.1, 1.0]):
        row = compute_rewards(
            scores[i : i + 1], old[i : i + 1], ref[i : i + 1], c, response_mask=mask[i : i + 1]
        )
        torch.testing.assert_close(out[i : i + 1], row)
    assert (
        compute_rewards(scores.float(), old.float(), ref.float(), torch.tensor(0.1)).dtype
        == torch.float32
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["k1", "k3", "k2+"])
def test_low_precision_inputs_against_fp64(dtype, name):
    scores, old, ref, mask = (t.to(dtype) if t.is_floating_point() else t for t in case(3))
    out = compute_rewards(scores, old, ref, 0.1, estimator=name, response_mask=mask)
    assert out.dtype == torch.float32
    expected = ref_rewards(
        scores.double().tolist(),
        old.double().tolist(),
        ref.double().tolist(),
        0.1,
        name,
        mask.tolist(),
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


masked_fill = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 100.0])


@given(
    fill=masked_fill,
    seed=st.integers(0, 2**16),
    name=st.sampled_from(sorted(KL_ESTIMATORS)),
    mask_dtype=st.sampled_from([torch.bool, torch.int64, torch.float32]),
)
def test_values_under_mask_never_change_outputs_or_gradients(fill, seed, name, mask_dtype):
    scores, old, ref, mask = case(seed)

    def run(tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = compute_rewards(*leaves, 0.3, estimator=name, response_mask=mask.to(mask_dtype))
        grads = torch.autograd.grad((out * out).sum(), leaves)
        return out, grads

    clean_out, clean_grads = run([scores, old, ref])
    dirty = [torch.where(mask, t, torch.full_like(t, fill)) for t in (scores, old, ref)]
    out, grads = run(dirty)
    assert torch.equal(out, clean_out)
    assert (out[~mask] == 0).all()
    for a, b in zip(grads, clean_grads):
        assert torch.equal(a, b)
        assert (a[~mask] == 0).all()


def test_inputs_not_modified_and_nan_on_valid_position_propagates():
    scores, old, ref, mask = case(4)
    copies = [t.clone() for t in (scores, old, ref, mask)]
    scores_nan = scores.clone()
    i, j = mask.nonzero()[0].tolist()
    scores_nan[i, j] = float("nan")
    out = compute_rewards(scores_nan, old, ref, 0.1, response_mask=mask)
    assert out[i, j].isnan() and out.isnan().sum() == 1
    for a, b in zip((scores, old, ref, mask), copies):
        assert torch.equal(a, b)


def test_bad_input_messages():
    scores, old, ref, mask = case(5)
    with pytest.raises(TypeError, match="token_level_scores"):
        compute_rewards(scores.long(), old, ref, 0.1)
    with pytest.raises(ValueError, match="old_log_prob"):
        compute_rewards(scores, old[:, :-1], ref, 0.1)
    with pytest.raises(ValueError, match="ref_log_prob"):
        compute_rewards(scores, old, ref.T, 0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_rewards(scores, old, ref, -0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_rewards(scores, old, ref, float("inf"))
    with pytest.raises(TypeError, match="kl_coef"):
        compute_rewards(scores, old, ref, "0.1")
    with pytest.raises(ValueError, match="kl_coef"):
        compute_rewards(scores, old, ref, torch.ones(5))
    with pytest.raises(ValueError, match="response_mask"):
        compute_rewards(scores, old, ref, 0.1, response_mask=mask[:, :2])
    with pytest.raises(ValueError, match="estimator"):
        compute_rewards(scores, old, ref, 0.1, estimator="k9")
