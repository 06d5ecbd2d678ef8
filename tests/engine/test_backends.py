"""``backend=``: visible at the call, one registry for every operation and for vocabulary shards."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import rlmath.engine.backends as backends
from rlmath import (
    entropy_from_logits,
    kl_from_logits,
    log_probs_and_entropy_from_hidden,
    log_probs_from_logits,
    log_probs_from_logits_response,
    log_probs_from_logits_response_rmpad,
    sum_pi_squared_from_logits,
)
from rlmath.distributed import vocab_parallel as vp
from rlmath.engine import Backend, Kernels, available_backends, resolve_backend
from rlmath.engine.torch_backend import TORCH_KERNELS
from rlmath.fused_head import FusedLMHeadLogProbs


def _calls():
    """A backend "spy" that records each pass it runs and delegates to the torch kernels."""
    calls: list[str] = []

    def wrap(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            return getattr(TORCH_KERNELS, name)(*args, **kwargs)

        return kernel

    fields = [f.name for f in dataclasses.fields(Kernels) if f.name != "head_tiles"]
    return calls, Kernels(**{f: wrap(f) for f in fields})


@pytest.fixture
def spy(monkeypatch):
    calls, kernels = _calls()
    spy = Backend("spy", kernels, supports=lambda t: t.dtype == torch.float64, priority=5)
    monkeypatch.setitem(backends._BACKENDS, "spy", spy)
    return calls


def test_torch_backend_is_there_and_auto_picks_the_best_accepting_backend(spy):
    x32, x64 = torch.randn(3, 7), torch.randn(3, 7, dtype=torch.float64)
    assert resolve_backend("auto", x32) == "torch"
    assert resolve_backend("auto", x64) == "spy"
    assert available_backends(x64) == ["spy", "torch"]
    assert available_backends(x32) == ["torch"]


def test_every_vocabulary_function_goes_through_the_choice(spy):
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (4,))
    log_probs_from_logits(x, labels).sum().backward()
    entropy_from_logits(x)
    kl_from_logits(x, x.detach() + 1)
    sum_pi_squared_from_logits(x)
    assert spy == ["logits_stats", "logits_grad", "logits_stats", "kl_stats", "pi_squared_stats"]
    spy.clear()
    log_probs_from_logits(x, labels, backend="torch")  # named: the spy is skipped
    assert spy == []
    ids = torch.randint(0, 9, (2, 4))
    dense = torch.randn(2, 4, 9, dtype=torch.float64)
    log_probs_from_logits_response(ids, dense, 2)
    log_probs_from_logits_response_rmpad(ids, torch.ones(2, 4), dense.view(8, 9), 2)
    assert spy == ["logits_stats", "logits_stats"]
    spy.clear()
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 3, dtype=torch.float64)
    lp, _ = log_probs_and_entropy_from_hidden(h, w, labels)
    lp.sum().backward()
    FusedLMHeadLogProbs(torch.nn.Linear(3, 9, dtype=torch.float64))(h, labels)
    assert spy == ["head_stats", "head_grad", "head_stats"]


def test_vocabulary_parallel_functions_go_through_the_same_choice(spy):
    # A world of one: the vocabulary-parallel faces reach the same operators and backends.
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (4,))
    lp = vp.vocab_parallel_log_probs_from_logits(x, labels)
    lp.sum().backward()
    vp.vocab_parallel_kl_from_logits(x, x.detach())
    vp.vocab_parallel_sum_pi_squared(x)
    h = torch.randn(4, 3, dtype=torch.float64)
    vp.vocab_parallel_log_probs_and_entropy_from_hidden(
        h, torch.randn(9, 3, dtype=torch.float64), labels
    )
    assert spy == ["logits_stats", "logits_grad", "kl_stats", "pi_squared_stats", "head_stats"]
    spy.clear()
    vp.vocab_parallel_entropy(x, backend="torch")
    assert spy == []


@pytest.mark.parametrize(
    "call",
    [
        lambda b: log_probs_from_logits(
            torch.randn(2, 5), torch.zeros(2, dtype=torch.long), backend=b
        ),
        lambda b: entropy_from_logits(torch.randn(2, 5), backend=b),
        lambda b: kl_from_logits(torch.randn(2, 5), torch.randn(2, 5), backend=b),
        lambda b: log_probs_and_entropy_from_hidden(
            torch.randn(2, 3), torch.randn(5, 3), torch.zeros(2, dtype=torch.long), backend=b
        ),
        lambda b: vp.vocab_parallel_entropy(torch.randn(2, 5), backend=b),
        lambda b: FusedLMHeadLogProbs(torch.nn.Linear(3, 5), backend=b),
    ],
)
def test_unknown_backend_names_list_the_valid_ones(call):
    with pytest.raises(
        ValueError, match=r"unknown backend 'cuda-fast'; valid values are: auto, torch, triton"
    ):
        call("cuda-fast")
    with pytest.raises(TypeError, match="backend must be a str"):
        call(3)


def test_unavailable_and_unsupporting_backends_say_why(monkeypatch):
    # An optional backend whose module cannot be imported is named with the reason.
    monkeypatch.setitem(backends._OPTIONAL, "triton", "rlmath.engine.no_such_backend_module")
    monkeypatch.setattr(backends, "_UNAVAILABLE", {})
    monkeypatch.delitem(backends._BACKENDS, "triton", raising=False)
    with pytest.raises(ValueError, match="backend 'triton' is not available: No module named"):
        resolve_backend("triton", torch.randn(2))
    only64 = Backend("only64", TORCH_KERNELS, supports=lambda t: t.dtype == torch.float64)
    monkeypatch.setitem(backends._BACKENDS, "only64", only64)
    with pytest.raises(ValueError, match="backend 'only64' does not accept torch.float32"):
        log_probs_from_logits(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), backend="only64")


def test_register_backend_checks_its_argument():
    with pytest.raises(TypeError, match="Backend"):
        backends.register_backend("torch")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Kernels"):
        backends.register_backend(Backend("x", kernels={}))  # type: ignore[arg-type]


def test_triton_backend_without_triton_says_how_to_get_it(monkeypatch):
    """Where the triton package does not import, the backend is unavailable and says why."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "rlmath.engine.triton_backend", raising=False)
    monkeypatch.delitem(sys.modules, "rlmath.engine.triton_backend._requirement", raising=False)
    monkeypatch.setattr(backends, "_UNAVAILABLE", {})
    monkeypatch.setattr(
        backends, "_BACKENDS", {k: v for k, v in backends._BACKENDS.items() if k != "triton"}
    )
    with pytest.raises(
        ValueError,
        match=r"backend 'triton' is not available: the 'triton' backend needs the triton package",
    ):
        resolve_backend("triton", torch.randn(2))
    assert resolve_backend("auto", torch.randn(2)) == "torch"
    # The error names the way out.
    with pytest.raises(ValueError, match=r"pip install 'triton>=3.4'"):
        log_probs_from_logits(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), backend="triton")


