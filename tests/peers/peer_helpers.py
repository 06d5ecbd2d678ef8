"""Helpers shared by the differential tests (random inputs, peer loading)."""

from __future__ import annotations

import pytest
import torch

SKIP_VERL = (
    "verl 0.9.1 is not importable here: the differential tests run in .venv-peers "
    "(bash tests/peers/setup_peers_env.sh; .venv-peers/bin/python -m pytest tests/peers)"
)
SKIP_TRL = (
    "TRL 0.24 is not importable here: the differential tests run in .venv-peers "
    "(bash tests/peers/setup_peers_env.sh)"
)


def import_verl(module: str):
    """Import a verl module or skip the calling test module."""
    return pytest.importorskip(module, reason=SKIP_VERL)


def random_mask(
    b: int,
    t: int,
    gen: torch.Generator,
    *,
    p_gap: float = 0.25,
    min_valid: int = 1,
    layout: str = "right",
) -> torch.Tensor:
    """A [b, t] bool mask with interior gaps and ragged lengths.

    ``layout``: "right" (valid prefix with gaps, then padding), "left" (padding
    then a valid suffix), or "gaps" (independent Bernoulli, at least
    ``min_valid`` valid per row).
    """
    lengths = torch.randint(min_valid, t + 1, (b,), generator=gen)
    pos = torch.arange(t).expand(b, t)
    if layout == "right":
        mask = pos < lengths[:, None]
    elif layout == "left":
        mask = pos >= (t - lengths)[:, None]
    elif layout == "gaps":
        mask = torch.ones(b, t, dtype=torch.bool)
    else:
        raise ValueError(layout)
    gaps = torch.rand(b, t, generator=gen) < p_gap
    mask = mask & ~gaps
    # Guarantee ``min_valid`` valid tokens per row (the first ones of the row's span).
    for i in range(b):
        if int(mask[i].sum()) < min_valid:
            idx = torch.nonzero(
                pos[i] < lengths[i] if layout != "left" else pos[i] >= t - lengths[i]
            )
            mask[i, idx[:min_valid, 0]] = True
    return mask


def randn(*shape: int, gen: torch.Generator, dtype=torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def assert_close(actual, expected, *, rtol=1e-6, atol=1e-6, msg: str = "") -> None:
    """torch.testing.assert_close on the values (dtype may differ: rlmath upcasts)."""
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    torch.testing.assert_close(
        actual.to(torch.float64),
        expected.to(torch.float64),
        rtol=rtol,
        atol=atol,
        equal_nan=True,
        msg=(lambda m: f"{msg}\n{m}") if msg else None,
    )
