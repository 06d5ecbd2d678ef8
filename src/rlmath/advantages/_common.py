"""Private helpers shared by the advantage estimators.

Input checks for ``[B, T]`` token tensors, the masked batch whitening every
estimator that whitens goes through, and the "compress the valid tokens to the
left" transform that gives multi-turn semantics (masked tokens skipped) to
every recurrence over time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlmath._valid_select import select_valid, valid_row_sums
from rlmath._validation import (
    check_in_range,
    check_mask,
    check_same_shape,
    check_tensor,
    result_dtype,
    valid_mask,
)
from rlmath.advantages.groups import segment_ids
from rlmath.masked import masked_whiten

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__: list[str] = []


def check_token_inputs(
    token_level_rewards: object, response_mask: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``[B, T]`` rewards and mask; return the rewards and a bool mask."""
    rewards = check_tensor("token_level_rewards", token_level_rewards, floating=True)
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must have shape (B, T), got {tuple(rewards.shape)}")
    mask = check_mask("response_mask", response_mask, "token_level_rewards", rewards)
    valid = valid_mask(mask)
    return rewards, valid


def check_token_tensor(name: str, x: object, rewards: torch.Tensor) -> torch.Tensor:
    """A floating tensor of the rewards' shape and device."""
    t = check_tensor(name, x, floating=True)
    check_same_shape(name, t, "token_level_rewards", rewards)
    if t.device != rewards.device:
        raise ValueError(f"{name} is on {t.device} but token_level_rewards is on {rewards.device}")
    return t


def as_unit_scalar(name: str, value: object) -> float:
    """A Python float in ``[0, 1]``; a one-element tensor is read once (a host sync on GPU)."""
    return check_in_range(name, value, 0.0, 1.0)


def valid_values(x: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` at valid positions and exactly 0 elsewhere (NaN/inf under mask do not leak)."""
    return torch.where(valid, x.to(dtype), 0)


def whiten_batch(
    values: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    counts: torch.Tensor | None = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Masked whitening over every valid token of the batch: :func:`rlmath.masked_whiten`.

    The single place where estimators whiten over the batch (GAE,
    REINFORCE++, REINFORCE++-baseline, GDPO): mean over the valid tokens,
    unbiased variance, eps 1e-8, variance 0 for fewer than two tokens, masked
    positions exactly 0, over the ranks of ``group`` when given (data
    parallel: the batch is split over its ranks; every rank must call). Two
    input forms:

    - token values ``(B, T)`` and the bool mask ``valid``;
    - ``counts=``: per-sample values ``(B,)`` that stand for ``counts[i]``
      identical valid tokens each (outcome estimators), a frequency weight;
      the statistics are the same token-level ones, computed on ``B`` numbers.
      The caller broadcasts.
    """
    weights = valid if counts is None else counts.to(values.dtype)
    assert weights is not None
    return masked_whiten(values, weights, group=group)


def valid_counts(valid: torch.Tensor) -> torch.Tensor:
    """Number of valid tokens per row, ``(B,)`` int32 (summed without an int64 copy of the mask)."""
    return valid.sum(-1, dtype=torch.int32)


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``y[:, t] = Σ_{s ≥ t} x[:, s]``, accumulated right to left (no cancellation)."""
    return x.flip(-1).cumsum(-1).flip(-1)


class ValidTokens:
    """Positions of the valid tokens of each row, packed to the left.

    The ``k``-th valid token of row ``b`` sits at packed column ``k``. The
    packed width is ``T + 1``: columns past the row's number of valid tokens
    hold 0, so "the value after the last valid token" reads a 0, and the last
    column (always 0) is where every masked position is sent and read back
    from. Running a recurrence over packed columns skips masked tokens
    exactly: one step per valid transition, nothing read from masked positions.
    """

    def __init__(self, valid: torch.Tensor) -> None:
        self.valid = valid
        self.batch, self.length = valid.shape
        column = valid.cumsum(-1).sub_(1)
        self.column = column.masked_fill_(~valid, self.length)

    def pack(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[B, T]`` → ``[B, T + 1]`` in ``dtype``, packed to the left.

        Masked entries of ``x`` (NaN, inf, anything) land in the last column,
        which is then set to 0: they never reach a valid column.
        """
        out = torch.zeros((self.batch, self.length + 1), dtype=dtype, device=x.device)
        out.scatter_(1, self.column, x.to(dtype))
        out[:, self.length] = 0
        return out

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[B, T + 1]`` packed (last column 0) → ``[B, T]``; masked positions read the 0."""
        return packed.gather(1, self.column)


class OutcomeInputs:
    """Validated inputs of an outcome estimator, and the way back to tokens.

    ``valid`` and ``ids`` are computed at once; ``scores`` and ``rewards`` when
    first read (grouped estimators need only the scores, which on a CPU are
    summed without a full-size masked copy of the rewards).
    """

    def __init__(
        self, rewards: torch.Tensor, valid: torch.Tensor, ids: torch.Tensor | None
    ) -> None:
        self.valid = valid
        """``(B, T)`` bool mask."""
        self.ids = ids
        """``(B,)`` group labels in ``[0, B)`` (None when no index was given)."""
        self.dtype = result_dtype(rewards)
        self._given = rewards
        self._rewards: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None

    # Computed on first read and kept (plain attributes rather than
    # ``functools.cached_property``, whose lock ``torch.compile`` cannot trace).
    @property
    def rewards(self) -> torch.Tensor:
        """``(B, T)`` token rewards in the result dtype, 0 at masked positions (a new tensor)."""
        if self._rewards is None:
            self._rewards = select_valid(self.valid, self._given.to(self.dtype))
        return self._rewards

    @property
    def scores(self) -> torch.Tensor:
        """``(B,)`` sum of the valid token rewards, in the result dtype."""
        if self._scores is None:
            if self._rewards is not None:
                self._scores = self._rewards.sum(-1)
            else:
                self._scores = valid_row_sums(self.valid, self._given, self.dtype)
        return self._scores

    def to_tokens(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``(B,)`` → ``(B, T)``: the sample's value on its valid tokens, 0 elsewhere.

        The estimator's output, a new tensor.
        """
        return select_valid(self.valid, per_sample.unsqueeze(-1))


def outcome_inputs(
    token_level_rewards: object, response_mask: object, index: Any = None, *, grouped: bool = True
) -> OutcomeInputs:
    """Check an outcome estimator's inputs; the group labels when ``grouped``."""
    rewards, valid = check_token_inputs(token_level_rewards, response_mask)
    ids = segment_ids(index, rewards.shape[0], rewards.device) if grouped else None
    return OutcomeInputs(rewards, valid, ids)
