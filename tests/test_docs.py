"""The documentation points at things that exist: test names, files and links.

docs/design.md cites the test that shows each deliberate difference from verl
(``tests/...py::test_name``); a renamed or moved test must take its citation
along. Relative links in the Markdown pages must resolve inside the repository.
"""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    p
    for p in [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        ROOT / "tests" / "peers" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
    ]
    if p.exists()
)
CITATION = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")
LINK = re.compile(r"\]\(([^)\s]+)\)")

if not (ROOT / "docs").is_dir():
    pytest.skip("docs/ is not beside tests/ (an installed copy)", allow_module_level=True)


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_tests_exist(page):
    missing = []
    for path, name in CITATION.findall(page.read_text(encoding="utf-8")):
        target = ROOT / path
        if not target.is_file():
            missing.append(path)
        elif name and name not in _functions(target):
            missing.append(f"{path}::{name}")
    assert not missing, f"{page.relative_to(ROOT)} cites tests that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for link in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # a URL or an anchor on the same page
        target = (page.parent / link.split("#", 1)[0]).resolve()
        if not target.exists() or ROOT not in target.parents:
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


# --- The Python examples in the pages run against the current API ---------------------------
#
# Every ```python block of README.md and docs/*.md runs here, the blocks of a page in order
# in one namespace (a later block may use an earlier one's names), on tiny inputs bound to
# the names the examples use (:func:`_inputs`). A block that cannot run in one process
# without a GPU (torchrun, a process group, verl) carries, on the line above its fence,
# ``<!-- not-run: <reason> -->``; the reason is required.

PY_FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
SNIPPET_PAGES = sorted(
    p
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    if p.exists() and PY_FENCE.search(p.read_text(encoding="utf-8"))
)
NOT_RUN = re.compile(r"<!--\s*not-run(?::\s*(.*?))?\s*-->\s*$")


def _blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, not-run reason or None)`` of each Python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    found = []
    for m in PY_FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").splitlines()
        mark = NOT_RUN.search(before[-1]) if before else None
        reason = None if mark is None else (mark.group(1) or "")
        found.append((text[: m.start()].count("\n") + 1, m.group(1), reason))
    return found


