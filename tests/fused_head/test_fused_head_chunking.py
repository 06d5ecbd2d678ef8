"""Block sizes of the fused head: given sizes are kept, automatic ones are bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rlmath.fused_head._tiles import spans
from rlmath.fused_head.chunking import DEFAULT_BLOCK_ELEMENTS, DEFAULT_ROWS, auto_tile_sizes


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


def test_real_shapes_get_large_blocks():
    for n, v in [(8192, 32000), (4096, 151936)]:
        rows, tile = auto_tile_sizes(n, v)
        assert rows == 1024 and tile >= 4000
