"""The fused head's CPU matmuls: both libraries against fp64 within the rounding bound, and the rule."""

from __future__ import annotations

import pytest
import torch

from rlmath.engine.torch_backend import cpu_matmul

U = 2.0**-24  # unit roundoff of fp32


def gamma(k: int) -> float:
    """``γ_k = k·u / (1 − k·u)``: the bound of a sum of ``k`` rounded fp32 products, relative to ``Σ|a||b|``."""
    return k * U / (1 - k * U)


@pytest.fixture(params=[False, True], ids=["blas", "onednn"])
def onednn(request):
    if request.param and not cpu_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN")
    return request.param


def _operands(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    # b as the head passes it: the transpose of a row block of a larger matrix.
    w = torch.randn(n + 7, k, generator=g)
    return a, w[3 : 3 + n].T


@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 1, 1), (37, 64, 129), (512, 1024, 256), (5, 3000, 9)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_mm_within_the_rounding_bound_of_fp64(onednn, m, k, n, with_bias):
    a, b = _operands(m, k, n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)) if with_bias else None
    before = [t.clone() for t in (a, b) + ((bias,) if bias is not None else ())]
    out = torch.full((m, n), float("nan"))
    z = cpu_matmul.mm(a, b, out=out, bias=bias, onednn=onednn)
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    if bias is not None:
        exact, scale = exact + bias.double(), scale + bias.double().abs()
    assert z.shape == (m, n) and z.dtype == torch.float32
    assert ((z.double() - exact).abs() <= gamma(k + 1) * scale).all()
    for t, t0 in zip((a, b, bias), before, strict=False):
        assert torch.equal(t, t0)  # no input is written


@pytest.mark.parametrize(("m", "k", "n"), [(2, 5, 3), (64, 700, 200), (1100, 40, 1000)])
def test_add_mm_writes_then_accumulates_within_the_rounding_bound(onednn, m, k, n):
    a, b = _operands(m, k, n, seed=1)
    acc = torch.full((m, n), float("nan"))
    cpu_matmul.add_mm_(acc, a, b, first=True, onednn=onednn)  # overwrites: no NaN survives
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    assert ((acc.double() - exact).abs() <= gamma(k) * scale).all()
    a2, b2 = _operands(m, k, n, seed=2)
    first = acc.double()
    cpu_matmul.add_mm_(acc, a2, b2, first=False, onednn=onednn)
    exact2 = first + a2.double() @ b2.double()
    scale2 = first.abs() + a2.double().abs() @ b2.double().abs()
    # One rounded product (γ_k) and one rounded addition: within γ_(k+1).
    assert ((acc.double() - exact2).abs() <= gamma(k + 1) * scale2).all()


def test_add_mm_forms_onednn_products_of_at_most_product_elements(monkeypatch):
    # A product the size of a head's weight tile, formed whole once per block
    # and worker, made the process's resident memory grow by as much.
    if not cpu_matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN")
    linear = cpu_matmul._onednn_linear()
    sizes = []

    def spy(*args):
        out = linear(*args)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(cpu_matmul, "_onednn_linear", lambda: spy)
    m, k, n = 2432, 64, 1024  # a 2432-entry tile's grad_weight for H = 1024: 9.5 MiB
    a, b = _operands(m, k, n, seed=3)
    acc = torch.empty(m, n)
    cpu_matmul.add_mm_(acc, a, b, first=True, onednn=True)
    assert sum(sizes) == m * n and max(sizes) <= cpu_matmul.PRODUCT_ELEMENTS
    exact, scale = a.double() @ b.double(), a.double().abs() @ b.double().abs()
    assert ((acc.double() - exact).abs() <= gamma(k) * scale).all()


def test_a_transposed_left_operand(onednn):
    # g.T @ hidden, the weight gradient's product: a is a transposed view.
    g = torch.Generator().manual_seed(3)
    grad, hidden = torch.randn(300, 128, generator=g), torch.randn(300, 64, generator=g)
    acc = torch.empty(128, 64)
    cpu_matmul.add_mm_(acc, grad.T, hidden, first=True, onednn=onednn)
    scale = grad.double().abs().T @ hidden.double().abs()
    assert ((acc.double() - grad.double().T @ hidden.double()).abs() <= gamma(300) * scale).all()


