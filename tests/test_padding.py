"""unpad_input / pad_input / index_first_axis against a loop reference of flash-attn's
bert_padding conventions, for every padding layout, with gradients."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import cu_seqlens, index_first_axis, index_put_first_axis, pad_input, unpad_input

# ---------------------------------------------------------------- reference


def ref_unpad(x, mask, unused=None):
    """Loop over rows then positions: flash-attn's return values, as Python objects."""
    batch, seqlen = mask.shape
    packed, indices, lengths, used = [], [], [], []
    for b in range(batch):
        n = n_used = 0
        for t in range(seqlen):
            is_used = bool(mask[b, t])
            if is_used or (unused is not None and bool(unused[b, t])):
                packed.append(x[b, t])
                indices.append(b * seqlen + t)
                n += 1
                n_used += is_used
        lengths.append(n)
        used.append(n_used)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return packed, indices, cu, max(lengths, default=0), used


def layout_mask(kind, batch=4, seqlen=7):
    lengths = [0, 3, 7, 5][:batch]
    m = torch.zeros(batch, seqlen, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if kind == "right":
            m[b, :n] = True
        elif kind == "left":
            m[b, seqlen - n :] = True
        else:  # interior holes: a checkerboard-ish pattern
            m[b] = torch.tensor([(t * (b + 1)) % 3 != 1 for t in range(seqlen)])
    return m


def check_against_reference(x, mask, unused=None):
    packed, indices, cu, max_len, used = unpad_input(x, mask, unused)
    r_packed, r_indices, r_cu, r_max, r_used = ref_unpad(x, mask, unused)
    assert indices.dtype == torch.int64 and indices.tolist() == r_indices
    assert cu.dtype == torch.int32 and cu.tolist() == r_cu
    assert isinstance(max_len, int) and max_len == r_max
    assert used.dtype == torch.int32 and used.tolist() == r_used
    assert packed.dtype == x.dtype and packed.shape == (len(r_indices), *x.shape[2:])
    for row, expected in zip(packed, r_packed):
        assert torch.equal(row, expected)
    return packed, indices


# ---------------------------------------------------------------- values


@pytest.mark.parametrize("kind", ["right", "left", "interior"])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 3)])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_layouts_match_reference_and_round_trip(kind, trailing, mask_dtype):
    mask = layout_mask(kind)
    x = torch.randn(4, 7, *trailing, dtype=torch.float64)
    packed, indices = check_against_reference(x, mask.to(mask_dtype))
    restored = pad_input(packed, indices, 4, 7)
    expected = torch.where(mask.reshape(4, 7, *([1] * len(trailing))), x, 0)
    assert torch.equal(restored, expected)


@given(
    batch=st.integers(1, 5),
    seqlen=st.integers(1, 9),
    hidden=st.integers(1, 4),
    p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_round_trip_random_masks(batch, seqlen, hidden, p, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, seqlen, generator=g) < p
    x = torch.randn(batch, seqlen, hidden, generator=g).to(dtype)
    packed, indices = check_against_reference(x, mask)
    restored = pad_input(packed, indices, batch, seqlen)
    assert restored.dtype == dtype
    assert torch.equal(restored[mask], x[mask])
    assert (restored[~mask] == 0).all()


def test_token_ids_and_unused_slots():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 0]])
    mask = ids != 0
    packed, indices, cu, max_len, used = unpad_input(ids, mask)
    assert packed.tolist() == [5, 6, 7, 8, 9] and packed.dtype == torch.int64
    assert indices.tolist() == [2, 3, 4, 5, 6] and cu.tolist() == [0, 2, 5] and max_len == 3
    # unused_mask: slots packed and counted in cu_seqlens, but not in seqused.
    unused = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 1]], dtype=torch.bool)
    check_against_reference(ids, mask, unused)
    _, indices, cu, max_len, used = unpad_input(ids, mask, unused)
    assert cu.tolist() == [0, 3, 7] and used.tolist() == [2, 3] and max_len == 4


def test_empty_cases():
    x = torch.randn(3, 4, 2)
    packed, indices, cu, max_len, used = unpad_input(x, torch.zeros(3, 4, dtype=torch.bool))
    assert packed.shape == (0, 2) and indices.numel() == 0
    assert cu.tolist() == [0, 0, 0, 0] and max_len == 0 and used.tolist() == [0, 0, 0]
    assert torch.equal(pad_input(packed, indices, 3, 4), torch.zeros(3, 4, 2))
    packed, indices, cu, max_len, used = unpad_input(torch.randn(0, 5), torch.ones(0, 5))
    assert packed.shape == (0,) and cu.tolist() == [0] and max_len == 0 and used.numel() == 0