def _inputs(page: str) -> dict[str, object]:
    """Tiny tensors under the names the examples use: B=4 responses, R=5 response tokens
    after P=3 prompt tokens (S=8), vocabulary V=11 (32064 on logprobs.md, which names
    ``vocab_size=32000``), hidden size H=8."""
    import torch

    import rlmath

    torch.manual_seed(0)
    B, P, R, H = 4, 3, 5, 8
    S = P + R
    V = 32064 if page == "docs/logprobs.md" else 11
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    input_ids = torch.randint(3, V, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[0, :1] = 0  # a left-padded prompt
    attention_mask[1, -2:] = 0  # a right-padded response
    response_mask = attention_mask[:, P:].clone()
    nnz = int(attention_mask.sum())
    index = [0, 0, 1, 1]
    lm_head = torch.nn.Linear(H, V, bias=False)
    model = torch.nn.Identity()  # a varlen model (usage.md) with an LM head (fused_head.md)
    model.lm_head = lm_head
    log_prob = rand(B, R, grad=True)
    old_log_prob = log_prob.detach() + 0.1 * rand(B, R)
    micro_batches = [
        {
            "response_mask": response_mask[i : i + 2],
            "old_log_prob": old_log_prob[i : i + 2],
            "advantages": rand(2, R),
        }
        for i in (0, 2)
    ]
    ns: dict[str, object] = dict(
        torch=torch, B=B, T=S, R=R, H=H, V=V, batch_size=B, seqlen=S, response_length=R,
        max_response_length=R, input_ids=input_ids, ids=input_ids, attention_mask=attention_mask,
        responses=input_ids[:, P:], response_mask=response_mask, mask=response_mask,
        logits=rand(B, S, V, grad=True), ref_logits=rand(B, S, V),
        logits_rmpad=rand(nnz, V, grad=True), labels=input_ids,
        candidates=torch.randint(0, V, (B, S, 3), generator=g), temps=torch.rand(B) + 0.5,
        hidden=rand(B, S, H, grad=True), weight=lm_head.weight, lm_head=lm_head, model=model,
        head=lm_head, log_prob=log_prob, old_log_prob=old_log_prob,
        ref_log_prob=old_log_prob + 0.1 * rand(B, R), rollout_log_prob=old_log_prob + 0.1 * rand(B, R),
        entropy=rand(B, R).abs(), ent=rand(B, R).abs(), advantages=rand(B, R), values=rand(B, R),
        vpreds=rand(B, R, grad=True), returns=rand(B, R), token_level_rewards=rand(B, R),
        token_level_scores=rand(B, R), token_rewards=rand(B, R), scores=rand(B, R),
        rewards=rand(B), greedy_rewards=rand(B), scores_bk=rand(B, 2), index=index,
        group_ids=index, batch={"uid": index}, eos_id=1, eot_id=2, pad_token_id=0,
        varlen_model=lambda x, **kwargs: x, beta=0.01, entropy_coef=0.01, entropy_coeff=0.01,
        vf_coef=0.5, kl_coef=0.01, pg_loss=rand(()), dp_group=None, checkpoint={},
        log=lambda metrics: None, opt=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
        optimizer=torch.optim.SGD(lm_head.parameters(), lr=0.1), micro_batches=micro_batches,
        info=rlmath.global_batch_info(response_mask),
        kl_ctrl=rlmath.AdaptiveKLController(init_kl_coef=0.01, target_kl=0.05, horizon=1000),
        # GiGPO: two groups of two one-step trajectories.
        step_rewards_bt=rand(B, R), episode_group=index, trajectory=[0, 1, 2, 3],
        turn=[0, 0, 0, 0], state_hash=["s0", "s0", "s1", "s1"],
    )  # fmt: skip
    if page in ("README.md", "docs/index.md", "docs/hf.md"):
        policy = _hf_model(V)
        ns.update(policy=policy, reference=_hf_model(V), T=0.7)
    if page == "docs/fused_head.md":
        ns["advantages"] = rand(B, S)  # per position of hidden (B, S, H)
    if page == "docs/losses.md":
        ns["logits"] = rand(B, R, V, grad=True)  # compute_entropy_loss: response logits
    return ns


def _hf_model(vocab: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.fixture
def _registries_restored():
    """Examples may register estimators and losses: the registries are restored after."""
    from rlmath.advantages import registry as adv_registry
    from rlmath.losses import registry as loss_registry

    saved = [(r, dict(r)) for r in (adv_registry._REGISTRY, loss_registry._REGISTRY)]
    yield
    for registry, copy in saved:
        registry.clear()
        registry.update(copy)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`:UserWarning")
@pytest.mark.parametrize("page", SNIPPET_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_run(page, _registries_restored, capsys):
    blocks = _blocks(page)
    name = str(page.relative_to(ROOT))
    ns = _inputs(name)
    for line, code, reason in blocks:
        if reason is not None:
            continue
        try:
            exec(compile(code, f"{name}:{line}", "exec"), ns)
        except Exception as err:
            raise AssertionError(f"the example at {name}:{line} fails: {err!r}") from err


def test_examples_left_out_say_why():
    left_out = [
        (str(page.relative_to(ROOT)), line, reason)
        for page in SNIPPET_PAGES
        for line, _, reason in _blocks(page)
        if reason is not None
    ]
    unexplained = [f"{page}:{line}" for page, line, reason in left_out if not reason.strip()]
    assert not unexplained, f"<!-- not-run --> without a reason at {unexplained}"
    # The list of examples not run, in the test report.
    print("\n".join(f"{page}:{line}: not run ({reason})" for page, line, reason in left_out))


def test_the_example_shards_gpt2_vocabulary_as_documented():
    """examples/distributed_logprobs.py and docs/distributed.md give the same shard widths."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "distributed_logprobs_example", ROOT / "examples" / "distributed_logprobs.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    bounds = example.shard_bounds(2)
    widths = [b - a for a, b in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and bounds[-1] == example.VOCAB == 50257
    stated = " + ".join(map(str, widths))  # rank 0 first
    assert stated in (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    assert f"{widths[0]} columns on rank 0 and {widths[1]}" in " ".join(
        example.shard_bounds.__doc__.split()
    )


def test_the_stated_torch_minimum_is_the_declared_one():
    declared = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text("utf-8"))
    assert declared is not None
    for page in (ROOT / "README.md", ROOT / "docs" / "install.md"):
        text = page.read_text(encoding="utf-8")
        stated = re.findall(r"(?:torch>=|PyTorch ≥ |torch ≥ )(2\.\d+)", text)
        # torch >= 2.7 is named for FSDP2 on CPU only, never as the package's minimum.
        minima = {v for v in stated if v != "2.7"}
        assert minima <= {declared.group(1)}, (page.name, stated)


def _check_returns():
    pytest.importorskip(
        "griffe", reason="griffe is in the docs environment (docs/requirements.txt)"
    )
    pytest.importorskip("yaml")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_returns", ROOT / "docs" / "_ext" / "check_returns.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_returns_sections_are_one_item_each():
    """The site's parser (mkdocs.yml's options) reads each Returns section as one item."""
    assert _check_returns().garbled_returns() == []


def test_the_returns_check_finds_a_garbled_section(tmp_path):
    package = tmp_path / "garbled_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "def f(x: int) -> tuple[int, int]:\n"
        '    """Two numbers.\n\n'
        "    Returns:\n"
        "        (Sum, Product): the sum of x and\n"
        "        x (x * x) and more.\n"
        '    """\n'
        "    return x + x, x * x\n",
        encoding="utf-8",
    )
    check = _check_returns()
    found = check.garbled_returns("garbled_pkg", tmp_path)
    # One item under the site's options; several when each line is made an item.
    assert found == []
    options = check.handler_options()
    options["docstring_options"] = {"returns_multiple_items": True}
    original = check.handler_options
    check.handler_options = lambda: options
    try:
        found = check.garbled_returns("garbled_pkg", tmp_path)
    finally:
        check.handler_options = original
    assert found and found[0].startswith("garbled_pkg.f: ")