def test_an_empty_inner_dimension_gives_zeros(onednn):
    a, b = torch.randn(3, 0), torch.randn(0, 4)
    assert torch.equal(cpu_matmul.mm(a, b, onednn=onednn), torch.zeros(3, 4))
    bias = torch.arange(4.0)
    assert torch.equal(cpu_matmul.mm(a, b, bias=bias, onednn=onednn), bias.expand(3, 4))
    acc = torch.ones(3, 4)
    cpu_matmul.add_mm_(acc, a, b, first=False, onednn=onednn)
    assert torch.equal(acc, torch.ones(3, 4))


def test_nan_reaches_only_its_row(onednn):
    a, b = _operands(4, 16, 8)
    a[2, 5] = float("nan")
    z = cpu_matmul.mm(a, b, out=torch.empty(4, 8), onednn=onednn)
    assert z[2].isnan().all() and not z[[0, 1, 3]].isnan().any()


@pytest.fixture
def machine(monkeypatch):
    """Set the machine the rule sees: ``machine(arch, vendor, env=None)``."""

    def set_machine(arch, vendor, env=None):
        monkeypatch.setattr(cpu_matmul.platform, "machine", lambda: arch)
        monkeypatch.setattr(cpu_matmul, "_cpu_vendor", lambda: vendor)
        if env is None:
            monkeypatch.delenv(cpu_matmul.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(cpu_matmul.ENV_VAR, env)
        cpu_matmul._machine_choice.cache_clear()

    yield set_machine
    cpu_matmul._machine_choice.cache_clear()


needs_onednn = pytest.mark.skipif(
    not cpu_matmul.onednn_available() or not torch.backends.mkl.is_available(),
    reason="the rule picks oneDNN only where torch has both MKL and oneDNN",
)


@needs_onednn
@pytest.mark.parametrize(
    ("arch", "vendor", "picked"),
    [
        ("x86_64", "AuthenticAMD", True),
        ("x86_64", "HygonGenuine", True),
        ("x86_64", "GenuineIntel", False),
        ("x86_64", "", False),  # unknown vendor: torch's own path
        ("aarch64", "", False),
    ],
)
def test_the_rule_picks_onednn_on_x86_cpus_that_are_not_intels(machine, arch, vendor, picked):
    machine(arch, vendor)
    assert cpu_matmul.uses_onednn(torch.float32, torch.device("cpu")) is picked


@needs_onednn
@pytest.mark.parametrize(("env", "picked"), [("onednn", True), ("blas", False), (" OneDNN ", True)])
def test_the_environment_variable_overrides_the_rule(machine, env, picked):
    machine("x86_64", "GenuineIntel" if picked else "AuthenticAMD", env)
    assert cpu_matmul.uses_onednn(torch.float32, torch.device("cpu")) is picked


@needs_onednn
def test_torchs_switch_for_onednn_keeps_the_matmuls_in_torch(machine):
    machine("x86_64", "AuthenticAMD")
    assert cpu_matmul.uses_onednn(torch.float32, torch.device("cpu"))
    torch.backends.mkldnn.enabled = False
    try:
        assert not cpu_matmul.uses_onednn(torch.float32, torch.device("cpu"))
    finally:
        torch.backends.mkldnn.enabled = True
    assert cpu_matmul.uses_onednn(torch.float32, torch.device("cpu"))


def test_a_bad_environment_variable_is_a_clear_error(machine):
    machine("x86_64", "AuthenticAMD", "mkl")
    with pytest.raises(ValueError, match="RLMATH_CPU_MATMUL must be one of"):
        cpu_matmul.uses_onednn(torch.float32, torch.device("cpu"))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_only_fp32_on_a_cpu_goes_to_onednn(machine, dtype):
    machine("x86_64", "AuthenticAMD", "onednn")
    assert cpu_matmul.uses_onednn(torch.float32, torch.device("cpu"))
    assert not cpu_matmul.uses_onednn(dtype, torch.device("cpu"))
    assert not cpu_matmul.uses_onednn(torch.float32, torch.device("cuda"))
    assert not cpu_matmul.uses_onednn(torch.float32, torch.device("meta"))


def test_the_vendor_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n")
    assert cpu_matmul._cpu_vendor(str(info)) == "AuthenticAMD"
    info.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # an Arm cpuinfo has no vendor_id
    assert cpu_matmul._cpu_vendor(str(info)) == ""
    assert cpu_matmul._cpu_vendor(str(tmp_path / "absent")) == ""