def test_cu_seqlens_helper():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    out = cu_seqlens(mask)
    assert out.dtype == torch.int32 and out.tolist() == [0, 2, 2, 4]
    out = cu_seqlens(torch.tensor([3, 0, 5]))
    assert out.dtype == torch.int32 and out.tolist() == [0, 3, 3, 8]
    assert cu_seqlens(torch.zeros(0, dtype=torch.int64)).tolist() == [0]


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("kind", ["right", "left", "interior"])
def test_gradients_flow_through_both_directions(kind):
    mask = layout_mask(kind)
    x = torch.randn(4, 7, 3, dtype=torch.float64, requires_grad=True)
    packed, indices, *_ = unpad_input(x, mask)
    weights = torch.randn_like(packed)
    (grad_x,) = torch.autograd.grad((packed * weights).sum(), [x])
    expected = torch.zeros_like(x)
    for k, flat in enumerate(indices.tolist()):
        expected[flat // 7, flat % 7] = weights[k]
    assert torch.equal(grad_x, expected)

    packed = packed.detach().requires_grad_()
    upstream = torch.randn(4, 7, 3, dtype=torch.float64)
    (grad_packed,) = torch.autograd.grad(
        (pad_input(packed, indices, 4, 7) * upstream).sum(), [packed]
    )
    assert torch.equal(grad_packed, upstream[mask])


def test_gradcheck_fp64():
    mask = layout_mask("interior", batch=3, seqlen=5)
    x = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    _, indices, *_ = unpad_input(x, mask)
    assert torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (x,))
    assert torch.autograd.gradcheck(
        lambda t: pad_input(unpad_input(t, mask)[0], indices, 3, 5), (x,)
    )
    flat = torch.randn(15, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (flat,))
    vals = torch.randn(indices.numel(), 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, indices, 15), (vals,))


masked_fill = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 100.0])


@given(fill=masked_fill, seed=st.integers(0, 2**16), p=st.floats(0.1, 0.9))
def test_values_under_mask_never_change_outputs_or_gradients(fill, seed, p):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 6, generator=g) < p
    x = torch.randn(3, 6, 2, generator=g, dtype=torch.float64)
    dirty = torch.where(mask[..., None], x, torch.full_like(x, fill))
    results = []
    for inp in (x, dirty):
        inp = inp.clone().requires_grad_()
        packed, indices, *_ = unpad_input(inp, mask)
        restored = pad_input(packed, indices, 3, 6)
        (grad,) = torch.autograd.grad((restored * restored).sum(), [inp])
        results.append((packed, restored, grad))
    for clean, noisy in zip(*results):
        assert torch.equal(clean, noisy)


def test_index_helpers_and_purity():
    src = torch.arange(12.0).reshape(6, 2)
    copy = src.clone()
    idx = torch.tensor([4, 0, 5])
    assert index_first_axis(src, idx).tolist() == [[8.0, 9.0], [0.0, 1.0], [10.0, 11.0]]
    assert index_first_axis(torch.arange(6), idx.to(torch.int32)).tolist() == [4, 0, 5]
    put = index_put_first_axis(torch.ones(3, 2), idx, 6)
    assert put.tolist() == [[1, 1], [0, 0], [0, 0], [0, 0], [1, 1], [1, 1]]
    assert torch.equal(src, copy)


# ---------------------------------------------------------------- bad input


def test_bad_input_messages():
    x = torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask"):
        unpad_input(x, torch.ones(2, 3, 1))
    with pytest.raises(TypeError, match="attention_mask"):
        unpad_input(x, [[1, 1, 1]])
    with pytest.raises(ValueError, match="hidden_states"):
        unpad_input(x, torch.ones(3, 2))
    with pytest.raises(TypeError, match="hidden_states"):
        unpad_input(x.numpy(), mask)
    with pytest.raises(ValueError, match="unused_mask"):
        unpad_input(x, mask, torch.ones(2, 4))
    packed, indices, *_ = unpad_input(x, mask)
    with pytest.raises(TypeError, match="indices"):
        pad_input(packed, indices.float(), 2, 3)
    with pytest.raises(ValueError, match="indices"):
        pad_input(packed, indices[:-1], 2, 3)
    with pytest.raises(ValueError, match="indices"):
        pad_input(packed, indices.reshape(2, 3), 2, 3)
    with pytest.raises(ValueError, match="batch"):
        pad_input(packed, indices, -2, 3)
    with pytest.raises(TypeError, match="seqlen"):
        pad_input(packed, indices, 2, 3.0)
    with pytest.raises(ValueError, match="first_axis_dim"):
        index_put_first_axis(packed, indices, -1)
    with pytest.raises(ValueError, match="input"):
        index_first_axis(torch.tensor(1.0), indices)
    with pytest.raises(TypeError, match="attention_mask_or_seqlens"):
        cu_seqlens(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="attention_mask_or_seqlens"):
        cu_seqlens(torch.ones(2, 2, 2))
