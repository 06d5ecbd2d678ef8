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
    prompt_batch_info,
)

from .helpers import (
    LOSS_KWARGS,
    MODES,
    agg_extra,
    policy_batch,
    prompt_of,
    ragged_mask,
    ref_agg,
)


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
    got = agg_loss(x, mask, loss_agg_mode=mode, **agg_extra(mask, 9))
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
    out = agg_loss(x, mask, loss_agg_mode=mode, **agg_extra(mask, 4))
    out.backward()
    assert out.item() == 0.0 and (x.grad == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_global_counts_and_dp_size_scale(mode):
    loss, mask = _case(4)
    info = global_batch_info(mask)
    prompts = prompt_batch_info(mask, [prompt_of(i) for i in range(mask.shape[0])])
    full = agg_loss(loss, mask, loss_agg_mode=mode, **agg_extra(mask, 7))
    # With the batch's own counts and dp_size = 3, the loss is 3x the plain one.
    scaled = agg_loss(loss, mask, loss_agg_mode=mode, norm_length=7, dp_size=3, **prompts, **{
        k: v for k, v in info.items() if k != "dp_size"
    })  # fmt: skip
    torch.testing.assert_close(scaled, 3 * full, rtol=1e-12, atol=1e-12)
    # Python-number counts work the same way as tensors.
    plain = agg_loss(
        loss, mask, loss_agg_mode=mode, **agg_extra(mask, 7),
        global_num_tokens=float(info["global_num_tokens"]),
        global_num_seqs=int(info["global_num_seqs"]),
        global_num_prompts=int(prompts["global_num_prompts"]),
    )  # fmt: skip
    torch.testing.assert_close(plain, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_low_precision_inputs_accumulate_in_fp32(dtype, mode):
    gen = torch.Generator().manual_seed(7)
    mask = ragged_mask(16, 64, gen)
    loss = torch.randn(16, 64, generator=gen, dtype=torch.float64) + 3
    low = loss.to(dtype)
    got = agg_loss(low, mask, loss_agg_mode=mode, **agg_extra(mask))
    want = agg_loss(low.to(torch.float64), mask, loss_agg_mode=mode, **agg_extra(mask))
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
        agg_loss(a, mask, loss_agg_mode=mode, **agg_extra(mask)),
        agg_loss(b, mask, loss_agg_mode=mode, **agg_extra(mask)),
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


COUNT_ARGS = ("global_num_tokens", "global_num_seqs", "global_num_prompts")
BAD_NUMBERS = [float("inf"), float("-inf"), float("nan"), 0, 0.0, -1, -2.5, np.float32("inf")]


@pytest.mark.parametrize("arg", COUNT_ARGS)
@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_or_non_positive_count_raises(arg, bad, mode):
    """A count of inf made the loss (and its gradient) exactly 0; now every mode refuses it."""
    loss, mask = _case(0)
    with pytest.raises(ValueError, match=rf"{arg} must be (> 0|finite)"):
        agg_loss(loss, mask, loss_agg_mode=mode, **agg_extra(mask, 7), **{arg: bad})


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


def test_prompt_mean_by_hand():
    # Prompt A: rows 0, 1 with tokens (1, 2) and (3): token mean (1 + 2 + 3)/3 = 2.
    # Prompt B: row 2 with tokens (5, 7): mean 6. Prompt C: a fully masked row, no prompt.
    # prompt-mean = (2 + 6)/2 = 4, where token-mean is 18/5 = 3.6.
    loss = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [5.0, 7.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0], [0, 0, 0]]).bool()
    info = prompt_batch_info(mask, ["A", "A", "B", "C"])
    assert info["prompt_num_tokens"].tolist() == [3.0, 3.0, 2.0, 0.0]
    assert info["global_num_prompts"].item() == 2.0
    x = loss.clone().requires_grad_()
    out = agg_loss(x, mask, loss_agg_mode="prompt-mean", **info)
    out.backward()
    assert out.item() == pytest.approx(4.0)
    assert agg_loss(loss, mask, loss_agg_mode="token-mean").item() == pytest.approx(3.6)
    # Each token of prompt A weighs 1/(2·3), of prompt B 1/(2·2).
    want = torch.tensor([[1 / 6, 1 / 6, 0], [1 / 6, 0, 0], [1 / 4, 1 / 4, 0], [0, 0, 0]])
    torch.testing.assert_close(x.grad, want)
    # Without global_num_prompts the local count Σ_i n_i/N_p = 3/3 + 2/2 = 2 is used.
    local = agg_loss(
        loss, mask, loss_agg_mode="prompt-mean", prompt_num_tokens=info["prompt_num_tokens"]
    )
    assert local.item() == pytest.approx(4.0)


