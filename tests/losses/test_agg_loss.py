"""agg_loss and global_batch_info against fp64 references written from the definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_value_loss,
    get_policy_loss,
    global_batch_info,
    list_policy_losses,
)

from .helpers import LOSS_KWARGS, MODES, policy_batch, ragged_mask, ref_agg


def _case(seed: int, b: int = 5, t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(b, t, gen, empty_rows=(2,))
    loss = torch.randn(b, t, generator=gen, dtype=torch.float64)
    return loss, mask


def test_modes_are_the_documented_ones():
    assert set(LOSS_AGG_MODES) == set(MODES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_and_gradient(mode, seed):
    loss, mask = _case(seed)
    x = loss.clone().requires_grad_()
    got = agg_loss(x, mask, loss_agg_mode=mode, norm_length=9)
    got.backward()
    y = loss.clone().requires_grad_()
    want = ref_agg({(i, j): y[i, j] for i in range(5) for j in range(7)}, mask, mode, 9)
    want.backward()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)
    assert (x.grad[~mask] == 0).all()


def test_fully_masked_sequences_do_not_count():
    loss = torch.tensor([[1.0, 3.0], [100.0, 100.0], [5.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    # two sequences: token means 2 and 5, token sums 4 and 5
    assert agg_loss(loss, mask, loss_agg_mode="seq-mean-token-mean").item() == pytest.approx(3.5)
    assert agg_loss(loss, mask, loss_agg_mode="seq-mean-token-sum").item() == pytest.approx(4.5)
    assert agg_loss(
        loss, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=4
    ).item() == pytest.approx(4.5 / 4)
    assert agg_loss(loss, mask, loss_agg_mode="token-mean").item() == pytest.approx(3.0)
    assert agg_loss(loss, mask, loss_agg_mode="token-sum").item() == pytest.approx(9.0)


def test_norm_length_is_a_constant_not_the_padded_width():
    loss, mask = _case(3)
    padded = torch.cat([loss, torch.zeros(5, 4, dtype=torch.float64)], dim=1)
    pmask = torch.cat([mask, torch.zeros(5, 4, dtype=torch.bool)], dim=1)
    a = agg_loss(loss, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=16)
    b = agg_loss(padded, pmask, loss_agg_mode="seq-mean-token-sum-norm", norm_length=16)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch_gives_zero_with_zero_gradient(mode):
    x = torch.randn(3, 4, dtype=torch.float32, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = agg_loss(x, mask, loss_agg_mode=mode, norm_length=4)
    out.backward()
    assert out.item() == 0.0 and (x.grad == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_global_counts_and_dp_size_scale(mode):
    loss, mask = _case(4)
    info = global_batch_info(mask)
    full = agg_loss(loss, mask, loss_agg_mode=mode, norm_length=7)
    # With the batch's own counts and dp_size = 3, the loss is 3x the plain one.
    scaled = agg_loss(loss, mask, loss_agg_mode=mode, norm_length=7, dp_size=3, **{
        k: v for k, v in info.items() if k != "dp_size"
    })  # fmt: skip
    torch.testing.assert_close(scaled, 3 * full, rtol=1e-12, atol=1e-12)
    # Python-number counts work the same way as tensors.
    plain = agg_loss(
        loss, mask, loss_agg_mode=mode, norm_length=7,
        global_num_tokens=float(info["global_num_tokens"]),
        global_num_seqs=int(info["global_num_seqs"]),
    )  # fmt: skip
    torch.testing.assert_close(plain, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_low_precision_inputs_accumulate_in_fp32(dtype, mode):
    gen = torch.Generator().manual_seed(7)
    mask = ragged_mask(16, 64, gen)
    loss = torch.randn(16, 64, generator=gen, dtype=torch.float64) + 3
    low = loss.to(dtype)
    got = agg_loss(low, mask, loss_agg_mode=mode, norm_length=64)
    want = agg_loss(low.to(torch.float64), mask, loss_agg_mode=mode, norm_length=64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)


def test_float_mask_weights():
    loss = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    w = torch.tensor([[0.5, 0.0, 2.0]], dtype=torch.float64)
    # token-mean with frequency weights: (0.5·1 + 2·4) / 2.5
    assert agg_loss(loss, w, loss_agg_mode="token-mean").item() == pytest.approx(8.5 / 2.5)
    assert agg_loss(loss, w, loss_agg_mode="token-sum").item() == pytest.approx(8.5)
    assert global_batch_info(w)["global_num_tokens"].item() == pytest.approx(2.5)


@given(
    garbage=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 100.0]),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 10_000),
)
def test_values_under_mask_never_leak(garbage, mode, seed):
    loss, mask = _case(seed, 4, 5)
    dirty = torch.where(mask, loss, torch.full_like(loss, garbage))
    a = loss.clone().requires_grad_()
    b = dirty.clone().requires_grad_()
    ra, rb = (
        agg_loss(a, mask, loss_agg_mode=mode, norm_length=5),
        agg_loss(b, mask, loss_agg_mode=mode, norm_length=5),
    )
    ra.backward()
    rb.backward()
    assert torch.equal(ra, rb)
    assert torch.equal(a.grad, b.grad)


def test_global_batch_info_counts():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    info = global_batch_info(mask)
    assert info["dp_size"] == 1
    assert info["global_num_tokens"].item() == 4 and info["global_num_seqs"].item() == 2
    assert info["global_num_tokens"].dim() == 0
    # A list of micro-batch masks of different widths sums up.
    info2 = global_batch_info([mask, torch.ones(2, 5, dtype=torch.bool)])
    assert info2["global_num_tokens"].item() == 14 and info2["global_num_seqs"].item() == 4


def test_global_batch_info_with_a_group_of_one(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    store = tmp_path / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mask = torch.tensor([[1, 0], [0, 0], [1, 1]])
        info = global_batch_info(mask, group=dist.group.WORLD)
        assert info["dp_size"] == 1
        assert info["global_num_tokens"].item() == 3 and info["global_num_seqs"].item() == 2
    finally:
        dist.destroy_process_group()


def test_bad_input():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(x, m, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="token-mean, token-sum"):
        agg_loss(x, m, loss_agg_mode="seq-mean")  # the message lists the valid modes
    with pytest.raises(ValueError, match="norm_length"):
        agg_loss(x, m, loss_agg_mode="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="norm_length"):
        agg_loss(x, m, loss_agg_mode="seq-mean-token-sum-norm", norm_length=0)
    with pytest.raises(ValueError, match="global_num_tokens"):
        agg_loss(x, m, loss_agg_mode="token-mean", dp_size=2)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        with pytest.raises(ValueError, match="global_num_seqs"):
            agg_loss(x, m, loss_agg_mode=mode, dp_size=2)
    with pytest.raises(ValueError, match="dp_size"):
        agg_loss(x, m, dp_size=0)
    with pytest.raises(TypeError, match="dp_size"):
        agg_loss(x, m, dp_size=2.0)
    with pytest.raises(ValueError, match="global_num_tokens"):
        agg_loss(x, m, global_num_tokens=-1)
    with pytest.raises(ValueError, match="loss_mask must have the shape"):
        agg_loss(x, torch.ones(3, 2), loss_agg_mode="token-mean")
    with pytest.raises(TypeError, match="loss_mat"):
        agg_loss(torch.zeros(2, 3, dtype=torch.long), m)
    with pytest.raises(ValueError, match="loss_mask"):
        global_batch_info([])
    with pytest.raises(ValueError, match="not initialized"):
        global_batch_info(m, group=object())


COUNT_ARGS = ("global_num_tokens", "global_num_seqs")
BAD_NUMBERS = [float("inf"), float("-inf"), float("nan"), 0, 0.0, -1, -2.5, np.float32("inf")]


@pytest.mark.parametrize("arg", COUNT_ARGS)
@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_or_non_positive_count_raises(arg, bad, mode):
    """A count of inf made the loss (and its gradient) exactly 0; now every mode refuses it."""
    loss, mask = _case(0)
    with pytest.raises(ValueError, match=rf"{arg} must be (> 0|finite)"):
        agg_loss(loss, mask, loss_agg_mode=mode, norm_length=7, **{arg: bad})


@pytest.mark.parametrize("arg", COUNT_ARGS)
@pytest.mark.parametrize("name", list_policy_losses())
def test_every_loss_refuses_an_infinite_count(arg, name):
    old, logp, adv, mask = policy_batch(3, 5, 0)
    kw = dict(LOSS_KWARGS[name])
    with pytest.raises(ValueError, match=arg):
        get_policy_loss(name)(old, logp, adv, mask, **{arg: float("inf")}, **kw)
    with pytest.raises(ValueError, match=arg):
        compute_value_loss(logp, adv, old, mask, cliprange_value=0.2, **{arg: float("inf")})
    with pytest.raises(ValueError, match=arg):
        compute_entropy_loss(torch.randn(3, 5, 4), mask, **{arg: float("inf")})


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_bad_tensor_count_gives_nan_without_a_host_read(mode):
    """A tensor count is not read on the host: a bad one makes loss and gradient NaN, visibly."""
    loss, mask = _case(1)
    arg = "global_num_tokens" if mode == "token-mean" else "global_num_seqs"
    for bad in (float("inf"), float("nan"), -3.0):
        x = loss.clone().requires_grad_()
        got = agg_loss(x, mask, loss_agg_mode=mode, **{arg: torch.tensor(bad, dtype=torch.float64)})
        got.backward()
        assert got.isnan()
        assert x.grad[mask].isnan().all()
    zero = agg_loss(loss, mask, loss_agg_mode=mode, **{arg: torch.tensor(0.0, dtype=torch.float64)})
    assert zero == 0  # no valid token anywhere in the step
    good = agg_loss(loss, mask, loss_agg_mode=mode, **{arg: torch.tensor(4.0)})
    assert good == agg_loss(loss, mask, loss_agg_mode=mode, **{arg: 4.0})
    with pytest.raises(TypeError, match=arg):
        agg_loss(loss, mask, loss_agg_mode=mode, **{arg: torch.tensor(True)})
