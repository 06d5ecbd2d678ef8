"""Bad input to the fused head gets a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

from rlmath.fused_head import log_probs_and_entropy_from_hidden

fused = log_probs_and_entropy_from_hidden
N, H, V = 4, 3, 10


def ok():
    return {
        "hidden": torch.randn(N, H),
        "weight": torch.randn(V, H),
        "labels": torch.randint(0, V, (N,)),
    }


def call(**changes):
    args = {**ok(), **changes}
    kwargs = {k: v for k, v in args.items() if k not in ("hidden", "weight", "labels")}
    return fused(args["hidden"], args["weight"], args["labels"], **kwargs)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"hidden": [[1.0]]}, TypeError, "hidden must be a torch.Tensor"),
        ({"hidden": torch.ones(N, H, dtype=torch.long)}, TypeError, "hidden must be a floating"),
        ({"hidden": torch.tensor(1.0)}, ValueError, "hidden must have shape"),
        ({"weight": torch.randn(V, H + 1)}, ValueError, r"weight must have shape \(V, H\)"),
        ({"weight": torch.randn(V)}, ValueError, "weight must have shape"),
        ({"weight": torch.randn(0, H)}, ValueError, "weight must have shape"),
        ({"bias": torch.randn(V + 1)}, ValueError, r"bias must have shape \(V,\)"),
        ({"bias": torch.randn(1, V)}, ValueError, "bias must have shape"),
        ({"bias": torch.ones(V, dtype=torch.long)}, TypeError, "bias must be a floating"),
        ({"labels": torch.randint(0, V, (N, 1, 2))}, ValueError, "labels must have shape"),
        ({"labels": torch.randint(0, V, (N + 1,))}, ValueError, "labels must have shape"),
        ({"labels": torch.zeros(N)}, TypeError, "labels must be an integer"),
        ({"labels": torch.zeros(N, dtype=torch.bool)}, TypeError, "labels must be an integer"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"temperature": torch.ones(N + 1)}, ValueError, "temperature"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size"),
        ({"vocab_chunk_size": -3}, ValueError, "vocab_chunk_size"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index"),
        ({"ignore_index": True}, TypeError, "ignore_index"),
        ({"logit_scale": 0.0}, ValueError, "logit_scale must be finite and > 0"),
        ({"logit_scale": float("inf")}, ValueError, "logit_scale"),
        ({"softcap": -1.0}, ValueError, "softcap must be finite and > 0"),
        ({"softcap": "30"}, TypeError, "softcap"),
        ({"vocab_size": 0}, ValueError, "vocab_size must be >= 1"),
        ({"vocab_size": V + 1}, ValueError, "vocab_size"),
        ({"vocab_size": 2.0}, TypeError, "vocab_size"),
    ],
)
def test_bad_input(changes, error, match):
    with pytest.raises(error, match=match):
        call(**changes)


def test_validate_checks_data():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*found 10"):
        call(labels=torch.tensor([0, 1, 10, 2]), validate=True)
    with pytest.raises(ValueError, match="labels must lie in"):
        call(labels=torch.tensor([0, -5, 1, 2]), validate=True)
    with pytest.raises(ValueError, match="temperature"):
        call(temperature=torch.tensor([1.0, 0.0, 1.0, 1.0]), validate=True)
    # ignore_index positions are allowed, and valid data passes.
    lp, _ = call(labels=torch.tensor([0, -100, 9, 2]), validate=True)
    assert lp[1] == 0


def test_the_message_shows_expected_and_received():
    with pytest.raises(ValueError) as info:
        call(weight=torch.randn(V, 7))
    assert "H = hidden.shape[-1] = 3" in str(info.value) and "(10, 7)" in str(info.value)
    with pytest.raises(ValueError) as info:
        call(labels=torch.zeros(2, 2, dtype=torch.long))
    assert "(4,)" in str(info.value) and "(2, 2)" in str(info.value)


def test_temperature_errors_name_the_hidden_states():
    hidden, weight = torch.zeros(2, 3, 4), torch.zeros(5, 4)
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden\.shape\[:-1\] = \(2, 3\)"):
        log_probs_and_entropy_from_hidden(hidden, weight, labels, temperature=torch.ones(4))
