"""Response masks, clip_by_value and the padding-to-length helpers, against plain-Python references."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import clip_by_value, get_response_mask, pad_2d_list_to_length, pad_sequence_to_length

# ---------------------------------------------------------------- references


def ref_response_mask(rows, eos_ids):
    """1 up to and including the first EOS of each row, 0 after it."""
    out = []
    for row in rows:
        mask, ended = [], False
        for token in row:
            mask.append(0 if ended else 1)
            ended = ended or token in eos_ids
        out.append(mask)
    return out


# ---------------------------------------------------------------- get_response_mask


def test_response_mask_worked_example():
    ids = torch.tensor(
        [
            [20, 10, 34, 1, 0, 0, 0],
            [78, 0, 76, 2, 1, 0, 0],
            [23, 98, 1, 0, 0, 0, 0],
            [33, 3, 98, 45, 1, 0, 0],
            [1, 1, 2, 1, 5, 6, 7],
            [5, 6, 7, 8, 9, 10, 11],
        ]
    )
    one = get_response_mask(ids, eos_token=1)
    assert one.dtype == torch.int64
    assert one.tolist() == [
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],  # EOS at position 0: only the EOS itself
        [1, 1, 1, 1, 1, 1, 1],  # no EOS: everything valid
    ]
    both = get_response_mask(ids, [1, 2])
    assert both[1].tolist() == [1, 1, 1, 1, 0, 0, 0]  # 2 comes before 1 in row 1
    assert get_response_mask(ids).tolist() == ref_response_mask(ids.tolist(), {2})  # default eos 2


@given(
    rows=st.lists(st.lists(st.integers(0, 6), min_size=5, max_size=5), min_size=1, max_size=6),
    eos=st.one_of(st.integers(0, 6), st.lists(st.integers(0, 6), min_size=1, max_size=3)),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.bool, torch.float32]),
)
def test_response_mask_matches_reference(rows, eos, dtype):
    ids = torch.tensor(rows)
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    out = get_response_mask(ids, eos, dtype=dtype)
    assert out.dtype == dtype and out.shape == ids.shape
    assert out.to(torch.int64).tolist() == ref_response_mask(rows, eos_ids)
    # Tensor and tuple forms of eos_token give the same mask.
    assert torch.equal(out, get_response_mask(ids, torch.tensor(sorted(eos_ids)), dtype))
    assert torch.equal(out, get_response_mask(ids, tuple(sorted(eos_ids)), dtype))


@given(
    rows=st.lists(st.lists(st.integers(0, 6), min_size=6, max_size=6), min_size=1, max_size=4),
    junk=st.integers(0, 6),
)
def test_tokens_after_the_first_eos_never_matter(rows, junk):
    ids = torch.tensor(rows)
    mask = get_response_mask(ids, 3)
    noisy = torch.where(mask.bool(), ids, torch.full_like(ids, junk))
    # Only positions strictly after the first EOS changed; they stay masked either way.
    assert torch.equal(get_response_mask(noisy, 3), mask)


def test_response_mask_other_shapes_and_purity():
    ids = torch.tensor([4, 2, 9, 2], dtype=torch.int32)
    assert get_response_mask(ids, 2).tolist() == [1, 1, 0, 0]  # 1-D: time is the last dim
    batch = torch.randint(0, 4, (2, 3, 5), generator=torch.Generator().manual_seed(0))
    copy = batch.clone()
    out = get_response_mask(batch, np.int64(1))
    assert out.reshape(6, 5).tolist() == ref_response_mask(batch.reshape(6, 5).tolist(), {1})
    assert torch.equal(batch, copy)
    assert get_response_mask(torch.zeros(3, 0, dtype=torch.int64)).shape == (3, 0)


def test_response_mask_bad_input():
    with pytest.raises(TypeError, match="response_id"):
        get_response_mask(torch.rand(2, 3))
    # bool ids used to fail inside torch.isin without naming the argument
    with pytest.raises(
        TypeError, match=r"response_id must be an integer tensor, got dtype torch.bool"
    ):
        get_response_mask(torch.tensor([[True, False]]), 1)
    with pytest.raises(TypeError, match=r"response_id .* got dtype torch.complex64"):
        get_response_mask(torch.ones(2, 3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="response_id"):
        get_response_mask([[1, 2]])
    with pytest.raises(ValueError, match="response_id"):
        get_response_mask(torch.tensor(3))
    with pytest.raises(TypeError, match="eos_token"):
        get_response_mask(torch.ones(2, 3, dtype=torch.int64), 2.0)
    with pytest.raises(TypeError, match="eos_token"):
        get_response_mask(torch.ones(2, 3, dtype=torch.int64), [1, "2"])
    with pytest.raises(TypeError, match="eos_token"):
        get_response_mask(torch.ones(2, 3, dtype=torch.int64), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="eos_token"):
        get_response_mask(torch.ones(2, 3, dtype=torch.int64), [])
    with pytest.raises(TypeError, match="dtype"):
        get_response_mask(torch.ones(2, 3, dtype=torch.int64), 2, "int64")


# ---------------------------------------------------------------- clip_by_value


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_clip_by_value_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g).to(dtype)
    low = torch.randn(4, 6, generator=g).to(dtype)
    high = low + torch.rand(4, 6, generator=g).to(dtype)
    high[0, 0] = low[0, 0] - 1  # an inverted pair: the lower bound wins
    out = clip_by_value(x, low, high)
    assert out.dtype == dtype
    expected = [
        max(min(a, h), lo)
        for a, lo, h in zip(x.flatten().tolist(), low.flatten().tolist(), high.flatten().tolist())
    ]
    assert out.flatten().tolist() == expected
    assert out[0, 0] == low[0, 0]


def test_clip_by_value_broadcast_scalars_nan_and_gradient():
    x = torch.tensor([[-2.0, 0.5, 3.0], [float("nan"), -0.5, 0.0]], requires_grad=True)
    low = torch.tensor([[-1.0], [-0.25]])
    out = clip_by_value(x, low, 1.0)
    assert out[0].tolist() == [-1.0, 0.5, 1.0]
    assert out[1, 0].isnan() and out[1, 1:].tolist() == [-0.25, 0.0]
    # The gradient reaches x only where x itself was selected (the NaN slot is left out).
    (grad,) = torch.autograd.grad(out[0].sum() + out[1, 1:].sum(), [x])
    assert grad.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]


def test_clip_by_value_bad_input():
    with pytest.raises(TypeError, match="x"):
        clip_by_value([1.0], torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="tensor_min"):
        clip_by_value(torch.zeros(3), torch.zeros(2), torch.ones(3))
    with pytest.raises(TypeError, match="tensor_max"):
        clip_by_value(torch.zeros(3), 0.0, "1")


# ---------------------------------------------------------------- pad_sequence_to_length


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("left_pad", [False, True])
@pytest.mark.parametrize("target", [0, 3, 5, 9])
def test_pad_sequence_to_length(dtype, left_pad, target):
    x = torch.arange(15).reshape(3, 5).to(dtype)
    copy = x.clone()
    out = pad_sequence_to_length(x, target, -7, left_pad=left_pad)
    assert out.dtype == dtype and torch.equal(x, copy)
    width = max(5, target)
    expected = []
    for row in x.tolist():
        pad = [-7] * (width - 5)
        expected.append(pad + row if left_pad else row + pad)
    assert out.tolist() == expected
    if target <= 5:
        assert out is x  # already long enough: returned as is, never truncated


def test_pad_sequence_to_length_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="tensors"):
        pad_sequence_to_length([[1]], 4, 0)
    with pytest.raises(ValueError, match="tensors"):
        pad_sequence_to_length(torch.tensor(1.0), 4, 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        pad_sequence_to_length(x, -1, 0)
    with pytest.raises(TypeError, match="max_seq_len"):
        pad_sequence_to_length(x, 4.0, 0)
    with pytest.raises(TypeError, match="pad_token_id"):
        pad_sequence_to_length(x, 4, "0")


# ---------------------------------------------------------------- pad_2d_list_to_length


def test_pad_2d_list_to_length():
    rows = [[1, 2], [3], [4, 5, 6]]
    out = pad_2d_list_to_length(rows, 0)
    assert out.dtype == torch.int64
    assert out.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert pad_2d_list_to_length(rows, -1, max_length=5).tolist() == [
        [1, 2, -1, -1, -1],
        [3, -1, -1, -1, -1],
        [4, 5, 6, -1, -1],
    ]
    assert pad_2d_list_to_length(rows, 0, max_length=2).shape == (3, 3)  # never truncates
    floats = pad_2d_list_to_length([[-0.5, -1.25], (-2.0,)], 0)
    assert floats.dtype == torch.float32 and floats.tolist() == [[-0.5, -1.25], [-2.0, 0.0]]
    tensors = pad_2d_list_to_length([torch.tensor([7, 8]), torch.tensor([9])], 0)
    assert tensors.tolist() == [[7, 8], [9, 0]]
    arrays = pad_2d_list_to_length([np.array([1, 2, 3]), np.array([4])], 0, max_length=4)
    assert arrays.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert rows == [[1, 2], [3], [4, 5, 6]]  # input untouched


def test_pad_2d_list_to_length_bad_input():
    with pytest.raises(ValueError, match="response"):
        pad_2d_list_to_length([], 0)
    with pytest.raises(TypeError, match="response"):
        pad_2d_list_to_length(torch.zeros(2, 2), 0)
    with pytest.raises(TypeError, match=r"response\[1\]"):
        pad_2d_list_to_length([[1], 5], 0)
    with pytest.raises(ValueError, match="max_length"):
        pad_2d_list_to_length([[1]], 0, max_length=-3)
    with pytest.raises(TypeError, match="pad_token_id"):
        pad_2d_list_to_length([[1]], None)
