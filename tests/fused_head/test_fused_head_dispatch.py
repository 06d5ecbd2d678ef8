"""Dispatch: the torch kernel by default; another backend's fused kernel when it accepts the input."""

from __future__ import annotations

import pytest
import torch

import rlmath.logprobs.dispatch as lp_dispatch
from rlmath.fused_head import dispatch, log_probs_and_entropy_from_hidden
from rlmath.fused_head._function import FusedLinearLogProbsFn
from rlmath.logprobs.dispatch import Backend


def test_torch_kernel_is_the_default():
    x = torch.randn(2, 3)
    assert dispatch.get_fused_kernel(x) == FusedLinearLogProbsFn.apply
    assert dispatch.get_fused_kernel(x, backend="torch") == FusedLinearLogProbsFn.apply
    assert dispatch.fused_backends(x)[0] == "torch"
    with pytest.raises(ValueError, match="unknown backend 'nope'.*torch"):
        dispatch.get_fused_kernel(x, backend="nope")
    with pytest.raises(TypeError, match="backend"):
        dispatch.register_fused_kernel(3, FusedLinearLogProbsFn.apply)


def test_a_registered_backend_is_chosen_for_the_tensors_it_accepts(monkeypatch):
    calls = []

    def fake_kernel(*args):
        calls.append(args)
        return FusedLinearLogProbsFn.apply(*args)

    torch_kernels = lp_dispatch._BACKENDS["torch"].kernels
    fake = Backend(
        name="fake",
        kernels=dict(torch_kernels),
        supports=lambda t: t.dtype == torch.float64,
        priority=5,
    )
    monkeypatch.setitem(lp_dispatch._BACKENDS, "fake", fake)
    monkeypatch.setitem(dispatch._KERNELS, "fake", fake_kernel)
    assert dispatch.fused_backends(torch.zeros(1, dtype=torch.float64)) == ["fake", "torch"]
    weight = torch.randn(5, 3, dtype=torch.float64)
    labels = torch.tensor([1, 4])
    lp, _ = log_probs_and_entropy_from_hidden(
        torch.randn(2, 3, dtype=torch.float64), weight, labels
    )
    assert len(calls) == 1 and lp.shape == (2,)
    log_probs_and_entropy_from_hidden(torch.randn(2, 3), weight.float(), labels)
    assert len(calls) == 1  # fp32 is not accepted by the fake backend: the torch kernel ran


def test_a_backend_without_a_fused_kernel_falls_back_to_torch(monkeypatch):
    torch_kernels = lp_dispatch._BACKENDS["torch"].kernels
    other = Backend(name="other", kernels=dict(torch_kernels), priority=9)
    monkeypatch.setitem(lp_dispatch._BACKENDS, "other", other)
    assert dispatch.get_fused_kernel(torch.zeros(1)) == FusedLinearLogProbsFn.apply
