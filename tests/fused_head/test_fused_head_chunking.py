"""Block sizes of the fused head: given sizes are kept, automatic ones are bounded."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath.engine.policy import (
    DEFAULT_BLOCK_ELEMENTS,
    DEFAULT_ROWS,
    HEAD_TILE,
    TILE_ALIGN,
    auto_tile_sizes,
    elementwise_rows,
    spans,
)
from rlmath.fused_head import log_probs_and_entropy_from_hidden
from tests.fused_head.reference import make, make_labels


@given(total=st.integers(0, 5000), step=st.integers(1, 700))
def test_spans_cover_the_range_in_even_pieces(total, step):
    pieces = spans(total, step)
    assert [lo for lo, _ in pieces] == ([0] if total else []) + [hi for _, hi in pieces[:-1]]
    assert (pieces[-1][1] if pieces else 0) == total
    lengths = [hi - lo for lo, hi in pieces]
    assert all(0 < n <= step for n in lengths)
    assert len(pieces) == -(-total // step)
    assert not lengths or max(lengths) - min(lengths) <= 1


def test_given_sizes_are_kept():
    assert auto_tile_sizes(100, 50, chunk_size=7, vocab_chunk_size=3) == (7, 3)
    assert auto_tile_sizes(100, 50, chunk_size=1000, vocab_chunk_size=1000) == (1000, 1000)


@given(n=st.integers(1, 10**6), v=st.integers(1, 300_000))
def test_automatic_sizes_are_bounded(n, v):
    rows, tile = auto_tile_sizes(n, v)
    assert 1 <= rows <= min(n, DEFAULT_ROWS) and 1 <= tile <= v
    block = rows * tile
    assert block <= DEFAULT_BLOCK_ELEMENTS
    # Scratch is at most 1/64 of the logits, or the 64k-entry floor for tiny inputs.
    assert block <= max(n * v // 64, 64 * 1024)
    # The rows are those of the longest chunk that spans() cuts: the tile is
    # sized for the rows a block really has.
    assert max(b - a for a, b in spans(n, rows)) == rows


def test_cpu_tiles_are_the_same_for_every_number_of_rows():
    for v in (100, 2048, 32000, 151936):
        for n in (1, 2, 7, 512, 8192, 10**6):
            assert auto_tile_sizes(n, v)[1] == min(v, HEAD_TILE)
    # The rows fill the block: 512 rows under the 1/64 bound (256000 entries)
    # allow 125 rows per 2048-column tile, cut evenly into five chunks of 103.
    assert auto_tile_sizes(512, 32000) == (103, 2048)


def test_accelerator_tiles_fill_the_block():
    # 512 rows under the 1/48 bound (341333 entries): one chunk of 512 rows, and
    # the tile takes the rest of the block, whatever its width.
    assert auto_tile_sizes(512, 32000, device="cuda") == (512, 341333 // 512)


def test_real_shapes_get_large_blocks():
    for n, v in [(8192, 32000), (4096, 151936)]:
        rows, tile = auto_tile_sizes(n, v)
        # Thousands of rows for the matmuls, blocks of millions of entries,
        # CPU tiles a multiple of TILE_ALIGN wide.
        assert rows >= 1600 and tile == HEAD_TILE and rows * tile >= 3_000_000
        assert tile % TILE_ALIGN == 0


def test_elementwise_rows():
    threads = torch.get_num_threads()
    for rows, width in ((1, 10), (7, 3), (1024, 4096), (2048, 151936), (4096, 1)):
        sub = elementwise_rows(rows, width)
        assert 1 <= sub <= rows
        # About 2 MiB of fp32 per slice, at least two rows per thread.
        assert sub <= max(2**21 // (4 * width), 2 * threads)
    assert elementwise_rows(1024, 4096, "cuda") == 1024  # accelerators: one slice per block
    if threads == 2:
        assert elementwise_rows(1024, 4096) == 128


@pytest.mark.parametrize("sub", [1, 3, 1000])
def test_results_do_not_depend_on_the_elementwise_slices(monkeypatch, sub, matmul_library):
    import rlmath.engine.torch_backend.head_blocks as fn

    def run():
        hidden = make((23, 6), torch.float32, requires_grad=True)
        weight = make((50, 6), torch.float32, seed=1, requires_grad=True)
        labels = make_labels((23,), 50, ignore=[2])
        t = torch.rand(23, generator=torch.Generator().manual_seed(3)) + 0.5
        lp, ent = log_probs_and_entropy_from_hidden(
            hidden, weight, labels, temperature=t, chunk_size=8, vocab_chunk_size=16
        )
        torch.autograd.backward([lp, ent], [torch.ones(23), -torch.ones(23)])
        return lp, ent, hidden.grad, weight.grad

    want = run()
    monkeypatch.setattr(fn, "elementwise_rows", lambda rows, width, device=None: min(rows, sub))
    got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@given(total=st.integers(0, 5000), tile=st.integers(1, 700))
def test_cpu_tiles_are_fixed_steps_and_accelerator_tiles_even_on_the_tile_grid(total, tile):
    from rlmath.engine.policy import tile_spans
    from rlmath.engine.tree import TILE

    width = -(-tile // TILE) * TILE  # the tile rounded up onto the 128-column grid
    cpu = tile_spans(total, tile)
    assert [lo for lo, _ in cpu] == list(range(0, total, width))
    assert (cpu[-1][1] if cpu else 0) == total
    assert all(hi - lo == width for lo, hi in cpu[:-1]) and all(hi > lo for lo, hi in cpu)
    acc = tile_spans(total, tile, "cuda")
    assert [hi - lo for lo, hi in acc] == [
        min(b * TILE, total) - a * TILE for a, b in spans(-(-total // TILE), width // TILE)
    ]
    assert all(lo % TILE == 0 for lo, _ in cpu + acc)
    assert (acc[-1][1] if acc else 0) == total and all(hi > lo for lo, hi in acc)


@given(length=st.integers(1, 100_000))
def test_matmul_pieces(length):
    from rlmath.engine.policy import MATMUL_PIECE_ROWS, matmul_piece

    piece = matmul_piece(length)
    pieces = spans(length, piece)
    # The fewest pieces of at most MATMUL_PIECE_ROWS rows, of even lengths.
    assert 1 <= piece <= MATMUL_PIECE_ROWS
    assert len(pieces) == -(-length // MATMUL_PIECE_ROWS)
    assert all(b - a in (piece - 1, piece) for a, b in pieces)
    assert matmul_piece(length, "cuda") == length  # one piece per block on an accelerator


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("band_bytes", [1, 3 * 6 * 4 * 8])
def test_half_precision_grad_hidden_does_not_depend_on_the_row_bands(
    monkeypatch, dtype, band_bytes, matmul_library
):
    # On a CPU a half-precision grad_hidden sums in fp32 bands of rows, one band
    # after another; bands of one block row each, or of a few, give the bits of
    # one band of every row.
    import rlmath.engine.torch_backend.head_backward as hb

    def run():
        hidden = make((37, 6), dtype, requires_grad=True)
        weight = make((50, 6), dtype, seed=1, requires_grad=True)
        labels = make_labels((37,), 50, ignore=[2])
        lp, ent = log_probs_and_entropy_from_hidden(
            hidden, weight, labels, chunk_size=8, vocab_chunk_size=16
        )
        torch.autograd.backward([lp, ent], [torch.ones(37), -torch.ones(37)])
        return lp, ent, hidden.grad, weight.grad

    want = run()
    bands = []
    monkeypatch.setattr(hb, "BAND_BYTES", band_bytes)
    real_bands = hb._bands
    monkeypatch.setattr(hb, "_bands", lambda *a: bands.append(real_bands(*a)) or bands[-1])
    got = run()
    assert len(bands) == 1 and len(bands[0]) > 1, bands
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_row_bands_cover_the_block_rows_in_order():
    from rlmath.engine.torch_backend.head_backward import BAND_BYTES, _bands

    rows = [(0, 5), (5, 10), (10, 13), (13, 20)]
    assert _bands(rows, BAND_BYTES) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert _bands(rows, BAND_BYTES // 10) == [(0, 2), (2, 4)]
    assert _bands(rows, 1) == [(0, 4)]
    assert _bands([], 1) == []
