"""``select_valid`` and ``valid_row_sums`` give ``torch.where``'s bits, on both of their paths.

On a CPU both select by integer arithmetic on the values' bits; elsewhere
(and here, with :func:`rlmath._device.selects_by_bits` replaced) they call
``torch.where``. Every result is compared bit for bit (``view`` as integers,
so that the sign of zero counts; NaN by position) with ``torch.where`` itself.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath import _device, _valid_select
from rlmath._valid_select import row_sum_rows, select_valid, valid_row_sums, where_valid

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bits, the sign of zero included; NaN in the same places.

    A NaN's payload is not compared: torch's scalar and vectorized
    conversions of a half-precision NaN to fp32 give different payloads.
    """
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(bits(a)[~nan], bits(b)[~nan])


def batch(seed: int, rows: int, width: int, dtype: torch.dtype):
    """Values with NaN, ±inf and ±0 sprinkled over valid and masked positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    pick = torch.randint(0, len(SPECIAL) * 8, (rows, width), generator=g)
    for k, v in enumerate(SPECIAL):
        x[pick == k] = v
    valid = torch.rand(rows, width, generator=g) < 0.6
    return x.to(dtype), valid


@pytest.fixture(params=["bits", "where"])
def path(request, monkeypatch):
    """Run a test on the CPU's path and on the path other devices take."""
    if request.param == "where":
        monkeypatch.setattr(_device, "selects_by_bits", lambda device: False)
    return request.param


@pytest.mark.parametrize("dtype", FLOATS)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 40), width=st.integers(1, 70))
def test_select_valid_is_torch_where_bit_for_bit(dtype, seed, rows, width):
    x, valid = batch(seed, rows, width, dtype)
    zero = torch.zeros((), dtype=dtype)
    assert_same_bits(select_valid(valid, x), torch.where(valid, x, zero))
    # A per-row value broadcast over the row (an estimator's output).
    per_row = x[:, :1]
    assert_same_bits(select_valid(valid, per_row), torch.where(valid, per_row, zero))


@pytest.mark.parametrize("dtype", FLOATS)
def test_both_paths_agree(path, dtype):
    x, valid = batch(3, 50, 33, dtype)
    zero = torch.zeros((), dtype=dtype)
    assert_same_bits(select_valid(valid, x), torch.where(valid, x, zero))
    result = torch.float64 if dtype == torch.float64 else torch.float32
    want = torch.where(valid, x.to(result), torch.zeros((), dtype=result)).sum(-1)
    assert_same_bits(valid_row_sums(valid, x, result), want)


@pytest.mark.parametrize("dtype", FLOATS)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 60),
    width=st.integers(1, 50),
    chunk=st.integers(1, 200),
)
def test_row_sums_in_any_chunks_are_the_whole_sum(dtype, seed, rows, width, chunk):
    x, valid = batch(seed, rows, width, dtype)
    result = torch.float64 if dtype == torch.float64 else torch.float32
    want = torch.where(valid, x.to(result), torch.zeros((), dtype=result)).sum(-1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_valid_select, "ROW_SUM_CHUNK_ELEMENTS", chunk)
        mp.setattr(_valid_select, "ROW_SUM_WHERE_ELEMENTS", 0)  # the chunks even when small
        got = valid_row_sums(valid, x, result)
    assert_same_bits(got, want)
    assert_same_bits(valid_row_sums(valid, x, result), want)  # the small batch's plain form


def test_row_sums_are_the_same_for_1_2_and_4_threads():
    before = torch.get_num_threads()
    x, valid = batch(5, 3000, 700, torch.float32)  # 2.1 M elements, 4 chunks of 750 rows
    try:
        out = []
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            out.append((valid_row_sums(valid, x, torch.float32), select_valid(valid, x)))
    finally:
        torch.set_num_threads(before)
    for sums, selected in out[1:]:
        assert_same_bits(sums, out[0][0])
        assert_same_bits(selected, out[0][1])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threshold", [0, 10**9])
def test_where_valid_is_torch_where_by_bits_or_by_where(dtype, threshold, monkeypatch):
    """Above the size threshold the bits, below it ``where``: the same bits either way."""
    monkeypatch.setattr(_valid_select, "BITS_MIN_ELEMENTS", threshold)
    x, valid = batch(11, 37, 29, dtype)
    want = torch.where(valid, x, torch.zeros((), dtype=dtype))
    assert_same_bits(where_valid(valid, x), want)
    # A tensor autograd records takes torch.where: the gradient is selected the same way.
    leaf = x.clone().requires_grad_()
    got = where_valid(valid, leaf)
    assert got.requires_grad and got.grad_fn is not None
    assert_same_bits(got.detach(), want)
    got.backward(torch.ones_like(got))
    assert torch.equal(leaf.grad, valid.to(dtype))
    with torch.no_grad():
        assert_same_bits(where_valid(valid, leaf), want)


def test_inputs_are_never_written():
    x, valid = batch(7, 20, 30, torch.float32)
    x0, valid0 = x.clone(), valid.clone()
    select_valid(valid, x)
    valid_row_sums(valid, x, torch.float32)
    valid_row_sums(valid, x.bfloat16(), torch.float32)
    assert torch.equal(bits(x), bits(x0)) and torch.equal(valid, valid0)


def test_chunk_rows_bound_the_chunk_and_the_count():
    assert row_sum_rows(8192, 128) == 512  # 64 Ki elements
    assert row_sum_rows(8192, 1) == 65536 // 1 and row_sum_rows(10, 10**6) == 1
    assert row_sum_rows(100_000, 1024) == 3125  # at most 32 chunks
    for rows in (1, 7, 100, 5000):
        for width in (1, 3, 128, 9000):
            step = row_sum_rows(rows, width)
            assert step >= 1 and -(-rows // step) <= _valid_select.MAX_ROW_SUM_CHUNKS


def test_bad_input():
    x, valid = batch(0, 4, 4, torch.float32)
    with pytest.raises(TypeError, match="bool"):
        select_valid(valid.int(), x)
    with pytest.raises(TypeError, match="bool"):
        valid_row_sums(valid.float(), x, torch.float32)
    with pytest.raises(TypeError, match="floating"):
        select_valid(valid, x.int())
    with pytest.raises(TypeError, match="floating"):
        valid_row_sums(valid, x, torch.int32)


def test_device_rules():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert _device.reads_host(cpu) and _device.selects_by_bits(cpu)
    assert not _device.reads_host(meta) and not _device.selects_by_bits(meta)
    assert not _device.reads_host(torch.device("cuda", 0))
