"""The synthetic verifiable task: sort a short string of digits.

A prompt is ``<bos> d1 … dk <sep>`` with ``k`` distinct random digits; the
correct response is the same digits in ascending order followed by ``<eos>``::

    <bos> 3 1 4 7 <sep>   →   1 3 4 7 <eos>

The answer is checked exactly, so the reward is verifiable: no learned reward
model is involved. The reward gives partial credit (the fraction of answer
positions that hold the right digit) so that a policy far from the answer
still sees which samples were better; a sample *succeeds* only when it is the
exact sorted copy closed by ``<eos>``, and then, and only then, its reward is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["SortTask", "Vocab", "score_response"]


@dataclass(frozen=True)
class Vocab:
    """The demo's own vocabulary: four special tokens, then the symbols.

    ``symbols`` are the characters a prompt is made of (digits by default);
    token id of symbol ``i`` is ``len(SPECIALS) + i``.
    """

    symbols: str = "0123456789"

    SPECIALS: ClassVar[tuple[str, ...]] = ("<pad>", "<bos>", "<sep>", "<eos>")

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def sep_id(self) -> int:
        return 2

    @property
    def eos_id(self) -> int:
        return 3

    @property
    def size(self) -> int:
        return len(self.SPECIALS) + len(self.symbols)

    def symbol_id(self, i: int) -> int:
        return len(self.SPECIALS) + i

    def token(self, token_id: int) -> str:
        if token_id < len(self.SPECIALS):
            return self.SPECIALS[token_id]
        return self.symbols[token_id - len(self.SPECIALS)]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.token(int(i)) for i in ids)


def score_response(response: Sequence[int], target: Sequence[int], eos_id: int) -> float:
    """Reward of one response, in ``[0, 1]``; exactly 1.0 iff it is correct.

    ``response`` holds the generated token ids (anything after the first
    ``<eos>`` is ignored); ``target`` holds the answer's token ids without
    ``<eos>``. The answer body is the part before the first ``<eos>`` (the
    whole response when there is none). Reward = number of positions where the
    body matches the target / max(len(body), len(target)), so extra or missing
    tokens cost credit. A body that matches but is not closed by ``<eos>``
    (the response was cut at the length limit) scores at most
    ``len(target) / (len(target) + 1)``.
    """
    response = [int(t) for t in response]
    closed = eos_id in response
    body = response[: response.index(eos_id)] if closed else response
    if closed and body == list(target):
        return 1.0
    # An unclosed body must not score 1: count the missing <eos> as one more
    # required position. Every other case is then strictly below 1 as well.
    denom = max(len(body), len(target) + (0 if closed else 1), 1)
    matches = sum(int(a == b) for a, b in zip(body, target))
    return matches / denom


class SortTask:
    """Random prompts of ``min_len..max_len`` distinct digits and their sorted answers.

    Prompts are drawn from a ``torch.Generator`` so that a run is reproducible
    from its seed alone.
    """

    def __init__(self, vocab: Vocab, *, min_len: int = 3, max_len: int = 5) -> None:
        if not 1 <= min_len <= max_len <= len(vocab.symbols):
            raise ValueError(
                f"need 1 <= min_len <= max_len <= {len(vocab.symbols)} (distinct symbols), "
                f"got min_len={min_len}, max_len={max_len}"
            )
        self.vocab = vocab
        self.min_len = min_len
        self.max_len = max_len

    @property
    def max_prompt_len(self) -> int:
        return self.max_len + 2  # <bos> … <sep>

    @property
    def max_response_len(self) -> int:
        return self.max_len + 1  # answer + <eos>

    def sample_digits(self, n: int, generator: torch.Generator) -> list[list[int]]:
        """``n`` random strings of distinct digits (symbol indices, not token ids).

        Digits within a prompt are distinct: with repeats, the model must also
        count copies, a separate skill that this tiny model learns far more
        slowly by RL than ordering itself.
        """
        lengths = torch.randint(self.min_len, self.max_len + 1, (n,), generator=generator)
        n_symbols = len(self.vocab.symbols)
        # Rows of a random permutation of the alphabet: distinct by construction.
        digits = torch.rand(n, n_symbols, generator=generator).argsort(dim=-1)
        return [digits[i, : int(lengths[i])].tolist() for i in range(n)]

    def prompt_ids(self, digits: Sequence[int]) -> list[int]:
        v = self.vocab
        return [v.bos_id, *(v.symbol_id(d) for d in digits), v.sep_id]

    def target_ids(self, digits: Sequence[int]) -> list[int]:
        """The correct answer's token ids, without ``<eos>``."""
        return [self.vocab.symbol_id(d) for d in sorted(digits)]

    def score(self, digits: Sequence[Sequence[int]], responses: torch.Tensor) -> torch.Tensor:
        """Rewards ``[B]`` (fp32) of responses ``[B, R]`` (token ids) to prompts ``digits``."""
        rows = responses.tolist()
        scores = [
            score_response(r, self.target_ids(d), self.vocab.eos_id)
            for d, r in zip(digits, rows, strict=True)
        ]
        return torch.tensor(scores, dtype=torch.float32)
