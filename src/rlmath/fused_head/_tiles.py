"""Row and vocabulary ranges of the blocks; the scratch buffers and the merge of tile
statistics are shared with the vocabulary-parallel head (:mod:`rlmath.logprobs._blocks`)."""

from __future__ import annotations

from rlmath.logprobs._blocks import TileWorkspace, merge_tile_stats

__all__ = ["TileWorkspace", "merge_tile_stats", "spans"]


def spans(total: int, step: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(total)`` in the fewest pieces of at most ``step``.

    The pieces differ in length by at most one (151936 by 4096 gives 38 pieces
    of 3998 or 3999, not 37 of 4096 and a last one of 384, which would cost as
    many passes as a full one for a tenth of the work).
    """
    if total <= 0:
        return []
    count = -(-total // step)
    size, extra = divmod(total, count)
    out, lo = [], 0
    for i in range(count):
        hi = lo + size + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out