def _prompt_info_worker():
    import torch.distributed as dist

    rank = dist.get_rank()
    # Rank 0 holds rows 0–2, rank 1 rows 3–5; prompt 1 (rows 2 and 3) spans both ranks.
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [0, 0], [1, 1]]).bool()
    ids = torch.tensor([0, 0, 1, 1, 2, 3])
    rows = slice(0, 3) if rank == 0 else slice(3, 6)
    dense = prompt_batch_info(mask[rows], ids[rows], group=dist.group.WORLD, num_prompt_ids=4)
    whole = [[0, 0, 1], [2, 3, 3]][rank]  # whole prompts per rank (other ids)
    local = prompt_batch_info(mask[rows], whole, group=dist.group.WORLD)
    return dense, local


@pytest.mark.integration
def test_prompt_batch_info_over_two_gloo_ranks():
    from rlmath.distributed import run_distributed

    (d0, l0), (d1, l1) = run_distributed(_prompt_info_worker, 2)
    # Dense ids: prompt 1 counts 2 + 1 tokens across the ranks; prompt 2 has none: 3 prompts.
    assert torch.cat([d0["prompt_num_tokens"], d1["prompt_num_tokens"]]).tolist() == [
        3.0, 3.0, 3.0, 3.0, 0.0, 2.0
    ]  # fmt: skip
    assert d0["global_num_prompts"].item() == d1["global_num_prompts"].item() == 3.0
    # Whole prompts per rank: rank 0 has prompts {0: 3 tokens, 1: 2}, rank 1 {2: 1, 3: 2}.
    assert l0["prompt_num_tokens"].tolist() == [3.0, 3.0, 2.0]
    assert l1["prompt_num_tokens"].tolist() == [1.0, 2.0, 2.0]
    assert l0["global_num_prompts"].item() == l1["global_num_prompts"].item() == 4.0


def test_prompt_mean_bad_input():
    loss, mask = _case(5)
    with pytest.raises(ValueError, match="prompt_num_tokens is required"):
        agg_loss(loss, mask, loss_agg_mode="prompt-mean")
    with pytest.raises(ValueError, match="prompt_num_tokens must have one count per row"):
        agg_loss(loss, mask, loss_agg_mode="prompt-mean", prompt_num_tokens=torch.ones(3))
    with pytest.raises(TypeError, match="prompt_num_tokens"):
        agg_loss(
            loss,
            mask,
            loss_agg_mode="prompt-mean",
            prompt_num_tokens=torch.ones(5, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="global_num_prompts is required"):
        agg_loss(loss, mask, loss_agg_mode="prompt-mean", prompt_num_tokens=torch.ones(5), dp_size=2,
                 global_num_tokens=3, global_num_seqs=3)  # fmt: skip
    with pytest.raises(ValueError, match="num_prompt_ids"):
        prompt_batch_info(mask, torch.zeros(5, dtype=torch.long), num_prompt_ids=0)
    with pytest.raises(ValueError, match="index"):
        prompt_batch_info(mask, torch.zeros(5), num_prompt_ids=2)
    with pytest.raises(ValueError, match="index"):
        prompt_batch_info(mask, [0, 1])