def test_triton_older_than_the_tested_releases_is_unavailable(monkeypatch):
    """A triton without the language features the kernels use (older than 3.4) is refused
    with the installed and the needed version; "auto" falls back to the torch backend."""
    _fake_triton(monkeypatch, "3.2.0")
    monkeypatch.setattr(backends, "_UNAVAILABLE", {})
    monkeypatch.setattr(
        backends, "_BACKENDS", {k: v for k, v in backends._BACKENDS.items() if k != "triton"}
    )
    with pytest.raises(ValueError, match=r"needs triton >= 3\.4, but triton 3\.2\.0 is installed"):
        resolve_backend("triton", torch.randn(2))
    assert resolve_backend("auto", torch.randn(2)) == "torch"


def _fake_triton(monkeypatch, version: str) -> None:
    """Make ``import triton`` give a stand-in of ``version`` (no GPU compiler needed)."""
    fake = types.ModuleType("triton")
    fake.__version__ = version
    monkeypatch.setitem(sys.modules, "triton", fake)
    monkeypatch.setitem(sys.modules, "triton.language", types.ModuleType("triton.language"))
    monkeypatch.delitem(sys.modules, "rlmath.engine.triton_backend", raising=False)
    monkeypatch.delitem(sys.modules, "rlmath.engine.triton_backend._requirement", raising=False)


