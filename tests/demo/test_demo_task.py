"""The sort task's reward: exact answers score 1, everything else scores less."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlmath.demo.task import SortTask, Vocab, score_response

V = Vocab()
EOS = V.eos_id
TASK = SortTask(V, min_len=3, max_len=5)


def ids(*digits: int) -> list[int]:
    return [V.symbol_id(d) for d in digits]


def test_exact_sorted_answer_scores_one():
    assert score_response([*ids(1, 1, 3, 4), EOS], ids(1, 1, 3, 4), EOS) == 1.0


def test_tokens_after_eos_are_ignored():
    assert score_response([*ids(1, 3), EOS, *ids(9, 9)], ids(1, 3), EOS) == 1.0


def test_partial_credit_counts_matching_positions():
    # 2 of 4 positions right.
    assert score_response([*ids(1, 1, 4, 3), EOS], ids(1, 1, 3, 4), EOS) == 0.5
    # Too short: 2 matches over the target's 4 positions.
    assert score_response([*ids(1, 1), EOS], ids(1, 1, 3, 4), EOS) == 0.5
    # Too long: 4 matches over the body's 5 positions.
    assert score_response([*ids(1, 1, 3, 4, 4), EOS], ids(1, 1, 3, 4), EOS) == 0.8


def test_missing_eos_is_never_a_success():
    # The right digits but no <eos> (cut at the length limit): the missing
    # <eos> counts as one more required position.
    assert score_response(ids(1, 3, 4), ids(1, 3, 4), EOS) == 0.75
    assert score_response(ids(1, 3, 4, 4), ids(1, 3, 4), EOS) == 0.75


def test_empty_and_special_token_answers():
    assert score_response([EOS], ids(2, 5, 7), EOS) == 0.0
    assert score_response([], ids(2, 5, 7), EOS) == 0.0
    assert score_response([V.pad_id, V.sep_id, EOS], ids(2, 5), EOS) == 0.0


@given(
    digits=st.lists(st.integers(0, 9), min_size=3, max_size=5),
    response=st.lists(st.integers(0, V.size - 1), max_size=6),
)
def test_reward_in_unit_interval_and_one_iff_exact(digits, response):
    target = TASK.target_ids(digits)
    r = score_response(response, target, EOS)
    assert 0.0 <= r <= 1.0
    exact = EOS in response and response[: response.index(EOS)] == target
    assert (r == 1.0) == exact


def test_task_prompts_targets_and_batch_score():
    g = torch.Generator().manual_seed(0)
    digits = TASK.sample_digits(50, g)
    assert all(3 <= len(d) <= 5 and all(0 <= x <= 9 for x in d) for d in digits)
    assert all(len(set(d)) == len(d) for d in digits)  # distinct digits
    assert {len(d) for d in digits} == {3, 4, 5}
    d = [3, 1, 4, 1]
    assert V.decode(TASK.prompt_ids(d)) == "<bos> 3 1 4 1 <sep>"
    assert V.decode(TASK.target_ids(d)) == "1 1 3 4"
    responses = torch.tensor(
        [
            [*ids(1, 1, 3, 4), EOS, V.pad_id],
            [*ids(4, 3, 1, 1), EOS, V.pad_id],
        ]
    )
    scores = TASK.score([d, d], responses)
    assert scores.dtype == torch.float32
    assert scores.tolist() == [1.0, 0.0]


def test_bad_lengths_are_rejected():
    with pytest.raises(ValueError, match="min_len"):
        SortTask(V, min_len=4, max_len=3)
    with pytest.raises(ValueError, match="max_len"):
        SortTask(V, min_len=3, max_len=11)


def test_sampling_is_reproducible_from_the_seed():
    a = TASK.sample_digits(20, torch.Generator().manual_seed(7))
    b = TASK.sample_digits(20, torch.Generator().manual_seed(7))
    assert a == b


def test_random_answers_rarely_succeed():
    # A policy that emits a random permutation of the prompt (what the format
    # warm-up teaches) is sorted only by chance: the RL start is low.
    g = torch.Generator().manual_seed(0)
    digits = TASK.sample_digits(2000, g)
    wins = 0
    for d in digits:
        perm = torch.randperm(len(d), generator=g).tolist()
        wins += score_response([*ids(*(d[i] for i in perm)), EOS], TASK.target_ids(d), EOS) == 1
    assert wins / len(digits) < 0.2
