"""Which packed (padding-free) rows predict each response token, without a host read.

In packed ("rmpad") form the valid tokens of all sequences are concatenated;
the logits of a token predict the next valid token *of the same sequence*.
For a batch in verl's layout (``input_ids = [prompt | response]``, the
response the last ``R`` columns), response column ``j`` of sequence ``b`` is
scored by the packed row of the last valid token before it in that sequence.
Everything here is computed on the ``(B, S)`` grid with fixed shapes (no
boolean indexing, no ``.item()``), so no device synchronization happens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NO_LABEL", "ResponseRows", "packed_row_of", "response_rows"]

NO_LABEL = -1
"""The label given to response positions with no predicting row (never a token id)."""


def packed_row_of(valid: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` int64: the packed row of each valid position (row-major order), -1 elsewhere."""
    row = valid.reshape(-1).long().cumsum(0).sub_(1).view(valid.shape)
    return torch.where(valid, row, -1)


@dataclass(frozen=True)
class ResponseRows:
    """The packed rows predicting the response tokens.

    Attributes:
        rows: ``(B·R,)`` int64 packed row predicting each response position
            (0 where there is none; such positions have label :data:`NO_LABEL`).
        labels: ``(B·R, 1)`` int64 response token ids, :data:`NO_LABEL` where no
            row predicts the position (padding, or no earlier valid token).
        select: ``(B, R)`` bool, the positions that have a predicting row.
        prev: ``(B, R)`` int64 column of the predicting token (-1 where none).
    """

    rows: torch.Tensor
    labels: torch.Tensor
    select: torch.Tensor
    prev: torch.Tensor


def response_rows(ids: torch.Tensor, row_of: torch.Tensor, response_length: int) -> ResponseRows:
    """:class:`ResponseRows` for ``(B, S)`` token ids and :func:`packed_row_of` of their mask."""
    B, S = ids.shape
    R = response_length
    valid = row_of >= 0
    col = torch.arange(S, device=ids.device).expand(B, S)
    # Last valid column strictly before each column, within the same row (-1 if none).
    last_valid = torch.where(valid, col, -1).cummax(dim=1).values
    prev = torch.cat([last_valid.new_full((B, 1), -1), last_valid[:, :-1]], dim=1)[:, -R:]
    select = valid[:, -R:] & (prev >= 0)
    rows = torch.where(select, row_of.gather(1, prev.clamp_min(0)), 0)
    labels = torch.where(select, ids[:, -R:].long(), NO_LABEL)
    return ResponseRows(rows.reshape(-1), labels.reshape(-1, 1), select, prev)