@pytest.mark.parametrize(
    ("version", "release"),
    [("3.4.0", (3, 4)), ("3.10.1", (3, 10)), ("3.5.0+git1a2b3c", (3, 5)), ("4.0.0rc1", (4, 0))],
)
def test_triton_release_parsing(monkeypatch, version, release):
    """The version check alone, loaded from its file (the package would load the kernels)."""
    _fake_triton(monkeypatch, version)
    path = Path(backends.__file__).parent / "triton_backend" / "_requirement.py"
    spec = importlib.util.spec_from_file_location("_triton_requirement_under_test", path)
    assert spec is not None and spec.loader is not None
    requirement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(requirement)  # does not raise: the version is new enough
    assert requirement.release(version) == release


# ------------------------------------------------------------------ "auto" and the self-check


def _checked_backend(monkeypatch, **broken):
    """A ``checked`` backend on fp32 CPU tensors: the torch kernels, with ``broken`` replacing some."""
    calls: list[str] = []

    def wrap(name):
        def kernel(*args, **kwargs):
            calls.append(name)
            return getattr(TORCH_KERNELS, name)(*args, **kwargs)

        return kernel

    fields = {f.name: wrap(f.name) for f in dataclasses.fields(Kernels) if f.name != "head_tiles"}
    fields.update(broken)
    be = Backend(
        "checked", Kernels(**fields), supports=lambda t: t.dtype == torch.float32, priority=20,
        checked=True,
    )  # fmt: skip
    monkeypatch.setitem(backends._BACKENDS, "checked", be)
    monkeypatch.setattr(backends, "_CHECKS", {})
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    return calls


def _lp(x, labels, **kw):
    leaf = x.clone().requires_grad_()
    lp = log_probs_from_logits(leaf, labels, **kw)
    lp.sum().backward()
    return lp, leaf.grad


def test_auto_runs_the_self_check_once_and_then_uses_a_backend_that_passes(monkeypatch, recwarn):
    calls = _checked_backend(monkeypatch)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    _lp(x, labels)
    checked = len(calls)
    assert checked > 0 and backends._CHECKS == {("checked", "logits", "cpu", torch.float32): None}
    calls.clear()
    lp, grad = _lp(x, labels)
    assert calls == ["logits_stats", "logits_grad"]  # chosen, and no second self-check
    want = _lp(x, labels, backend="torch")
    assert torch.equal(lp, want[0]) and torch.equal(grad, want[1])
    assert not [w for w in recwarn if "self-check" in str(w.message)]
    # Each family is checked on its own, and only when it is used.
    kl_from_logits(x, x + 1)
    assert ("checked", "kl", "cpu", torch.float32) in backends._CHECKS
    assert ("checked", "head", "cpu", torch.float32) not in backends._CHECKS
    # fp64 is not accepted by this backend: no check, the torch backend.
    assert resolve_backend("auto", x.double(), "logits") == "torch"


def test_the_self_check_runs_from_inference_mode(monkeypatch):
    """A first call under ``torch.inference_mode()`` (computing old log-probs) still checks the
    backward and keeps the backend."""
    calls = _checked_backend(monkeypatch)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            log_probs_from_logits(x, labels)
    assert backends._CHECKS == {("checked", "logits", "cpu", torch.float32): None}
    assert "logits_grad" in calls


