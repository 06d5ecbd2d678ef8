"""``trl.rewards.get_soft_overlong_punishment`` (TRL 0.24 and later) against rlmath's DAPO shaping.

Compared against TRL 0.24.0 (``.venv-peers``) and TRL 1.16.0.
"""

from __future__ import annotations

import pytest
import torch

from tests.peers.peer_helpers import SKIP_TRL, assert_close

trl_rewards = pytest.importorskip("trl.rewards", reason=SKIP_TRL)

import rlmath  # noqa: E402
from rlmath.compat import trl as ct  # noqa: E402


def test_soft_overlong_punishment_is_trls():
    trl_fn = trl_rewards.get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)
    lengths = [1, 10, 14, 15, 17, 20, 21, 30]
    t = max(lengths)
    mask = torch.arange(t) < torch.tensor(lengths)[:, None]
    out = rlmath.soft_overlong_punishment(
        torch.zeros(len(lengths), t), mask, max_response_length=20, overlong_buffer_length=6
    )
    want = trl_fn([[1] * n for n in lengths])
    assert_close(out.token_level_rewards.sum(-1), torch.tensor(want), rtol=0, atol=1e-7)


def test_compat_get_soft_overlong_punishment_is_trls():
    lengths = [[1] * n for n in (3, 12, 15, 16, 25)]
    assert ct.get_soft_overlong_punishment(16, 5)(lengths) == pytest.approx(
        trl_rewards.get_soft_overlong_punishment(16, 5)(lengths), abs=1e-15
    )