def test_a_wrong_kernel_fails_the_self_check_and_auto_falls_back_with_one_warning(monkeypatch):
    def wrong_grad(*args, **kwargs):  # a gradient 1 % off: a miscompiled kernel
        return TORCH_KERNELS.logits_grad(*args, **kwargs) * 1.01

    calls = _checked_backend(monkeypatch, logits_grad=wrong_grad)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    with pytest.warns(
        RuntimeWarning, match=r"'checked' backend failed its self-check for the logits"
    ):
        lp, grad = _lp(x, labels)
    reason = backends._CHECKS[("checked", "logits", "cpu", torch.float32)]
    assert reason is not None and "entries differ" in reason
    want = _lp(x, labels, backend="torch")
    assert torch.equal(lp, want[0]) and torch.equal(grad, want[1])  # the torch backend ran
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once
        _lp(x, labels)
        assert calls == []
        # The other families pass their checks and keep the backend.
        kl_from_logits(x, x + 1)
    assert "kl_stats" in calls
    # Named at the call, the backend runs without a check.
    calls.clear()
    assert not torch.equal(_lp(x, labels, backend="checked")[1], grad)  # the wrong gradient
    assert calls == ["logits_stats"]


def test_a_kernel_that_fails_to_compile_falls_back_with_the_reason(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("PTX codegen error: ptxas failed")

    _checked_backend(monkeypatch, pi_squared_stats=broken)
    x = torch.randn(3, 40)
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: PTX codegen error"):
        got = sum_pi_squared_from_logits(x)
    assert torch.equal(got, sum_pi_squared_from_logits(x, backend="torch"))


def test_the_environment_variable_replaces_auto(monkeypatch):
    calls = _checked_backend(monkeypatch)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    monkeypatch.setenv(backends.BACKEND_ENV, "torch")
    _lp(x, labels)
    assert calls == [] and backends._CHECKS == {}
    monkeypatch.setenv(backends.BACKEND_ENV, "checked")  # forced: no self-check
    _lp(x, labels)
    assert calls == ["logits_stats", "logits_grad"] and backends._CHECKS == {}
    _lp(x, labels, backend="torch")  # a name given at the call stays
    assert calls == ["logits_stats", "logits_grad"]
    monkeypatch.setenv(backends.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=r"RLMATH_BACKEND='cuda' is not a backend; valid values"):
        _lp(x, labels)
    monkeypatch.setenv(backends.BACKEND_ENV, "checked")
    with pytest.raises(ValueError, match="backend 'checked' does not accept torch.float64"):
        _lp(x.double(), labels)


@pytest.mark.integration
def test_the_self_check_runs_outside_a_compiled_graph(monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` the choice is a constant: no graph break."""
    calls = _checked_backend(monkeypatch)
    x, labels = torch.randn(4, 50), torch.randint(0, 50, (4,))
    fn = torch.compile(lambda a, b: log_probs_from_logits(a, b), fullgraph=True, backend="eager")
    got = fn(x, labels)
    assert backends._CHECKS == {("checked", "logits", "cpu", torch.float32): None}
    assert "logits_stats" in calls
    assert torch.equal(got, log_probs_from_logits(x, labels, backend="torch"))


def test_self_check_comparison_tolerances():
    from rlmath.engine.self_check import compare

    a = torch.randn(100) * 10
    assert compare([a], [a.clone()]) is None
    assert compare([a * (1 + 1e-6)], [a]) is None  # fp32 rounding-level differences pass
    assert compare([a * (1 + 1e-3)], [a]) is not None  # a wrong result does not
    assert (
        compare(
            [torch.tensor([float("inf"), float("nan")])],
            [torch.tensor([float("inf"), float("nan")])],
        )
        is None
    )
    assert compare([torch.tensor([float("inf")])], [torch.tensor([1.0])]) is not None
    b = torch.randn(100).bfloat16()
    one_ulp = (b.float() * (1 + 2**-8)).bfloat16()  # at most one unit in the last place apart
    assert compare([one_ulp], [b]) is None
    assert compare([(b.float() * 1.05).bfloat16()], [b]) is not None
    assert "shape" in compare([a[:5]], [a])
